"""Which LoRA adapter computed a block: a key of its weights, folded into its requests' keys.

A request served with a LoRA adapter computes other KV than the base model
for the same tokens. The engine's block hash names the adapter only by what
the request calls it (vLLM: its name and path, `lora` in two working
directories is two adapters), and the layout's fingerprint names only the
base model. So every block hash of such a request is re-derived as
`fold_block_hash` of the adapter's key, a digest of its identity:
decided as a model's is (`kvwire.identity.model.model_identity`: every
byte of its weights and `adapter_config.json`, each file's digest computed
once and remembered while the file is unchanged; a hub id's commit).

An adapter is pinned by the engine's id for it (vLLM's `lora_int_id`),
which is what a worker keeps it loaded under: the first time an id is seen,
its files' stamps and identity are remembered. If that id later names
another path, or the files there change, the weights a worker holds may be
either: the id's requests share nothing from then on (warned). An adapter
whose files cannot be read has no key (warned, at most every
`WARNING_INTERVAL_S`): its requests look nothing up and save nothing;
it is tried again at its next request (a hub adapter is downloaded when a
worker first loads it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs

from kvwire.common.redaction import shown
from kvwire.identity.file_digests import FileDigests, FileStamp
from kvwire.identity.model import ModelIdentityError, model_identity

logger = logging.getLogger(__name__)

WARNING_INTERVAL_S = 60.0
# Adapter ids remembered; past it the least recently used is forgotten (and
# identified again from its files if it comes back).
CAPACITY = 4096
_FOLD_VERSION = b"kvwire-adapter-block-v1\0"

Stamps = tuple[tuple[str, FileStamp], ...]


def fold_block_hash(adapter_key: bytes, block_hash: bytes) -> bytes:
    """The key of a block an adapter computed: its hash, bound to the adapter's weights."""
    return hashlib.sha256(_FOLD_VERSION + adapter_key + block_hash).digest()


@attrs.frozen
class _Pinned:
    path: str
    stamps: Stamps
    key: bytes | None


class AdapterKeys:
    """Each adapter's key (32 bytes), by the id the engine loads it under; None: unknown.

    `file_digests` remembers weight files' digests (default: the per-user
    cache); `hub_caches` are where a hub id's commit is looked up.
    """

    def __init__(
        self,
        file_digests: FileDigests | None = None,
        hub_caches: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
        capacity: int = CAPACITY,
    ) -> None:
        self._file_digests = file_digests if file_digests is not None else FileDigests()
        self._hub_caches = tuple(hub_caches)
        self._clock = clock
        self._capacity = capacity
        self._pinned: OrderedDict[int, _Pinned] = OrderedDict()
        self._warned_at: float | None = None
        self._unwarned = 0

    def key(self, adapter_id: int, name: str, path: str) -> bytes | None:
        """The key of adapter `adapter_id` (found at `path`); None if it cannot be sure."""
        local = os.path.expanduser(path)
        try:
            stamps = _stamps(local) if os.path.exists(local) else ()
        except OSError as error:
            where = f": {shown(os.path.basename(str(error.filename)))}" * bool(error.filename)
            self._warn(name, path, f"its files cannot be read ({error.strerror}{where})")
            return None
        pinned = self._pinned.get(adapter_id)
        if pinned is not None:
            self._pinned.move_to_end(adapter_id)
            if pinned.key is not None and (pinned.path, pinned.stamps) != (path, stamps):
                self._pinned[adapter_id] = attrs.evolve(pinned, key=None)
                self._warn(
                    name,
                    path,
                    "its id now names another path or its files changed while it was served, "
                    "so a worker may hold either; serve changed weights under a new "
                    "lora_int_id and name",
                )
                return None
            if pinned.key is None:
                return None
            return pinned.key
        try:
            identity = model_identity(
                local if stamps else path,
                hub_caches=self._hub_caches,
                file_digests=self._file_digests,
            )
        except ModelIdentityError as error:
            self._warn(name, path, str(error))
            return None
        key = hashlib.sha256(identity.encode()).digest()
        self._pinned[adapter_id] = _Pinned(path=path, stamps=stamps, key=key)
        while len(self._pinned) > self._capacity:
            self._pinned.popitem(last=False)
        return key

    def _warn(self, name: str, path: str, why: str) -> None:
        # `why` is kvwire's own bounded text (values in it already shown).
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < WARNING_INTERVAL_S:
            self._unwarned += 1
            return
        more = f" ({self._unwarned} more such requests since the last warning)" * bool(
            self._unwarned
        )
        self._warned_at, self._unwarned = now, 0
        logger.warning(
            "kvwire: the LoRA adapter %s at %s cannot be identified by its weights: %s; its "
            "requests load and save no KV%s",
            shown(name),
            shown(path),
            why,
            more,
        )


def _stamps(path: str) -> Stamps:
    """The stamps of `path` and, for a directory, of every file in it: they change with it."""
    stamps = [("", FileStamp.of(os.stat(path)))]
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            stamps.append((name, FileStamp.of(os.stat(os.path.join(path, name)))))
    return tuple(stamps)
