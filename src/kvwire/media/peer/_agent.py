"""One NIXL agent per worker: its memory registered, other peers' reads into it.

NIXL (`nixl-cu12`, imported without CUDA) moves bytes between registered
memory regions of two agents over UCX: RDMA where there is some, TCP or
shared memory otherwise (`UCX_TLS`, `UCX_NET_DEVICES` choose, e.g.
`UCX_TLS=tcp,self,sm` on loopback). A peer learns another's agent from
its metadata (in the directory's peer record) and then *reads* the other's
pool slots into its own staging memory: with RDMA the holder's CPU does
nothing; over TCP the holder's UCX worker, progressed by NIXL's thread,
sends the bytes.

Every read has a deadline. NIXL cannot always cancel a read in flight (a
peer stalled mid-read): such a read's handle is kept, with the staging it
writes into, until NIXL reports it ended; only then is that staging given
out again, so no late byte lands in memory another read uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.exceptions import MissingExtraError
from kvwire.exceptions import NIXLUnavailableError as NIXLUnavailableError

logger = logging.getLogger(__name__)

# Polling a read in flight: short at first (a loopback read of a few blocks
# takes well under a millisecond), then backing off to this.
_MAX_POLL_S = 0.002
# The longest NIXL's progress thread sleeps with nothing to progress (it wakes
# at once when UCX has work: a peer's read to serve, a reply to take in).
_PROGRESS_WAKE_US = 1000


# NIXL's Python API: nixl-cu12's (what the peer extra installs), else the nixl meta-package's.
_NIXL_PACKAGES = ("nixl_cu12", "nixl")


def nixl_missing() -> MissingExtraError | None:
    """The error saying to install the peer extra when no NIXL package is installed, else None.

    Asks the import system where NIXL would be found without importing it
    (NIXL's bindings are slow to load), so a profile's check stays cheap.
    """
    for package in _NIXL_PACKAGES:
        try:
            if importlib.util.find_spec(package) is not None:
                return None
        except ImportError:
            continue
    return MissingExtraError("the peer medium", _NIXL_PACKAGES[0], "peer")


def _nixl_api() -> Any:
    """NIXL's Python API module, `nixl_cu12`'s, else the `nixl` meta-package's."""
    for module in (f"{package}._api" for package in _NIXL_PACKAGES):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise NIXLUnavailableError(
        "the peer medium needs NIXL: install kvwire's peer extra "
        "(pip install 'kvwire[peer]', which pins nixl-cu12==1.5.1)"
    )


def coalesce(pieces: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int, int]]:
    """`pieces` of `length` bytes as (local, remote, size) runs, adjacent pieces joined.

    A piece that follows the previous one both here and at the peer (the
    usual case: a request's blocks were stored in consecutive slots and land
    in consecutive staging) extends its run, so a load is a few large
    descriptors rather than one per block.
    """
    runs: list[tuple[int, int, int]] = []
    for local, remote in pieces:
        if runs:
            start_local, start_remote, size = runs[-1]
            if local == start_local + size and remote == start_remote + size:
                runs[-1] = (start_local, start_remote, size + length)
                continue
        runs.append((local, remote, length))
    return runs


def _start_agent(api: Any, name: str) -> Any:
    """A NIXL agent with the UCX backend, progressed by NIXL's own thread, which sleeps when idle.

    Over TCP a read needs both sides' UCX workers progressed: the holder's to
    send, the reader's to take the bytes in. NIXL's progress thread does it
    without the GIL, waiting in `poll()` on the workers' event descriptors
    for at most its delay, so it wakes as soon as there is work. (Progressed
    from a Python thread every millisecond instead, a pull between two vLLM
    engines took 0.09-0.12 s against 0.08-0.10 s, and an idle agent cost
    0.06 CPU-seconds per second against 0.02.) NIXL's Python wrapper starts
    that thread with a delay of 0, a loop that never sleeps and takes a core
    even when idle; so the wrapper is made without a backend, given an agent
    built from NIXL's bindings with a delay, and the backend is created on it.
    """
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT  # several load threads at once
    wrapper = api.nixl_agent(
        name, api.nixl_agent_config(enable_prog_thread=True, backends=[], sync_mode=sync)
    )
    config = api.nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = sync.value
    config.pthrDelay = _PROGRESS_WAKE_US
    wrapper.agent = api.nixlBind.nixlAgent(name, config)
    wrapper.create_backend("UCX")
    return wrapper


class PendingRead:
    """A read that ran past its deadline and that NIXL could not cancel yet."""

    def __init__(self, handle: Any, on_end: Callable[[], None]) -> None:
        self.handle = handle
        self.on_end = on_end


class PeerAgent:
    """A NIXL agent named `name` with `regions` (contiguous CPU tensors) registered."""

    def __init__(self, name: str, regions: Sequence[Any]) -> None:
        api = _nixl_api()
        try:
            self._agent = _start_agent(api, name)
        except Exception as error:
            raise NIXLUnavailableError(
                f"the peer medium could not start a NIXL agent: {type(error).__name__}: "
                f"{str(error)[:200]}"
            ) from error
        if "UCX" not in self._agent.backends:
            raise NIXLUnavailableError(
                "the peer medium needs NIXL's UCX backend, which this NIXL build lacks"
            )
        self.name = name
        self._registered = [self._agent.register_memory(region) for region in regions]
        self._lock = threading.Lock()
        self._remotes: dict[str, bytes] = {}
        self._pending: list[PendingRead] = []

    @property
    def metadata(self) -> bytes:
        """What another agent needs to read from this one (connection and memory keys)."""
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def knows(self, peer: str, metadata: bytes) -> bool:
        """Load `peer`'s agent from `metadata` unless known as is; False if unusable."""
        with self._lock:
            if self._remotes.get(peer) == metadata:
                return True
            if peer in self._remotes:
                # The peer restarted under its name: its old agent is gone.
                self._forget_locked(peer)
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as error:
                logger.warning(
                    "peer medium: the agent metadata of peer %r cannot be loaded: %s",
                    peer[:64],
                    str(error)[:200],
                )
                return False
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer:
                # A record under one name holding another's agent: not this peer.
                self._agent.remove_remote_agent(name)
                return False
            self._remotes[peer] = metadata
            return True

    def forget(self, peer: str) -> None:
        """Drop `peer`'s agent (it died, or reads from it fail): a later read loads it again."""
        with self._lock:
            self._forget_locked(peer)

    def _forget_locked(self, peer: str) -> None:
        if self._remotes.pop(peer, None) is None:
            return
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as error:
            logger.debug("peer medium: forgetting peer %r: %s", peer[:64], error)

    def read(
        self,
        peer: str,
        pieces: Sequence[tuple[int, int]],
        length: int,
        deadline: float,
        on_late_end: Callable[[], None],
    ) -> str:
        """Read `length` bytes from each remote address into its local one, by `deadline`.

        `pieces` are (local address, remote address) pairs. Returns
        `"done"` once every byte arrived, `"failed"` on an error or
        past the deadline with the read cancelled, `"late"` past the
        deadline with the read still in flight: `on_late_end` is then
        called once it ended, and until then its local memory must not be
        given to another read.
        """
        self.reap()
        agent = self._agent
        try:
            runs = coalesce(pieces, length)
            local = agent.get_xfer_descs([(at, size, 0) for at, _, size in runs], "DRAM")
            remote = agent.get_xfer_descs([(at, size, 0) for _, at, size in runs], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(handle)
        except Exception as error:
            # A peer gone since its metadata was loaded, an address it never registered.
            logger.debug("peer medium: read from %r refused: %s", peer[:64], str(error)[:200])
            return "failed"
        pause = 0.00005
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S)
            try:
                state = agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
        if state == "PROC":
            try:
                handle.release()  # cancels the read where the backend can
            except Exception:
                with self._lock:
                    self._pending.append(PendingRead(handle, on_late_end))
                return "late"
            return "failed"
        self._release(handle)
        return "done" if state == "DONE" else "failed"

    @staticmethod
    def _release(handle: Any) -> None:
        try:
            handle.release()
        except Exception as error:
            logger.debug("peer medium: releasing a read: %s", error)

    def reap(self) -> int:
        """Release the overdue reads that ended since; how many are still in flight."""
        with self._lock:
            pending, self._pending = self._pending, []
        still = []
        for read in pending:
            try:
                ended = self._agent.check_xfer_state(read.handle) != "PROC"
            except Exception:
                ended = True
            if ended:
                self._release(read.handle)
                read.on_end()
            else:
                still.append(read)
        with self._lock:
            self._pending.extend(still)
            return len(self._pending)

    def close(self) -> None:
        """Forget every peer and deregister the memory (reads still in flight are dropped)."""
        with self._lock:
            for peer in list(self._remotes):
                self._forget_locked(peer)
        for registered in self._registered:
            try:
                self._agent.deregister_memory(registered)
            except Exception as error:
                logger.debug("peer medium: deregistering memory: %s", error)
        self._registered = []
