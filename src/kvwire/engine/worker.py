"""The worker: the paged KV cache, the model, and the worker-side connector calls.

Per step, in vLLM's order: bind the step's metadata,
`handle_preemptions` and `start_load_kv` before the forward pass,
`wait_for_layer_load` before and `save_kv_layer` after each layer's
attention, `wait_for_save` when the pass ends, then `get_finished`, the
load errors, the stats and the KV cache events, and finally
`clear_connector_metadata`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.config import EngineConfig
from kvwire.engine.batch import StepBatch
from kvwire.engine.connector_source import ConnectorSource
from kvwire.engine.model import AttentionMetadata, TinyTransformer
from kvwire.engine.paged_cache import PagedKVCache
from kvwire.engine.step import StepResult, WorkerStep
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.types import ForwardContext, KVConnectorOutput


class Worker:
    """Runs `model` over the paged `kv_cache`, and drives the worker-side connector.

    The worker-side connector comes from `connector_source`; in process
    mode that source lives in the worker's process. The parts are built by
    a `kvwire.engine.container.WorkerContainer`.

    One rank of a parallel engine holds its share (its heads of its
    stage's layers, in `kv_cache` and `model`) and its model trades
    activations with the other ranks; only the last stage samples tokens.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: PagedKVCache,
        model: TinyTransformer,
        connector_source: ConnectorSource,
        *,
        torch_threads: int | None = 1,
    ) -> None:
        if torch_threads is not None:
            # Process-wide: the worker owns this process's compute. One thread
            # suits small models, whose ops are too short to split.
            torch.set_num_threads(torch_threads)
        self.layer_names = kv_cache.layer_names
        self.layer_groups = kv_cache.layer_groups
        self.num_groups = kv_cache.num_groups
        self.block_size = config.cache_config.block_size
        self.kv_caches = kv_cache.tensors
        self._kv_cache_list = [self.kv_caches[name] for name in self.layer_names]
        scheduler_config = config.scheduler_config
        self._batch = StepBatch(
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_num_seqs,
            config.model_config.max_model_len,
            self.block_size,
            self.num_groups,
        )
        self._sampled_ids = torch.zeros(scheduler_config.max_num_seqs, dtype=torch.int64)
        self.model = model
        self.connector: KVConnectorBase | None = connector_source.connector(KVConnectorRole.WORKER)
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches)
            # Asked once, as vLLM's worker asks; this engine has no peers to send it to.
            self.connector.get_handshake_metadata()
        self._attn_metadata: tuple[AttentionMetadata, ...] | None = None
        self._layer_index = {name: index for index, name in enumerate(self.layer_names)}

    def execute(self, step: WorkerStep) -> StepResult:
        """Run one step: connector calls around the forward pass, then greedy sampling."""
        if step.scrub_block_ids:
            # First: a load of this step may fill one of these blocks again.
            self._scrub(step.scrub_block_ids)
        connector = self.connector
        metadata = token_ids = sample_rows = None
        if step.chunks:
            metadata, token_ids, sample_rows = self._batch.fill(step.chunks)
        self._attn_metadata = metadata
        if connector is not None:
            assert step.connector_metadata is not None
            connector.bind_connector_metadata(step.connector_metadata)
            # As vLLM's model runner: blocks of preempted requests may
            # be reused by this forward pass, so their transfers end first.
            connector.handle_preemptions(step.connector_metadata)
            connector.start_load_kv(ForwardContext(self.layer_names, self._forward_metadata()))
        logits = None
        if metadata is not None:
            assert token_ids is not None and sample_rows is not None
            logits = self.model.forward(
                token_ids,
                metadata,
                self._kv_cache_list,
                sample_rows,
                before_attention=self._before_attention,
                after_attention=self._after_attention,
            )
        connector_output = None
        if connector is not None:
            connector_output = self._end_connector_step(connector, step)
        sampled: dict[str, int] = {}
        if logits is not None:
            sampling = [chunk.request_id for chunk in step.chunks if chunk.sample]
            chosen = self._sampled_ids[: logits.shape[0]]
            next_tokens = torch.argmax(logits, dim=-1, out=chosen).tolist()
            sampled = dict(zip(sampling, next_tokens, strict=True))
        return StepResult(sampled_token_ids=sampled, connector_output=connector_output)

    def _end_connector_step(
        self, connector: KVConnectorBase, step: WorkerStep
    ) -> KVConnectorOutput:
        """After the forward pass: wait for saves, collect what finished, unbind."""
        connector.wait_for_save()
        sending, receiving = connector.get_finished(set(step.finished_req_ids))
        invalid = set(connector.get_block_ids_with_load_errors())
        output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=receiving,
            kv_connector_stats=connector.get_kv_connector_stats(),
            invalid_block_ids=invalid,
            kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return output

    def wait_for_saves(self, timeout_s: float) -> tuple[bool, KVConnectorOutput | None]:
        """Wait for the connector's saves in flight: whether all ended, their stats and events."""
        if self.connector is None:
            return True, None
        finished = self.connector.wait_for_pending_saves(timeout_s)
        return finished, KVConnectorOutput(
            kv_connector_stats=self.connector.get_kv_connector_stats(),
            kv_cache_events=self.connector.get_kv_connector_kv_cache_events(),
        )

    def gather_kv(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> torch.Tensor:
        """A request's first `num_tokens` tokens of KV: `[layers, 2, tokens, heads, dim]`.

        `block_ids` has one list per group; each layer is read with its
        group's. A sliding-window group's positions that left the window
        read the null block, which is never written: zeros.
        """
        indexes = [torch.tensor(list(group_blocks), dtype=torch.long) for group_blocks in block_ids]
        per_layer = [
            cache[:, indexes[group]].flatten(1, 2)[:, :num_tokens].clone()
            for cache, group in zip(self._kv_cache_list, self.layer_groups, strict=True)
        ]
        return torch.stack(per_layer)

    # ------------------------------------------------------------ internals

    def _scrub(self, block_ids: frozenset[int]) -> None:
        """Zero these blocks in every layer (ids are unique across groups: one pool)."""
        index = torch.tensor(sorted(block_ids), dtype=torch.long)
        for cache in self._kv_cache_list:
            cache.index_fill_(1, index, 0)

    def _before_attention(self, layer_name: str) -> None:
        if self.connector is not None:
            self.connector.wait_for_layer_load(layer_name)

    def _after_attention(self, layer_name: str) -> None:
        if self.connector is not None:
            metadata = self._attn_metadata
            layer_metadata = (
                None
                if metadata is None
                else metadata[self.layer_groups[self._layer_index[layer_name]]]
            )
            self.connector.save_kv_layer(layer_name, self.kv_caches[layer_name], layer_metadata)

    def _forward_metadata(self) -> object:
        """The step's attention metadata as connectors see it in `ForwardContext`.

        One group: its metadata. Several: a mapping of layer name to the
        metadata of the layer's group, as vLLM gives per layer.
        """
        metadata = self._attn_metadata
        if metadata is None or self.num_groups == 1:
            return None if metadata is None else metadata[0]
        return {
            name: metadata[group]
            for name, group in zip(self.layer_names, self.layer_groups, strict=True)
        }
