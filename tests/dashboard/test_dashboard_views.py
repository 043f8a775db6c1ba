"""The dashboard's pure parts: the snapshot of a policy, the time series, the SVG charts,
the page assembly, the decision reasons, and the timeline recorder of a simulated run.
(The page in a real browser: ``test_dashboard_browser.py``.)"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.cli.main import main
from mori.core.decision_log import DecisionLog, DecisionRecord
from mori.core.decisions import Demote, Forward, Promote, Release
from mori.core.events import RequestArrived, StepFinished
from mori.core.explain import DecisionContext, context_reader, reason
from mori.core.ledger import ClusterSpec
from mori.core.policies import build_policy
from mori.core.policy import Policy, PolicyConfig
from mori.core.types import Status, Tier
from mori.dashboard.history import (
    TTFTS_PER_SAMPLE,
    History,
    percentiles,
    weighted_percentiles,
)
from mori.dashboard.page import live_page, timeline_page
from mori.dashboard.payload import charts, frame
from mori.dashboard.snapshot import TierRow, decision_row, take_snapshot
from mori.dashboard.svg import Series, line_chart, spectrum
from mori.dashboard.timeline import record_timeline
from mori.sim.config import SimConfig
from mori.sim.metrics import NONDETERMINISTIC_FIELDS
from mori.sim.runner import simulate
from mori.traces import default_traces

KVB = 100  # bytes per token


def small_policy(name: str = "mori", replicas: int = 2) -> Policy:
    cluster = ClusterSpec(replicas, gpu_bytes=10_000 * KVB, cpu_bytes=5_000 * KVB)
    return build_policy(name, cluster, KVB, PolicyConfig(page_tokens=1))


# -- the snapshot --------------------------------------------------------------------------

def test_snapshot_ranks_by_idleness_and_reads_the_ledger() -> None:
    pol = small_policy()
    log = DecisionLog(100, context_reader(pol.programs))
    t = 0.0
    for i, tokens in enumerate((3000, 2000, 4000)):
        pid = f"p{i}"
        pol.observe(RequestArrived(pid, tokens), t)
        for d in pol.decide(t):
            log.append(t, d)
    # p0 and p1 finish their steps at different times, then act (idle) for a while
    pol.observe(StepFinished("p0", 3100), 2.0)
    pol.observe(StepFinished("p1", 2100), 8.0)
    for d in pol.decide(8.0):
        log.append(8.0, d)
    snap = take_snapshot(pol, 10.0, log.latest(10))
    assert [p.program_id for p in snap.programs] == ["p2", "p1", "p0"]  # busiest first
    idleness_values = [p.idleness for p in snap.programs]
    assert idleness_values == sorted(idleness_values) and idleness_values[0] == 0.0 and idleness_values[-1] > idleness_values[1] > 0.0
    assert {p.program_id: p.status for p in snap.programs} == {
        "p0": Status.ACTING, "p1": Status.ACTING, "p2": Status.REASONING}
    assert snap.programs[2].since_request_s == 10.0
    # the tiers hold exactly the programs' tokens, per replica, as the ledger says
    for row in snap.tiers:
        on = [p for p in snap.programs if p.tier is Tier.GPU and p.replica == row.replica]
        assert row.gpu_tokens == sum(p.context_tokens for p in on)
        assert row.gpu_programs == len(on) and row.gpu_capacity == 10_000
        assert row.cpu_capacity == 5_000
    assert sum(r.gpu_programs for r in snap.tiers) == 3
    # decisions newest first, each with a reason naming its replica
    assert [d.kind for d in snap.decisions][:2] == ["forward", "promote"]
    assert all(f"replica {d.replica}" in d.reason for d in snap.decisions)
    assert snap.decisions[1].move == "none → gpu"


def test_the_held_requests_are_is_in_arrival_order_with_its_waits() -> None:
    pol = small_policy(replicas=1)
    t = 0.0
    for i in range(3):  # 3 x 4000 tokens: only two fit the GPU tier
        pol.observe(RequestArrived(f"p{i}", 4000), t)
        pol.decide(t)
        t += 1.0
    snap = take_snapshot(pol, 5.0, time_scale=2.0)
    assert [(g.program_id, g.waited_s, g.tier) for g in snap.held] == [("p2", 1.5, Tier.NONE)]
    assert snap.count(status=Status.HELD) == 1 and snap.count(tier=Tier.GPU) == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(100, 6000), st.floats(0.1, 5.0)),
                min_size=1, max_size=40))
def test_every_program_is_shown_once_and_no_tier_over_capacity(
        steps: list[tuple[int, int, float]]) -> None:
    pol = small_policy()
    t = 0.0
    busy: set[str] = set()
    for who, tokens, dt in steps:
        t += dt
        pid = f"p{who}"
        if pid in busy:
            pol.observe(StepFinished(pid, pol.programs[pid].tokens + 10), t)
            busy.discard(pid)
        elif pid not in pol.programs or pol.programs[pid].status is Status.ACTING:
            pol.observe(RequestArrived(pid, tokens), t)
        for d in pol.decide(t):
            if isinstance(d, Forward):
                busy.add(d.program_id)
        snap = take_snapshot(pol, t)
        assert sorted(p.program_id for p in snap.programs) == sorted(pol.programs)
        assert {g.program_id for g in snap.held} == {
            p.program_id for p in snap.programs if p.status is Status.HELD}
        for row in snap.tiers:
            assert row.gpu_tokens <= row.gpu_capacity and row.cpu_tokens <= row.cpu_capacity
        f = frame(snap, None)
        assert json.loads(json.dumps(f)) == f  # plain JSON
        assert len(f["programs"]) == len(pol.programs)


# -- reasons -----------------------------------------------------------------------------

def test_reasons_say_why_from_the_programs_state() -> None:
    ctx = DecisionContext(Status.ACTING, 0.8125, 12_345, 3.25)
    assert "CPU tier" in reason(Promote("a", 1, Tier.CPU), ctx)
    assert "recomputes" in reason(Promote("a", 1, Tier.NONE), ctx)
    demote = reason(Demote("a", 0, Tier.GPU, Tier.CPU), ctx)
    assert "replica 0's GPU tier" in demote and "acting, idleness 0.81, 12,345 tokens" in demote
    assert "no tier" in reason(Demote("a", 0, Tier.CPU, Tier.NONE), ctx)
    assert "after 3.2 s" in reason(Forward("a", 2), ctx)
    assert "ended" in reason(Release("a", None), None)
    assert "already left" in reason(Forward("a", 2), None)


def test_a_records_context_is_not_part_of_its_equality() -> None:
    d = Forward("a", 0)
    ctx = DecisionContext(Status.HELD, 0.5, 10, 1.0)
    assert DecisionRecord(1.0, d, ctx) == DecisionRecord(1.0, d)
    assert DecisionRecord(1.0, d, ctx).as_dict()["reason"].startswith("its KV is on")
    assert "reason" not in DecisionRecord(1.0, d).as_dict()


def test_a_demotion_to_no_tier_is_shown_as_a_drop() -> None:
    rows = [decision_row(DecisionRecord(1.0, d)) for d in (
        Demote("a", 0, Tier.GPU, Tier.NONE), Demote("a", 0, Tier.GPU, Tier.CPU),
        Promote("a", 1, Tier.CPU), Release("a", 1))]
    assert [(r.kind, r.move) for r in rows] == [
        ("drop", "gpu → none"), ("demote", "gpu → cpu"), ("promote", "cpu → gpu"),
        ("release", "")]


def test_the_log_keeps_the_latest_newest_first() -> None:
    log = DecisionLog(3)
    for i in range(5):
        log.append(float(i), Forward(f"p{i}", 0))
    assert [r.decision.program_id for r in log.latest(2)] == ["p4", "p3"]
    assert [r.time for r in log.latest(10)] == [4.0, 3.0, 2.0]


# -- the time series ------------------------------------------------------------------------

def tiers(gpu: float, cpu: float) -> list[TierRow]:
    return [TierRow(0, int(gpu * 100), 100, int(cpu * 100), 100, 1, 1)]


def test_history_rates_and_ttft_over_the_trailing_window() -> None:
    h = History(window_s=10.0, keep_s=30.0)
    h.record(0.0, tiers(0.5, 0.1), 0, 0, [])
    h.record(5.0, tiers(0.6, 0.2), 1, 500, [1.0, 3.0])
    s = h.record(10.0, tiers(0.7, 0.3), 2, 1500, [2.0])
    assert s.tokens_per_s == 150.0  # 1500 tokens over the 10 s window
    assert s.ttft[0] == 2.0 and s.gpu == (0.7,) and s.cpu == (0.3,) and s.held == 2
    s = h.record(20.0, tiers(0.7, 0.3), 0, 1500, [])
    assert s.tokens_per_s == 0.0 and all(math.isnan(v) for v in s.ttft)  # nothing in 10 s
    h.record(45.0, tiers(0.1, 0.0), 0, 1600, [0.5])
    assert [x.t for x in h.samples] == [20.0, 45.0]  # older than keep_s: gone
    with pytest.raises(ValueError, match="forward in time"):
        h.record(44.0, tiers(0.1, 0.0), 0, 1600, [])


@given(st.lists(st.floats(0.0, 1e4), min_size=1, max_size=200))
def test_percentiles_are_order_statistics(values: list[float]) -> None:
    p0, p50, p100 = percentiles(values, (0, 50, 100))
    assert p0 == min(values) and p100 == max(values) and p0 <= p50 <= p100


QS = (0, 10, 50, 90, 99, 100)


@given(st.lists(st.tuples(st.floats(0.0, 1e4), st.integers(1, 5)), min_size=1, max_size=60))
def test_weighted_percentiles_are_those_of_the_values_repeated(
        pairs: list[tuple[float, int]]) -> None:
    expanded = [v for v, n in pairs for _ in range(n)]
    assert weighted_percentiles(pairs, QS) == pytest.approx(percentiles(expanded, QS))


@settings(max_examples=50)
@given(st.lists(st.lists(st.floats(0.0, 100.0), max_size=400), min_size=1, max_size=4))
def test_the_ttft_window_is_exact_up_to_the_cap_and_close_beyond(
        batches: list[list[float]]) -> None:
    h = History(window_s=100.0, keep_s=None)
    for i, batch in enumerate(batches):
        s = h.record(float(i), [], 0, 0, batch)
    values = sorted(v for b in batches for v in b)
    if not values:
        assert all(math.isnan(v) for v in s.ttft)
        return
    exact = percentiles(values, (50, 90, 99))
    if all(len(b) <= TTFTS_PER_SAMPLE for b in batches):
        assert s.ttft == pytest.approx(exact)
        return
    # each kept value stands for a run of at most ceil(n / cap) of its sample's values:
    # the percentile is off by at most a run per sample in the sorted values
    run = sum(math.ceil(len(b) / TTFTS_PER_SAMPLE) for b in batches) + 1
    for q, got in zip((50, 90, 99), s.ttft, strict=True):
        k = (len(values) - 1) * q / 100.0
        lo = values[max(0, math.floor(k) - run)]
        hi = values[min(len(values) - 1, math.ceil(k) + run)]
        assert lo <= got <= hi


# -- SVG and the page -----------------------------------------------------------------------

EVIL = '</script><img src=x onerror="alert(1)">&'


def test_svg_escapes_every_text_and_breaks_lines_at_gaps() -> None:
    svg = line_chart(EVIL, [0, 1, 2, 3], [Series(EVIL, [1.0, float("nan"), 2.0, 3.0], "#000")],
                     x_range=(0, 3), unit="s", x_label=EVIL)
    assert "<img" not in svg and "</script>" not in svg and "&lt;img" in svg
    path = re.search(r'<path d="([^"]+)"', svg)
    assert path is not None and path.group(1).count("M") == 2  # the NaN split the line
    marks = spectrum([(0.1, Status.REASONING, Tier.GPU), (0.9, Status.ACTING, Tier.CPU),
                      (0.5, Status.HELD, Tier.NONE), (0.2, Status.REASONING, Tier.GPU)])
    assert sum(d.count("M") for d in re.findall(r'<path d="([^"]+)"', marks)) == 4


def test_the_page_embeds_data_safely_and_its_csp_pins_the_script() -> None:
    page = timeline_page([{"t": 0.0, "id": EVIL}], {}, 10.0, EVIL)
    script = re.search(r'<script id="mori-data" type="application/json">(.*?)</script>',
                       page, re.S)
    assert script is not None and "</" not in script.group(1)
    assert json.loads(script.group(1))["frames"][0]["id"] == EVIL
    assert "<img" not in page.split("<script")[0]  # the title is escaped too
    live = live_page("/dashboard/state")
    js = re.findall(r"<script>(.*?)</script>", live.html, re.S)
    assert len(js) == 1
    digest = base64.b64encode(hashlib.sha256(js[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in live.csp and "frame-ancestors" in live.header_csp
    assert "http://" not in live.html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in live.html  # nothing fetched from elsewhere


def test_charts_cover_each_replica() -> None:
    h = History(window_s=5.0, keep_s=None)
    for t in range(5):
        h.record(float(t), [TierRow(r, 10 * t, 100, 0, 0, 1, 0) for r in range(3)], 0, 10 * t,
                 [0.1])
    out = charts(h, (0.0, 4.0), cursor=True)
    assert set(out) == {"gpu", "cpu", "throughput", "ttft", "held"}
    assert out["gpu"].count("<path") == 3 and 'class="cursor"' in out["gpu"]


# -- the timeline of a simulated run ---------------------------------------------------------

def test_a_timeline_changes_nothing_in_the_run_and_follows_it() -> None:
    traces = default_traces()
    cfg = SimConfig(policy="mori", programs=12, replicas=2, duration_s=300.0)
    plain = simulate(cfg, traces).to_dict()
    result, html = record_timeline(cfg, traces, frames=30)
    recorded = result.to_dict()
    for k in NONDETERMINISTIC_FIELDS:
        plain.pop(k), recorded.pop(k)
    assert recorded == plain
    data = json.loads(re.search(r'<script id="mori-data" type="application/json">(.*?)</script>',
                                html, re.S).group(1))  # type: ignore[union-attr]
    frames = data["frames"]
    assert len(frames) == 30 and frames[-1]["t"] == 300.0
    assert [f["t"] for f in frames] == sorted(f["t"] for f in frames)
    assert max(f["summary"]["programs"] for f in frames) <= 12
    assert any(f["decisions"] for f in frames)
    last = frames[-1]
    assert sum(r[5] for r in last["tiers"]) == last["summary"]["tier_gpu"]
    assert set(data["charts"]) == {"gpu", "cpu", "throughput", "ttft", "held"}


def test_mori_simulate_writes_one_timeline_per_run(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.html"
    assert main(["simulate", "--policy", "mori,thunderagent+offload", "--programs", "4",
                 "--duration", "60", "--timeline", str(out), "--timeline-frames", "10",
                 "--quiet"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["run-mori-4.html", "run-thunderagent_offload-4.html"]
    assert main(["simulate", "--policy", "mori", "--programs", "4", "--duration", "60",
                 "--timeline", str(tmp_path / "no" / "x.html"), "--quiet"]) == 2
    assert "--timeline" in capsys.readouterr().err
    assert main(["simulate", "--policy", "mori", "--programs", "4", "--duration", "60",
                 "--timeline", str(out), "--timeline-frames", "1", "--quiet"]) == 2


def test_a_demotions_reason_says_what_the_return_costs() -> None:
    parked = DecisionContext(Status.ACTING, 0.9, 60_000, 0.0, away_s=12.5, return_s=0.25)
    dropped = DecisionContext(Status.ACTING, 0.9, 60_000, 0.0, away_s=40.0, return_s=36.0)
    to_cpu = reason(Demote("a", 0, Tier.GPU, Tier.CPU), parked)
    assert "away 12.5 s" in to_cpu and "a reload, about 0.25 s of the link" in to_cpu
    to_none = reason(Demote("a", 0, Tier.GPU, Tier.NONE), dropped)
    assert "away 40.0 s" in to_none and "a recompute, about 36.0 s" in to_none
    assert "return" not in reason(Demote("a", 0, Tier.GPU, Tier.NONE),
                                  DecisionContext(Status.ACTING, 0.9, 10, 0.0))


def test_the_policy_reports_the_price_it_weighed() -> None:
    """``mori`` counts a drop for every program on the replica's GPU; a reload is the
    link's time alone."""
    from mori.core.events import RequestArrived, StepFinished
    from mori.core.explain import context_reader
    from mori.core.ledger import ClusterSpec
    from mori.core.policies import build_policy
    from mori.core.policy import PolicyConfig

    pol = build_policy("mori", ClusterSpec(1, 100, 0), 1,
                       PolicyConfig(page_tokens=1, recompute_tok_s=10.0))
    for pid, n in (("A", 60), ("S", 20)):
        pol.observe(RequestArrived(pid, n), 0.0)
    pol.decide(0.0)
    pol.observe(StepFinished("A", 60), 1.0)
    pol.decide(1.0)
    pol.observe(RequestArrived("B", 20), 2.0)
    assert pol.decide(2.0) == [Promote("B", 0, Tier.NONE), Forward("B", 0)]  # room is free
    ctx = context_reader(pol.programs, pol.return_cost)(Demote("A", 0, Tier.GPU, Tier.NONE), 9.0)
    assert ctx is not None and ctx.away_s == 8.0
    assert ctx.return_s == 6.0 * 3  # 60 tokens at 10/s, for A, S and B on the GPU
