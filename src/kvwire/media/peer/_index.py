"""The peer medium's scheduler half: its own pool's slots, and the shared directory.

The engine's own saves go to its CPU pool exactly as the CPU pool medium's
do (the same index decides slots and evicts the least recently used); once
a save completed, its blocks are announced in the directory under this
peer's name with their slot and that slot's *generation* (how many times
the slot was given out), and blocks evicted are withdrawn. Entries expire
in the directory (a peer that died leaves none behind for long), so each
scheduler step announces again those of the blocks the pool still holds
that were last announced half an expiry ago or more (at most
`REFRESH_BATCH` a step, oldest first). Lookups ask the directory alone,
once per request and KV cache group: a block counts when some peer (this
one included) announced it; a block this pool holds counts too, its entry
written again, when the directory lost it (expired before a step came,
withdrawn by a reader whose read of it stalled).

Every directory call here is on the scheduler's thread, and waits at most the
directory's deadline (see `PeerDirectory`); while the directory is down they
answer at once. A lookup then finds only this pool's own blocks. An
announcement that was not made is made again at the first step once the
directory is back, so hits resume at once. A withdrawal that was not made is
kept (up to `WITHDRAWAL_BACKLOG`) and made at the first step once the directory
is back: as a compare-and-delete it is safe at any later time. One dropped from
a full backlog leaves an entry naming a slot the pool may reuse until it
expires; a reader that follows it pulls bytes that fail verification, so it
computes the block and withdraws the entry. Nothing wrong is ever loaded.
Withdrawals dropped so are counted as `peer_withdrawals_dropped`.

Loads need no second round trip: the locations the last lookup found for
a group are handed to the worker with the load (`PeerIndex.prepare_load`'s
payload, `FoundLocations`; the scheduler allocates a request's blocks right
after looking it up). The worker asks the directory only for
blocks it was given no location for, and verifies every byte it pulls,
since a peer's slot may be reused at any time.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Sequence

from kvwire.blocks.transfers import TransferPayload
from kvwire.interface.types import BlockHash, BlockRemoved
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import LoadSpec
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import EvictionPolicy
from kvwire.media.peer._directory import FoundLocations, Location, PeerDirectory

# Entries announced again per scheduler step, at most: one pipelined round trip.
REFRESH_BATCH = 1024
# Withdrawals kept while the directory is down, at most (about 100 bytes each).
WITHDRAWAL_BACKLOG = 65536


class PeerIndex(CPUPoolIndex):
    """This peer's pool index over `num_slots` slots, announcing its blocks in `directory`.

    `fingerprints`: each KV cache group's name in the directory (the
    split's, `split_fingerprints`). A block
    is announced once, for every rank: its slot is the same on each.
    `withdrawal_backlog`: how many withdrawals an outage may hold back.
    `policy` and `admission`: the pool's eviction and admission of saves, as
    the CPU pool's.
    """

    def __init__(
        self,
        *,
        num_slots: int,
        fingerprints: Sequence[str],
        medium: str,
        peer: str,
        directory: PeerDirectory,
        withdrawal_backlog: int = WITHDRAWAL_BACKLOG,
        policy: EvictionPolicy | None = None,
        admission: SaveAdmission | None = None,
    ) -> None:
        super().__init__(num_slots, len(fingerprints), medium, policy=policy, admission=admission)
        self._fingerprints = tuple(fingerprints)
        self._peer = peer
        self._directory = directory
        self._generations = [0] * num_slots
        # (group, hash) -> where its save writes it / where it was announced.
        self._saving: dict[tuple[int, BlockHash], Location] = {}
        self._announced: dict[tuple[int, BlockHash], Location] = {}
        # (group, hash) -> when last announced (monotonic), oldest first.
        self._announced_at: dict[tuple[int, BlockHash], float] = {}
        # Per group, where the last lookup found each block it counted: one
        # request's blocks at most, replaced by the next lookup.
        self._found: list[dict[BlockHash, Location]] = [{} for _ in self._fingerprints]
        # Held blocks whose announcement may not have been made, oldest first.
        self._unannounced: dict[tuple[int, BlockHash], None] = {}
        # Withdrawals not made yet (key, location), oldest first.
        self._unwithdrawn: collections.deque[tuple[str, Location]] = collections.deque()
        self._withdrawal_backlog = withdrawal_backlog
        self._withdrawals_dropped = 0

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many blocks, from the first, some peer announced or this pool holds.

        One directory round trip, and one more only when the directory lost
        entries of blocks this pool holds: those are announced again.
        """
        fingerprint = self._fingerprints[group]
        keys = [self._directory.entry_key(fingerprint, block_hash) for block_hash in block_hashes]
        count = 0
        lost: list[tuple[int, BlockHash]] = []
        found: dict[BlockHash, Location] = {}
        for block_hash, location in zip(block_hashes, self._directory.look_up(keys), strict=True):
            if location is None:
                location = self._announced.get((group, block_hash))
                if location is None:
                    break
                lost.append((group, block_hash))
            found[block_hash] = location
            count += 1
        self._found[group] = found
        self._announce(lost)
        return count

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        """Nothing to pin: the worker reads each block where the last lookup of `group` found it.

        The payload (`FoundLocations`) is left out when the lookup found none of them.
        """
        found = self._found[group]
        locations = tuple(found.get(block_hash) for block_hash in block_hashes)
        if not any(locations):
            return LoadSpec()
        return LoadSpec(payload=FoundLocations(locations))

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        """Nothing to unpin; the worker withdrew the entries it found stale."""

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        placed = super().prepare_save(group, block_hashes)
        for block_hash, slot in placed:
            assert slot is not None
            self._generations[slot] += 1
            self._saving[group, block_hash] = Location(self._peer, slot, self._generations[slot])
        return placed

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """Made: announced (after the pool marks them hits). Not made: their slots are freed."""
        locations = [self._saving.pop((group, block_hash), None) for block_hash in block_hashes]
        super().complete_save(group, block_hashes, success=success)
        if not success:
            return
        made = []
        for block_hash, location in zip(block_hashes, locations, strict=True):
            if location is not None:
                self._announced[group, block_hash] = location
                made.append((group, block_hash))
        self._announce(made)

    def _announce(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Write these held blocks' entries, with a fresh expiry; one round trip.

        Blocks whose announcement may not have been made are kept, and
        announced again at the first step once the directory is back.
        """
        if not blocks:
            return
        now = time.monotonic()
        entries = []
        for group, block_hash in blocks:
            self._announced_at.pop((group, block_hash), None)  # to the end: newest
            self._announced_at[group, block_hash] = now
            self._unannounced.pop((group, block_hash), None)
            key = self._directory.entry_key(self._fingerprints[group], block_hash)
            entries.append((key, self._announced[group, block_hash]))
        if not self._directory.announce(entries):
            self._unannounced.update(dict.fromkeys(blocks))

    def _catch_up(self) -> None:
        """Once the directory answers again: the withdrawals, then the announcements, it missed.

        Withdrawals first: a reader then finds no entry for a slot the pool
        reused, rather than one it would refuse. At most `REFRESH_BATCH` of
        each per step, one round trip each.
        """
        if not self._directory.is_available:
            return
        if self._unwithdrawn:
            batch = [
                self._unwithdrawn.popleft()
                for _ in range(min(REFRESH_BATCH, len(self._unwithdrawn)))
            ]
            self._withdraw(batch)
        if self._unannounced and self._directory.is_available:
            blocks = list(itertools.islice(self._unannounced, REFRESH_BATCH))
            self._announce(blocks)

    def _withdraw(self, entries: Sequence[tuple[str, Location]]) -> None:
        """Withdraw these entries; keep them for later when the directory could not be asked."""
        if self._directory.withdraw(entries) is not None:
            return
        # Oldest first out: those are the likeliest to have expired already.
        self._unwithdrawn.extend(entries)
        excess = len(self._unwithdrawn) - self._withdrawal_backlog
        for _ in range(max(0, excess)):
            self._unwithdrawn.popleft()
        self._withdrawals_dropped += max(0, excess)

    def _refresh_expiring(self) -> None:
        """Announce again the oldest entries, those announced half an expiry ago or more."""
        due_before = time.monotonic() - self._directory.ttl_s / 2
        due: list[tuple[int, BlockHash]] = []
        for block, announced_at in self._announced_at.items():
            if announced_at > due_before or len(due) == REFRESH_BATCH:
                break
            due.append(block)
        self._announce(due)

    def _record_evictions(self) -> int:
        """The pool's removed events, and the removed blocks withdrawn from the directory."""
        first_new = len(self._events)
        count = super()._record_evictions()
        withdrawn = []
        for event in self._events[first_new:]:
            if not isinstance(event, BlockRemoved):
                continue
            group = event.group or 0
            fingerprint = self._fingerprints[group]
            for block_hash in event.block_hashes:
                self._announced_at.pop((group, block_hash), None)
                self._unannounced.pop((group, block_hash), None)
                location = self._announced.pop((group, block_hash), None)
                if location is not None:
                    key = self._directory.entry_key(fingerprint, block_hash)
                    withdrawn.append((key, location))
        # Before the slots are handed to new saves: a reader then finds no entry,
        # rather than one whose bytes are being overwritten (which it would refuse).
        if withdrawn:
            self._withdraw(withdrawn)
        return count

    def take_counters(self) -> dict[str, int]:
        """The step's counters; first, what the directory missed, and the step's refresh of
        entries about to expire."""
        self._catch_up()
        self._refresh_expiring()
        counters = dict(super().take_counters())
        failures = self._directory.take_failures()
        if failures:
            counters["peer_directory_failures"] = failures
        if self._withdrawals_dropped:
            counters["peer_withdrawals_dropped"] = self._withdrawals_dropped
            self._withdrawals_dropped = 0
        return counters

    def close(self) -> None:
        """Withdraw every block this peer announced (and the withdrawals it still owes), then
        drop the connections. With the directory down, the entries are left to expire."""
        self._directory.withdraw(
            [
                *self._unwithdrawn,
                *(
                    (self._directory.entry_key(self._fingerprints[group], block_hash), location)
                    for (group, block_hash), location in self._announced.items()
                ),
            ]
        )
        self._unwithdrawn.clear()
        self._unannounced.clear()
        self._announced.clear()
        self._announced_at.clear()
        self._directory.close()
