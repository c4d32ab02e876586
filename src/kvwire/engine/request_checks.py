"""What a request must satisfy to enter the engine, checked when it is added.

Every check names the request, the value at fault and the limit that
refused it, so a caller can fix the request or the profile.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.config import EngineConfig
from kvwire.engine.block_manager import window_blocks
from kvwire.interface.types import Request


def check_request(
    request: Request, config: EngineConfig, group_windows: Sequence[int | None] = (None,)
) -> None:
    """Raise ValueError when `request` cannot run on an engine built from `config`.

    `group_windows` has one entry per KV cache group: its sliding window,
    or None for full attention.
    """
    model, cache = config.model_config, config.cache_config
    name = f"request {request.request_id!r}"
    if not request.prompt_token_ids:
        raise ValueError(f"{name}: the prompt is empty")
    bad = [t for t in request.prompt_token_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(
            f"{name}: token ids {bad[:5]} are outside "
            f"[0, model_config.vocab_size={model.vocab_size})"
        )
    if request.max_tokens < 1:
        raise ValueError(f"{name}: max_tokens must be >= 1, got {request.max_tokens}")
    total = request.num_prompt_tokens + request.max_tokens
    if total > model.max_model_len:
        raise ValueError(
            f"{name}: prompt ({request.num_prompt_tokens}) + max_tokens "
            f"({request.max_tokens}) exceeds model_config.max_model_len ({model.max_model_len})"
        )
    blocks = -(-total // cache.block_size)
    # Per KV cache group: all its blocks, or for a sliding-window group at
    # most its window and a step's chunk (it gives back what left the window).
    chunk = -(-config.scheduler_config.max_num_batched_tokens // cache.block_size) + 1
    needed_blocks = sum(
        blocks if window is None else min(blocks, window_blocks(window, cache.block_size) + chunk)
        for window in group_windows
    )
    usable = cache.num_gpu_blocks - (1 if any(w is not None for w in group_windows) else 0)
    if needed_blocks > usable:
        raise ValueError(
            f"{name} needs {needed_blocks} blocks but "
            f"cache_config.num_gpu_blocks is {cache.num_gpu_blocks}"
            + ("" if usable == cache.num_gpu_blocks else " (one is the null block)")
        )
