"""The worker processes of a parallel engine, joined in a torch.distributed (gloo) group.

Each rank's worker process joins the group through a file store the engine
created (so no port is chosen or shared); tensor ranks of a stage gather
their heads' attention outputs each layer, and a stage sends its residual
stream to the next stage's rank of the same tensor rank, as a real tensor-
and pipeline-parallel model does. Every collective waits at most
`timeout_s`: a rank that died or hangs fails the step, never blocks it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from kvwire.config import ParallelConfig


class RankGroup:
    """This process's place in the engine's process group: a `RankExchange` over gloo.

    `max_num_tokens` and `local_width` (this rank's query heads times
    the head size) size the buffers the gathers reuse every layer.
    """

    def __init__(
        self,
        store_path: str,
        parallel: ParallelConfig,
        *,
        max_num_tokens: int,
        local_width: int,
        timeout_s: float,
    ) -> None:
        self._parallel = parallel
        dist.init_process_group(
            "gloo",
            # Public (torch.distributed's docs list it); its stubs do not export it.
            store=dist.FileStore(store_path, parallel.world_size),  # type: ignore[attr-defined]
            rank=parallel.rank,
            world_size=parallel.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        tensor_size = parallel.tensor_parallel_size
        # Every rank creates every stage's group, in the same order (as
        # torch.distributed requires), and keeps its own.
        self._tensor_group = None
        for stage in range(parallel.pipeline_parallel_size):
            ranks = list(range(stage * tensor_size, (stage + 1) * tensor_size))
            group = dist.new_group(ranks) if tensor_size > 1 else None
            if stage == parallel.pipeline_rank:
                self._tensor_group = group
        self._gathered = torch.empty(tensor_size, max_num_tokens, local_width, dtype=torch.float64)
        self._heads = torch.empty(max_num_tokens, tensor_size * local_width, dtype=torch.float64)

    def gather_heads(self, local: torch.Tensor) -> torch.Tensor:
        num_tokens, width = local.shape
        parts = [self._gathered[rank, :num_tokens] for rank in range(len(self._gathered))]
        dist.all_gather(parts, local.contiguous(), group=self._tensor_group)
        heads = self._heads[:num_tokens]
        # [rank, tokens, width] to [tokens, rank * width]: the heads in model order.
        heads.view(num_tokens, len(parts), width).copy_(
            self._gathered[:, :num_tokens].transpose(0, 1)
        )
        return heads

    def send_hidden(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), self._parallel.rank + self._parallel.tensor_parallel_size)

    def receive_hidden(self, hidden: torch.Tensor) -> None:
        dist.recv(hidden, self._parallel.rank - self._parallel.tensor_parallel_size)

    def close(self) -> None:
        dist.destroy_process_group()
