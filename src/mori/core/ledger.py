"""Tier ledgers: who is where, and how many bytes each tier holds.

Per replica a GPU queue, a CPU queue and a disk queue with capacities in bytes (the disk
queue's is 0 unless the cluster has a disk tier); one global Uncached queue (tier NONE)
for programs that hold no cache. ``check_integrity()`` asserts every
invariant: each program in exactly one place, byte totals equal to the members' sizes,
no tier over capacity. A capacity of ``None`` means the tier is not managed by the
scheduler (a program-unaware baseline lets the engine decide).
"""

from __future__ import annotations

from dataclasses import dataclass

from mori.core.types import Tier


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Scheduler-side capacities: ``replicas`` identical replicas (``disk_bytes``: each
    replica's disk tier; 0, the default, for none)."""

    replicas: int
    gpu_bytes: int | None
    cpu_bytes: int | None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"need at least one replica, got {self.replicas}")
        if self.gpu_bytes is not None and self.gpu_bytes <= 0:
            raise ValueError(f"GPU KV capacity must be positive, got {self.gpu_bytes} bytes")
        if self.cpu_bytes is not None and self.cpu_bytes < 0:
            raise ValueError(f"CPU KV capacity must be >= 0, got {self.cpu_bytes} bytes")
        if self.disk_bytes < 0:
            raise ValueError(f"disk KV capacity must be >= 0, got {self.disk_bytes} bytes")


class IntegrityError(AssertionError):
    """An invariant of the ledger does not hold."""


class TierQueue:
    """Members of one tier of one replica with their sizes in bytes."""

    __slots__ = ("capacity", "members", "used")

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.members: dict[str, int] = {}
        self.used = 0

    def free(self) -> float:
        return float("inf") if self.capacity is None else float(self.capacity - self.used)

    def fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def over(self) -> bool:
        return self.capacity is not None and self.used > self.capacity


class Placement:
    """The GPU, CPU and disk queues of every replica plus the global Uncached queue."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.gpu = [TierQueue(spec.gpu_bytes) for _ in range(spec.replicas)]
        self.cpu = [TierQueue(spec.cpu_bytes) for _ in range(spec.replicas)]
        self.disk = [TierQueue(spec.disk_bytes) for _ in range(spec.replicas)]
        self.down: set[int] = set()  # replicas out of service: capacity 0, no members
        self.uncached: dict[str, int] = {}
        self._where: dict[str, tuple[Tier, int | None]] = {}

    # -- queries --------------------------------------------------------------------
    def where(self, program_id: str) -> tuple[Tier, int | None]:
        return self._where[program_id]

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def queue(self, tier: Tier, replica: int | None) -> dict[str, int]:
        if tier is Tier.NONE:
            return self.uncached
        assert replica is not None
        return self.tier_queue(tier, replica).members

    def tier_queue(self, tier: Tier, replica: int) -> TierQueue:
        if tier is Tier.GPU:
            return self.gpu[replica]
        return (self.cpu if tier is Tier.CPU else self.disk)[replica]

    # -- changes --------------------------------------------------------------------
    def set_down(self, replica: int, down: bool) -> None:
        """Take a replica out of service (its tiers' capacities become 0: nothing fits
        there; it must be empty) or back in (the spec's capacities again)."""
        if not 0 <= replica < self.spec.replicas:
            raise ValueError(f"bad replica {replica!r}")
        if down:
            if self.holds(replica):
                raise ValueError(f"replica {replica} still holds programs")
            self.down.add(replica)
            self.gpu[replica].capacity = self.cpu[replica].capacity = 0
            self.disk[replica].capacity = 0
        else:
            self.down.discard(replica)
            self.gpu[replica].capacity = self.spec.gpu_bytes
            self.cpu[replica].capacity = self.spec.cpu_bytes
            self.disk[replica].capacity = self.spec.disk_bytes

    def holds(self, replica: int) -> bool:
        """Whether any tier of ``replica`` holds a program."""
        return bool(self.gpu[replica].members or self.cpu[replica].members
                    or self.disk[replica].members)

    def add(self, program_id: str, nbytes: int) -> None:
        """A new program enters the Uncached queue."""
        if program_id in self._where:
            raise ValueError(f"program {program_id!r} is already placed")
        self.uncached[program_id] = nbytes
        self._where[program_id] = (Tier.NONE, None)

    def move(self, program_id: str, tier: Tier, replica: int | None) -> None:
        if tier is not Tier.NONE and (replica is None or not 0 <= replica < self.spec.replicas):
            raise ValueError(f"bad replica {replica!r} for tier {tier.value}")
        nbytes = self._take(program_id)
        self._put(program_id, tier, replica, nbytes)

    def resize(self, program_id: str, nbytes: int) -> None:
        tier, replica = self._where[program_id]
        self._take(program_id)
        self._put(program_id, tier, replica, nbytes)

    def remove(self, program_id: str) -> None:
        self._take(program_id)
        del self._where[program_id]

    def _take(self, program_id: str) -> int:
        tier, replica = self._where[program_id]
        if tier is Tier.NONE:
            return self.uncached.pop(program_id)
        assert replica is not None
        q = self.tier_queue(tier, replica)
        nbytes = q.members.pop(program_id)
        q.used -= nbytes
        return nbytes

    def _put(self, program_id: str, tier: Tier, replica: int | None, nbytes: int) -> None:
        if tier is Tier.NONE:
            self.uncached[program_id] = nbytes
            self._where[program_id] = (Tier.NONE, None)
            return
        if replica is None or not 0 <= replica < self.spec.replicas:
            raise ValueError(f"bad replica {replica!r} for tier {tier.value}")
        q = self.tier_queue(tier, replica)
        q.members[program_id] = nbytes
        q.used += nbytes
        self._where[program_id] = (tier, replica)

    # -- invariants -----------------------------------------------------------------
    def check_integrity(self, capacity: bool = True) -> None:
        """Assert every invariant; ``capacity=False`` skips the over-capacity check
        (between an observation and the ``decide()`` that restores it)."""
        seen: dict[str, tuple[Tier, int | None]] = {}

        def claim(pid: str, place: tuple[Tier, int | None]) -> None:
            if pid in seen:
                raise IntegrityError(f"program {pid!r} is in {seen[pid]} and in {place}")
            seen[pid] = place

        for pid in self.uncached:
            claim(pid, (Tier.NONE, None))
        for tier, queues in ((Tier.GPU, self.gpu), (Tier.CPU, self.cpu),
                             (Tier.DISK, self.disk)):
            for r, q in enumerate(queues):
                for pid in q.members:
                    claim(pid, (tier, r))
                total = sum(q.members.values())
                if total != q.used:
                    raise IntegrityError(f"{tier.value}[{r}] used {q.used} != sum {total}")
                if capacity and q.over():
                    raise IntegrityError(
                        f"{tier.value}[{r}] over capacity: {q.used} > {q.capacity} bytes"
                    )
        if seen != self._where:
            raise IntegrityError("membership index disagrees with the queues")
        for r in self.down:
            if self.holds(r):
                raise IntegrityError(f"replica {r} is down but holds programs")
