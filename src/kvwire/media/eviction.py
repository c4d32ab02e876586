"""Eviction policies: which entry a full cache of slots gives up, each policy a plug-in.

A policy orders the entries of a cache of `capacity` slots. The cache tells
it what happens (`insert` a new entry, `hit` an entry used again, `remove`
one it dropped for its own reasons) and asks it for a `victim` when it needs
a slot. Some entries cannot be evicted at the moment (the CPU pool's entries
being loaded or still being saved): `victim` is given a test and passes them
over. Every call costs O(1) amortized: an entry passed over is treated as
used now, so that the next `victim` does not meet it again.

Four policies ship, named in the CPU pool's `eviction` option:

- `lru` (`kvwire.media.eviction.LRUPolicy`): the least recently used entry.
- `s3fifo` (`kvwire.media.eviction.S3FIFOPolicy`): S3-FIFO (Yang et al.,
  SOSP 2023), a small FIFO queue for entries seen once, a main FIFO queue for
  entries used again, and a ghost queue remembering what left the small queue
  recently. One-off entries leave from the small queue without disturbing the
  main queue, so a scan of blocks used once does not flush the blocks reused
  often.
- `arc` (`kvwire.media.eviction.ARCPolicy`): ARC (Megiddo and
  Modha, FAST 2003), a recency list and a frequency list whose shares adapt
  to what the ghosts of each list say was evicted too early. Blocks used
  once stay in the recency list, so a scan does not flush the blocks used
  again either.
- `kvfifo` (`kvwire.media.eviction.KVFIFOPolicy`): S3-FIFO's queues with
  what KV traffic says of its blocks. The small queue's share adapts as
  ARC's recency list does, to what the ghosts of each queue say was evicted
  too early; a block that continues a prompt an earlier prompt ended
  at (a conversation's next turn, an agent's next step: the cache tells it
  through `insert_continuing`) enters the main queue at once, where a block
  of a prompt that shared only a common prefix (likely a one-off) waits in
  the small queue for a second use; and the main queue keeps its entries in
  recency order, so that it gives up a prefix from its tail.

The cache may tell a policy more than `insert`: `insert_continuing` marks
a new entry whose prompt grows an earlier prompt. Its default is `insert`,
so a policy that has no use for it needs nothing.

A policy of one's own derives from
`kvwire.media.eviction.EvictionPolicy` and is named by its
`package.module:Class`, by an entry point of the `kvwire.eviction_policies`
group, or through `registry.eviction_policies.register_policy`.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["ARCPolicy", "EvictionPolicy", "KVFIFOPolicy", "LRUPolicy", "S3FIFOPolicy"]

Evictable = Callable[[int], bool]
"""Whether the entry of a slot may be evicted now."""


class EvictionPolicy(abc.ABC):
    """The order in which a cache of `capacity` slots evicts its entries.

    Entries are named by their slot (an int below `capacity`); `block`
    names what a slot holds, for policies that remember entries after they
    left (a slot is reused by another block).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity >= 1, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many entries the policy orders."""

    @abc.abstractmethod
    def insert(self, slot: int, block: Hashable) -> None:
        """`slot` now holds `block`, a new entry: told once, until `victim` or `remove` frees it."""

    def insert_continuing(self, slot: int, block: Hashable) -> None:
        """`slot` now holds `block`, a new entry of a prompt that grows an earlier prompt.

        The prompt's prefix held by the cache ended where an earlier prompt
        ended: a conversation's next turn or an agent's next step, whose
        blocks are likely asked for again when it goes on. A hint only: by
        default the entry is inserted as any other.
        """
        self.insert(slot, block)

    @abc.abstractmethod
    def hit(self, slot: int) -> None:
        """The entry of `slot` is used again."""

    @abc.abstractmethod
    def remove(self, slot: int) -> None:
        """The cache dropped the entry of `slot` itself (not through `victim`)."""

    @abc.abstractmethod
    def victim(self, evictable: Evictable) -> int | None:
        """The slot whose entry to evict, already forgotten here; None when none is evictable."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Least recently used first.
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, slot: int, block: Hashable) -> None:
        self._order[slot] = None

    def hit(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        del self._order[slot]

    def victim(self, evictable: Evictable) -> int | None:
        # An entry in use counts as used now: moved to the end, met once per pass.
        for _ in range(len(self._order)):
            slot = next(iter(self._order))
            if evictable(slot):
                del self._order[slot]
                return slot
            self._order.move_to_end(slot)
        return None


class _FIFOQueues(EvictionPolicy):
    """What S3-FIFO and kvfifo share: a small and a main FIFO queue, each entry counting uses.

    The small queue gives up entries while it holds `_small_target` or more:
    its oldest entry moves to the main queue (count back at 0) if it was used
    again, else it is evicted (`_evicted_from_small`). The main queue's
    oldest entry is evicted if its count is 0 (`_evicted_from_main`), else
    it goes around once more with its count lowered by one. Each policy
    decides which queue a new entry enters, and what its ghosts remember.
    """

    MAX_USES = 3

    def __init__(self, capacity: int, small_target: int) -> None:
        super().__init__(capacity)
        self._small_target = small_target
        # Oldest first; the value is the entry's use count.
        self._small: OrderedDict[int, int] = OrderedDict()
        self._main: OrderedDict[int, int] = OrderedDict()
        # Each slot's block, as its hash: what a ghost queue remembers of it.
        self._blocks: dict[int, int] = {}
        # The entries a `victim` call passed over as in use, reused by every call.
        self._in_use_small: set[int] = set()
        self._in_use_main: set[int] = set()

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def hit(self, slot: int) -> None:
        queue = self._small if slot in self._small else self._main
        queue[slot] = min(queue[slot] + 1, self.MAX_USES)

    def remove(self, slot: int) -> None:
        if self._small.pop(slot, None) is None:
            del self._main[slot]
        del self._blocks[slot]

    def victim(self, evictable: Evictable) -> int | None:
        # Every turn evicts, lowers a count (at most MAX_USES per entry), moves
        # an entry from small to main (once per entry), or passes over an entry
        # in use, which stays in use for the whole call: bounded. A queue whose
        # every entry is in use is out of the call, so the other one gives the
        # victim even where the small queue's share would pick this one.
        small, main = self._small, self._main
        in_use_small, in_use_main = self._in_use_small, self._in_use_main
        in_use_small.clear()
        in_use_main.clear()
        while True:
            small_open = len(in_use_small) < len(small)
            main_open = len(in_use_main) < len(main)
            if small_open and (len(small) >= self._small_target or not main_open):
                slot, uses = next(iter(small.items()))
                if not evictable(slot):
                    small.move_to_end(slot)
                    in_use_small.add(slot)
                elif uses > 0:
                    del small[slot]
                    main[slot] = 0
                else:
                    del small[slot]
                    self._evicted_from_small(self._blocks.pop(slot))
                    return slot
            elif main_open:
                slot, uses = next(iter(main.items()))
                if not evictable(slot):
                    main.move_to_end(slot)
                    in_use_main.add(slot)
                elif uses > 0:
                    main.move_to_end(slot)
                    main[slot] = uses - 1
                else:
                    del main[slot]
                    self._evicted_from_main(self._blocks.pop(slot))
                    return slot
            else:
                return None

    @abc.abstractmethod
    def _evicted_from_small(self, key: int) -> None:
        """The block (its hash) of an entry the small queue evicted."""

    @abc.abstractmethod
    def _evicted_from_main(self, key: int) -> None:
        """The block (its hash) of an entry the main queue evicted."""


class S3FIFOPolicy(_FIFOQueues):
    """S3-FIFO: a small FIFO (a tenth of the slots), a main FIFO, and a ghost FIFO.

    A new entry enters the small queue, unless the ghost queue remembers its
    block (it left the small queue recently, so it is used again: it enters
    the main queue). Each entry counts its uses, up to 3. When the small queue
    holds its share, its oldest entry is evicted if it was not used again
    (its block joins the ghost queue) or moves to the main queue, its count
    back at 0, if it was.
    The main queue's oldest entry is evicted if its count is 0, else it goes
    around once more with its count lowered by one. The ghost queue keeps as
    many blocks as the main queue has slots, each as a hash: an int per
    block, whatever the block's key.
    """

    SMALL_SHARE = 0.1
    """The share of the slots the small queue holds before it gives up entries."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, max(1, int(capacity * self.SMALL_SHARE)))
        self._ghost_limit = max(1, capacity - self._small_target)
        self._ghost: OrderedDict[int, None] = OrderedDict()

    def insert(self, slot: int, block: Hashable) -> None:
        key = hash(block)
        self._blocks[slot] = key
        if key in self._ghost:
            del self._ghost[key]
            self._main[slot] = 0
        else:
            self._small[slot] = 0

    def _evicted_from_small(self, key: int) -> None:
        self._ghost[key] = None
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)

    def _evicted_from_main(self, key: int) -> None:
        return None  # S3-FIFO's ghosts remember only what left the small queue


class ARCPolicy(EvictionPolicy):
    """ARC: entries used once (`recent`) and used again (`frequent`), each with a ghost list.

    Both lists are least recently used first. An entry used again moves to
    `frequent`. The victim comes from `recent` while it holds more than its
    target share, else from `frequent`; its block joins that list's ghost
    list. A new entry whose block a ghost list remembers enters `frequent`,
    and moves the target: a block evicted from `recent` too early grows
    `recent`'s share, one evicted from `frequent` too early shrinks it. The
    slot for an entry is taken before the entry arrives, so the target moves
    one eviction later than in the paper's algorithm. The ghost lists keep
    at most as many blocks as there are slots, each as a hash.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._target = 0
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._frequent: OrderedDict[int, None] = OrderedDict()
        self._recent_ghosts: OrderedDict[int, None] = OrderedDict()
        self._frequent_ghosts: OrderedDict[int, None] = OrderedDict()
        self._blocks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._recent) + len(self._frequent)

    def insert(self, slot: int, block: Hashable) -> None:
        key = hash(block)
        self._blocks[slot] = key
        recent_ghosts, frequent_ghosts = self._recent_ghosts, self._frequent_ghosts
        if key in recent_ghosts:
            grow = max(len(frequent_ghosts) // len(recent_ghosts), 1)
            self._target = min(self.capacity, self._target + grow)
            del recent_ghosts[key]
            self._frequent[slot] = None
        elif key in frequent_ghosts:
            shrink = max(len(recent_ghosts) // len(frequent_ghosts), 1)
            self._target = max(0, self._target - shrink)
            del frequent_ghosts[key]
            self._frequent[slot] = None
        else:
            self._recent[slot] = None
        self._trim_ghosts()

    def hit(self, slot: int) -> None:
        if self._recent.pop(slot, 0) is None:
            self._frequent[slot] = None
        else:
            self._frequent.move_to_end(slot)

    def remove(self, slot: int) -> None:
        if self._recent.pop(slot, 0) is not None:
            del self._frequent[slot]
        del self._blocks[slot]

    def victim(self, evictable: Evictable) -> int | None:
        # The list ARC's target picks first; when every entry there is in use,
        # the other. An entry in use moves to its list's end: met once per call.
        recent = (self._recent, self._recent_ghosts)
        frequent = (self._frequent, self._frequent_ghosts)
        picked_first = self._recent and (len(self._recent) > self._target or not self._frequent)
        for entries, ghosts in (recent, frequent) if picked_first else (frequent, recent):
            for _ in range(len(entries)):
                slot = next(iter(entries))
                if evictable(slot):
                    del entries[slot]
                    ghosts[self._blocks.pop(slot)] = None
                    self._trim_ghosts()
                    return slot
                entries.move_to_end(slot)
        return None

    def _trim_ghosts(self) -> None:
        """The recent list and its ghosts hold at most a pool's worth, all ghosts too."""
        recent_ghosts, frequent_ghosts = self._recent_ghosts, self._frequent_ghosts
        while recent_ghosts and len(self._recent) + len(recent_ghosts) > self.capacity:
            recent_ghosts.popitem(last=False)
        while len(recent_ghosts) + len(frequent_ghosts) > self.capacity:
            (frequent_ghosts or recent_ghosts).popitem(last=False)


class KVFIFOPolicy(_FIFOQueues):
    """S3-FIFO's small and ghost queues, a main queue in recency order, the small share adapting.

    A new entry enters the small queue, unless a ghost queue remembers its
    block (it was evicted, so it is used again) or its prompt continues an
    earlier one (`insert_continuing`): those enter the main queue. Each
    entry counts its uses, up to 4 (one more than S3-FIFO's: a block many
    prompts share, a system prompt or a popular document, outlives one more
    pass of the main queue). The small queue gives up entries while it
    holds its target share: its oldest entry moves to the main queue
    (count back at 0) if it was used again, else it is evicted and its block
    joins the small queue's ghosts. An entry of the main queue used again
    moves to its end, as in LRU: a prefix is hit from its last block to its
    first, so the main queue gives up a prefix from its tail, where a FIFO
    order would cut one in the middle. The main queue's oldest entry is
    evicted if its count is 0 (its block joins the main queue's ghosts),
    else it goes around once more with its count lowered by one.

    The target share starts at three tenths of the slots. A new entry whose
    block the small queue's ghosts remember was evicted too early by a small
    queue too short: the target grows (by the ratio of the ghost queues'
    lengths, at least 1, as ARC's). One the main queue's ghosts remember
    shrinks it the same way, down to a hundredth of the slots. The small
    queue's ghosts keep as many blocks as there are slots, the main
    queue's half as many more (its blocks had earned their place there
    once: they are remembered longer), each as a hash.
    """

    MAX_USES = 4
    """The uses an entry counts: the passes of the main queue it may outlive."""
    INITIAL_SMALL_SHARE = 0.3
    """The share of the slots the small queue starts with."""
    LEAST_SMALL_SHARE = 0.01
    """The least share the small queue is given."""
    SMALL_GHOSTS_PER_SLOT = 1.0
    """How many blocks evicted from the small queue are remembered, per slot."""
    MAIN_GHOSTS_PER_SLOT = 1.5
    """How many blocks evicted from the main queue are remembered, per slot."""

    def __init__(self, capacity: int) -> None:
        least_small = max(1, int(capacity * self.LEAST_SMALL_SHARE))
        super().__init__(capacity, max(least_small, int(capacity * self.INITIAL_SMALL_SHARE)))
        self._small_ghost_limit = max(1, int(capacity * self.SMALL_GHOSTS_PER_SLOT))
        self._main_ghost_limit = max(1, int(capacity * self.MAIN_GHOSTS_PER_SLOT))
        self._least_small = least_small
        self._most_small = max(least_small, capacity - 1)
        self._small_ghosts: OrderedDict[int, None] = OrderedDict()
        self._main_ghosts: OrderedDict[int, None] = OrderedDict()

    @property
    def small_target(self) -> int:
        """How many entries the small queue holds before it gives up its oldest."""
        return self._small_target

    def insert(self, slot: int, block: Hashable) -> None:
        if not self._returned(slot, block):
            self._small[slot] = 0

    def insert_continuing(self, slot: int, block: Hashable) -> None:
        if not self._returned(slot, block):
            self._main[slot] = 0

    def hit(self, slot: int) -> None:
        small = self._small
        if slot in small:
            small[slot] = min(small[slot] + 1, self.MAX_USES)
        else:
            main = self._main
            main.move_to_end(slot)
            main[slot] = min(main[slot] + 1, self.MAX_USES)

    def _returned(self, slot: int, block: Hashable) -> bool:
        """Record `slot`'s block; when a ghost queue remembers it, adapt and enter main."""
        key = hash(block)
        self._blocks[slot] = key
        small_ghosts, main_ghosts = self._small_ghosts, self._main_ghosts
        if key in small_ghosts:
            grow = max(len(main_ghosts) // len(small_ghosts), 1)
            self._small_target = min(self._most_small, self._small_target + grow)
            del small_ghosts[key]
        elif key in main_ghosts:
            shrink = max(len(small_ghosts) // len(main_ghosts), 1)
            self._small_target = max(self._least_small, self._small_target - shrink)
            del main_ghosts[key]
        else:
            return False
        self._main[slot] = 0
        return True

    def _evicted_from_small(self, key: int) -> None:
        _remember(self._small_ghosts, key, self._small_ghost_limit)

    def _evicted_from_main(self, key: int) -> None:
        _remember(self._main_ghosts, key, self._main_ghost_limit)


def _remember(ghosts: OrderedDict[int, None], key: int, limit: int) -> None:
    """`key` joins `ghosts`, which forget their oldest beyond `limit`."""
    ghosts[key] = None
    if len(ghosts) > limit:
        ghosts.popitem(last=False)
