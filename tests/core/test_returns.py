"""The predicted length of a tool call (``mori.core.returns``)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.core.returns import RULES, ReturnConfig, ReturnPredictor


def test_nothing_known_gives_the_prior() -> None:
    assert ReturnPredictor(ReturnConfig(prior_s=7.5)).expect_s() == 7.5


def test_own_rule_takes_the_median_of_the_programs_own_calls() -> None:
    p = ReturnPredictor(ReturnConfig(rule="own", min_own=2))
    assert p.expect_s(own=[1.0, 9.0, 3.0]) == 3.0
    # one own call is not enough: the kind's history (none yet), then the prior
    assert p.expect_s(own=[4.0]) == p.config.prior_s


def test_tools_rule_takes_the_slowest_of_the_called_tools_medians() -> None:
    p = ReturnPredictor(ReturnConfig(rule="tools", min_tool=3))
    for s in (1.0, 2.0, 3.0):
        p.observe(s, ["Read"])
    for s in (20.0, 30.0, 40.0):
        p.observe(s, ["Bash"])
    assert p.expect_s(tools=["Read"]) == 2.0
    assert p.expect_s(tools=["Read", "Bash"]) == 30.0
    # an unknown tool falls back to the kind: every call so far
    assert p.expect_s(tools=["Grep"]) == statistics.median([1, 2, 3, 20, 30, 40])


def test_the_fallbacks_run_in_the_rules_order() -> None:
    cfg = dict(min_own=2, min_tool=1, min_kind=1)
    own_first = ReturnPredictor(ReturnConfig(rule="own-then-tools", **cfg))
    tools_first = ReturnPredictor(ReturnConfig(rule="tools-then-own", **cfg))
    for p in (own_first, tools_first):
        p.observe(50.0, ["Bash"], kind="codex")
    assert own_first.expect_s(own=[2.0, 4.0], tools=["Bash"], kind="codex") == 3.0
    assert tools_first.expect_s(own=[2.0, 4.0], tools=["Bash"], kind="codex") == 50.0
    # the kind's history is per kind
    kind = ReturnPredictor(ReturnConfig(rule="kind", min_kind=1, prior_s=1.0))
    kind.observe(50.0, kind="codex")
    assert kind.expect_s(kind="codex") == 50.0
    assert kind.expect_s(kind="claude-code") == 1.0


def test_only_the_last_calls_are_kept() -> None:
    p = ReturnPredictor(ReturnConfig(rule="kind", min_kind=1, keep=2))
    for s in (100.0, 1.0, 3.0):
        p.observe(s)
    assert p.expect_s() == 2.0


def test_only_so_many_distinct_tools_are_tracked() -> None:
    p = ReturnPredictor(ReturnConfig(rule="tools", min_tool=1, max_names=2, prior_s=0.0))
    for k in range(100):  # a client inventing tool names
        p.observe(float(k + 1), [f"tool-{k}"])
    assert p.expect_s(tools=["tool-0"]) == 1.0 and p.expect_s(tools=["tool-1"]) == 2.0
    # not tracked: the kind's median, over every call
    assert p.expect_s(tools=["tool-99"]) == statistics.median(range(1, 101))
    assert len(p._tools) == 2


@pytest.mark.parametrize("bad", [dict(rule="mean"), dict(min_own=0), dict(keep=0),
                                 dict(max_names=0),
                                 dict(prior_s=-1.0), dict(prior_s=float("nan"))])
def test_a_bad_config_says_what_is_wrong(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ReturnConfig(**bad)  # type: ignore[arg-type]


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ReturnPredictor().observe(-1.0)


seconds = st.floats(min_value=0.0, max_value=1e5, allow_nan=False)
names = st.lists(st.sampled_from(["Bash", "Read", "Edit", "Task"]), max_size=3)


@given(rule=st.sampled_from(RULES),
       seen=st.lists(st.tuples(seconds, names, st.sampled_from(["", "codex"])), max_size=30),
       own=st.lists(seconds, max_size=6), tools=names, kind=st.sampled_from(["", "codex"]),
       prior=seconds)
def test_an_estimate_is_a_length_seen_or_between_two_or_the_prior(
        rule: str, seen: list[tuple[float, list[str], str]], own: list[float],
        tools: list[str], kind: str, prior: float) -> None:
    p = ReturnPredictor(ReturnConfig(rule=rule, prior_s=prior))
    for s, ts, k in seen:
        p.observe(s, ts, kind=k)
    got = p.expect_s(own, tools, kind)
    known = [s for s, _, _ in seen] + own
    assert got == prior or (known and min(known) <= got <= max(known))
