"""The parts the controller holds as fields, each on its own: the per-key quotas
(``mori.gateway.quotas``), the sessions and the contexts left behind
(``mori.gateway.sessions``), and the engines' residency read at start
(``mori.gateway.restore``). The controller's own tests drive them through admission."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from mori.core.types import Capability, Status, Tier
from mori.gateway.held import AdmissionRejected
from mori.gateway.programs import ProgramInfo
from mori.gateway.quotas import KeyQuotas
from mori.gateway.restore import read_residency
from mori.gateway.sessions import Sessions


def test_quotas_count_a_keys_live_programs_and_refuse_past_the_cap() -> None:
    q = KeyQuotas(keyed=True, limit=2)
    assert q.owner_of("k1/a") == "k1" and q.owner_of("bare") == ""
    assert KeyQuotas(keyed=False, limit=0).owner_of("k1/a") == ""
    q.add("k1/a")
    q.check("k1/b", 5.0)
    q.add("k1/b")
    with pytest.raises(AdmissionRejected) as e:
        q.check("k1/c", 5.0)
    assert e.value.status == 429 and e.value.retry_after_s == 5.0
    assert "--max-programs-per-key" in e.value.message
    q.check("k2/a", 5.0)  # another key: its own count
    assert q.programs_of("k1") == {"k1/a", "k1/b"} and not q.programs_of("k2")
    q.discard("k1/a")
    q.discard("k1/b")
    assert q.owned == {}  # an emptied namespace is forgotten
    KeyQuotas(keyed=True, limit=0).check("k1/x", 5.0)  # 0: no cap


def _sessions(grace_s: float = 10.0) -> tuple[Sessions, dict[str, ProgramInfo],
                                               dict[str, Any], list[float]]:
    programs: dict[str, ProgramInfo] = {}
    policy_programs: dict[str, Any] = {}
    clock = [100.0]
    policy: Any = SimpleNamespace(programs=policy_programs)
    return Sessions(programs, policy, lambda: clock[0], grace_s), programs, \
        policy_programs, clock


def _begin(s: Sessions, programs: dict[str, ProgramInfo], policy: dict[str, Any], pid: str,
           session: str, at: float) -> ProgramInfo:
    info = programs[pid] = ProgramInfo(pid, arrived_wall=at)
    info.agent.session = session
    info.agent.parent = s.join(pid, session, None, None)
    policy[pid] = SimpleNamespace(status=Status.ACTING)
    return info


def test_a_subagent_starts_under_the_program_in_a_tool_call() -> None:
    s, programs, policy, _ = _sessions()
    main = _begin(s, programs, policy, "main", "S", 1.0)
    main.in_flight = True  # still answering: its tool call has streamed
    assert _begin(s, programs, policy, "sub", "S", 2.0).agent.parent == "main"
    main.in_flight = False
    members = s.members["S"]
    assert s.parent_of(members, "sub") == "sub"  # the one the client names
    assert s.parent_of(members, "su") is None  # a named prefix ends with ':' or '/'
    assert s.parent_of(members, "ma", "other") is None  # named in another session


def test_contexts_left_behind_are_released_after_the_grace_unless_seen_again() -> None:
    """A new context of a session (a compaction, a /clear) leaves the old ones that wait
    for nothing behind: each is released once the grace is over, unless it started a
    live program or a request of its own came."""
    s, programs, policy, clock = _sessions(grace_s=10.0)
    a = _begin(s, programs, policy, "a", "S", 1.0)
    a.in_flight = True
    assert _begin(s, programs, policy, "b", "S", 2.0).agent.parent == "a"
    a.in_flight = False
    _begin(s, programs, policy, "c", "S", 3.0)  # a new context: b is left behind, a not
    ended: list[str] = []

    def end(pid: str) -> None:
        ended.append(pid)
        programs.pop(pid)
        s.leave(pid, "S")

    s.release_due(end)
    assert ended == []  # the grace is not over
    clock[0] += 11.0
    s.release_due(end)
    assert ended == ["b"]  # a started b, which was live when c began
    _begin(s, programs, policy, "d", "S", 4.0)  # another new context: a and c left behind
    s.seen_again("a")  # ...but a request of a's own came
    clock[0] += 11.0
    s.release_due(end)
    assert ended == ["b", "c"] and s.members["S"] == {"a", "d"}


class _Adapter:
    def __init__(self, gpu: dict[str, int], cpu: dict[str, int], ended: set[str] | None = None,
                 fails: bool = False) -> None:
        self._res = SimpleNamespace(gpu_tokens=gpu, cpu_tokens=cpu, ended=ended or set())
        self._fails = fails

    def supports(self, cap: Capability) -> bool:
        return cap is Capability.RESIDENCY

    async def residency(self) -> Any:
        if self._fails:
            raise OSError("no answer")
        return self._res


def test_residency_at_start_takes_each_programs_best_place_best_first() -> None:
    adapters = [_Adapter({"p": 100, "q": 50, "gone": 10}, {"r": 900}, ended={"gone"}),
                _Adapter({"p": 300}, {"q": 999}),
                _Adapter({"z": 1}, {}, fails=True)]  # cannot say: skipped
    replicas: Any = SimpleNamespace(all=[SimpleNamespace(index=i, adapter=a)
                                         for i, a in enumerate(adapters)])
    found = asyncio.run(read_residency(replicas))
    assert [(pid, f.replica, f.tier, f.tokens) for pid, f in found.items()] == [
        ("p", 1, Tier.GPU, 300), ("q", 0, Tier.GPU, 50), ("r", 0, Tier.CPU, 900)]
