"""What a model's identity costs: digesting every byte of its weights, once, then recalling it.

Three figures on one weight file of ``SIZE`` bytes (random, so no file
system compresses it), in the same run:

1. ``read``: MB/s of reading the file into a reused buffer and nothing else,
   the bound a digest cannot beat;
2. ``uncached``: MB/s of :class:`kvwire.identity.file_digests.FileDigests` with an
   empty cache directory, as at a model's first start (the file comes from
   the page cache here, as it does right after a download or a copy);
3. ``cached``: seconds to recall the same digest from the cache (what
   every later start pays per weight file), and the digest's share of the
   bare read (``uncached / read``).

Then ``model``: seconds for :func:`kvwire.identity.model.weights_digest` of
a directory of ``SHARDS`` shards of ``SIZE // SHARDS`` bytes each, uncached
and cached (the shards are digested on up to ``PARALLEL_FILES`` threads).

``python -m benchmarks.weight_digest [--quick]``; writes ``weight_digest.json``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import MIB, write_json
from benchmarks.common import main as run_from_command_line
from kvwire.identity.file_digests import READ_BYTES, FileDigests
from kvwire.identity.model import PARALLEL_FILES, weights_digest

SIZE = 1536 * MIB
QUICK_SIZE = 128 * MIB
SHARDS = 4
REPEAT = 3


def run(output_dir: pathlib.Path, quick: bool) -> dict[str, Any]:
    size = QUICK_SIZE if quick else SIZE
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvwire-bench-digest-"))
    try:
        weights = work / "model.safetensors"
        _write_random(weights, size)
        read_s = min(_timed(lambda: _read_all(weights)) for _ in range(REPEAT))
        uncached_s = min(
            _timed(lambda: _fresh_digests(work).digest(str(weights))) for _ in range(REPEAT)
        )
        warm = _fresh_digests(work)
        warm.digest(str(weights))
        cached_s = min(_timed(lambda: warm.digest(str(weights))) for _ in range(REPEAT))
        model = work / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        for shard in range(SHARDS):
            _write_random(model / f"model-{shard:05d}-of-{SHARDS:05d}.safetensors", size // SHARDS)
        model_uncached_s = min(
            _timed(lambda: weights_digest(str(model), _fresh_digests(work))) for _ in range(REPEAT)
        )
        model_digests = _fresh_digests(work)
        weights_digest(str(model), model_digests)
        model_cached_s = min(
            _timed(lambda: weights_digest(str(model), model_digests)) for _ in range(REPEAT)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    megabytes = size / 1e6
    result = {
        "file_bytes": size,
        "read_mb_per_s": round(megabytes / read_s),
        "uncached_mb_per_s": round(megabytes / uncached_s),
        "uncached_share_of_read": round(read_s / uncached_s, 3),
        "cached_ms": round(cached_s * 1e3, 3),
        "model_shards": SHARDS,
        "model_threads": min(PARALLEL_FILES, SHARDS),
        "model_uncached_s": round(model_uncached_s, 3),
        "model_uncached_mb_per_s": round(megabytes / model_uncached_s),
        "model_cached_ms": round(model_cached_s * 1e3, 3),
        "cpus": os.cpu_count(),
    }
    write_json(output_dir, "weight_digest.json", result)
    return result


def _fresh_digests(work: pathlib.Path) -> FileDigests:
    # A new, empty cache directory each time; files written by the benchmark count as settled.
    return FileDigests(tempfile.mkdtemp(dir=work, prefix="cache-"), settle_ns=0)


def _write_random(path: pathlib.Path, size: int) -> None:
    with open(path, "wb") as file:
        for offset in range(0, size, 64 * MIB):
            file.write(os.urandom(min(64 * MIB, size - offset)))


def _read_all(path: pathlib.Path) -> None:
    buffer = bytearray(READ_BYTES)
    with open(path, "rb") as file:
        while file.readinto(buffer):
            pass


def _timed(step: Any) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(run_from_command_line("python -m benchmarks.weight_digest", run, sys.argv[1:]))
