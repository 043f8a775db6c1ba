"""What MORI keeps up to date between decision rounds, so a round touches only what
changed and what must move (``MoriPolicy``; the straightforward round that recomputes
all of it is the differential test's reference).

- ``CandidateIndex``: the held programs not on a GPU, in promotion order, per replica
  for those in a CPU queue and one order for those in Waiting. A held program's
  priority (its level, its context for a new one, its iota, its arrival) does not
  change while it is held: idleness excludes gated time, so iota is frozen from the
  arrival to the forward. ``mori-no-exclusion`` counts gated time, so it cannot use the
  index and scans instead.
- ``ReplicaSums``: per replica, the KV bytes of its Acting and of its Reasoning GPU
  programs, and the GPU bytes in use over all replicas.
- ``ReplicaOrder``: the replicas sorted by a value (the GPU room they have), so the one
  with the most room, or the tightest that holds a given size, is found in O(log R).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator

from mori.core.ordered import Key, SizedOrder
from mori.core.program import Program
from mori.core.types import Status, Tier


def priority(p: Program, iota: float) -> Key:
    """The promotion order (``mori`` module docstring): (0) CPU queue, (1) returning,
    (2) new programs smallest context first; lowest iota first; then arrival."""
    level = 0 if p.tier is Tier.CPU else 1 if p.returning else 2
    return (level, p.tokens if level == 2 else 0, iota, p.ready_seq)


class CandidateIndex:
    """Held programs in a CPU queue (per replica) or in Waiting, by priority."""

    __slots__ = ("cpu", "cpu_all", "waiting", "_entry", "_cpu_nonempty")

    def __init__(self, replicas: int) -> None:
        self.cpu: list[SizedOrder[Program]] = [SizedOrder() for _ in range(replicas)]
        self.cpu_all: SizedOrder[Program] = SizedOrder()  # every replica's, one order
        self.waiting: SizedOrder[Program] = SizedOrder()
        self._entry: dict[str, tuple[Key, int | None]] = {}  # id -> key, CPU replica
        self._cpu_nonempty: set[int] = set()

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._entry

    def key_of(self, program_id: str) -> Key | None:
        e = self._entry.get(program_id)
        return None if e is None else e[0]

    def cpu_replicas(self) -> list[int]:
        """The replicas whose CPU queue holds a candidate, ascending."""
        return sorted(self._cpu_nonempty)

    def put(self, p: Program, key: Key) -> None:
        assert p.program_id not in self._entry, f"{p.program_id} indexed twice"
        if p.tier is Tier.CPU:
            assert p.replica is not None
            self.cpu[p.replica].add(key, p.kv_bytes, p)
            self.cpu_all.add(key, p.kv_bytes, p)
            self._cpu_nonempty.add(p.replica)
            self._entry[p.program_id] = (key, p.replica)
        else:
            assert p.tier is Tier.NONE, f"{p.program_id} on a GPU is not a candidate"
            self.waiting.add(key, p.kv_bytes, p)
            self._entry[p.program_id] = (key, None)

    def discard(self, program_id: str) -> int | None:
        """Forget ``program_id``; the CPU replica it was indexed under, if any."""
        e = self._entry.pop(program_id, None)
        if e is None:
            return None
        key, replica = e
        if replica is None:
            self.waiting.remove(key)
        else:
            order = self.cpu[replica]
            order.remove(key)
            self.cpu_all.remove(key)
            if not order:
                self._cpu_nonempty.discard(replica)
        return replica

    def entries(self) -> dict[str, tuple[Key, int | None]]:
        """A copy of id -> (key, CPU replica or None) (integrity checks)."""
        return dict(self._entry)


class ReplicaSums:
    """Per replica the KV bytes of its Acting and its Reasoning GPU programs; the GPU
    bytes in use over all replicas. ``account(p, +1)`` after a change, ``-1`` before."""

    __slots__ = ("acting", "reasoning", "gpu_used")

    def __init__(self, replicas: int) -> None:
        self.acting = [0] * replicas
        self.reasoning = [0] * replicas
        self.gpu_used = 0

    def account(self, p: Program, sign: int) -> None:
        if p.tier is not Tier.GPU:
            return
        r = p.replica
        assert r is not None
        nbytes = sign * p.kv_bytes
        self.gpu_used += nbytes
        status = p.status
        if status is Status.ACTING:
            self.acting[r] += nbytes
        elif status is Status.REASONING:
            self.reasoning[r] += nbytes


class ReplicaOrder:
    """Replicas sorted by an integer value each (most first, then lowest index)."""

    __slots__ = ("_order", "_of")

    def __init__(self, replicas: int, value: int) -> None:
        self._order = [(-value, r) for r in range(replicas)]  # ascending
        self._of = [value] * replicas

    def __getitem__(self, replica: int) -> int:
        return self._of[replica]

    def set(self, replica: int, value: int) -> None:
        old = self._of[replica]
        if old == value:
            return
        order = self._order
        del order[bisect_left(order, (-old, replica))]
        insort(order, (-value, replica))
        self._of[replica] = value

    def most(self) -> int:
        return -self._order[0][0]

    def tightest(self, need: int) -> int | None:
        """The replica with the least value >= ``need`` (lowest index among equals)."""
        order = self._order
        i = bisect_right(order, (-need, len(self._of))) - 1
        if i < 0:
            return None
        return order[bisect_left(order, (order[i][0], -1))][1]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(value, replica), the most first, lowest index among equals."""
        for neg, r in self._order:
            yield -neg, r

    def check(self) -> None:
        assert self._order == sorted((-v, r) for r, v in enumerate(self._of))
