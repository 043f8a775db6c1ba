"""The idleness and context distributions on ``/metrics`` (gauge histograms by tier), and
the Grafana dashboard in ``docs/`` that reads them: every series it queries is one the
gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
from gateway_harness import LoopThread, serve_on_simulated

from mori.gateway.config import GatewaySettings
from mori.gateway.metrics import (
    IDLENESS_BUCKETS,
    Distribution,
    GatewayMetrics,
    GatewayState,
    distributions,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples in an exposition, keyed by their sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")))
            out[labels] = float(m.group(2))
    return out


def test_distribution_buckets_are_upper_bounds_inclusive() -> None:
    d = Distribution(IDLENESS_BUCKETS)
    for v in (0.0, 0.05, 0.051, 0.5, 1.0):
        d.add(v)
    cum = dict(d.cumulative())
    assert cum["0.05"] == 2  # 0.0 and 0.05 itself
    assert cum["0.1"] == 3
    assert cum["0.4"] == 3 and cum["0.5"] == 4
    assert cum["0.95"] == 4 and cum["1.0"] == 5 and cum["+Inf"] == 5
    assert abs(d.total - 1.601) < 1e-9
    over = Distribution((10.0,))
    over.add(11.0)
    assert over.cumulative() == [("10.0", 0.0), ("+Inf", 1.0)]


def test_state_renders_gauge_histograms_by_tier() -> None:
    idleness, ctx = distributions([("gpu", 0.1, 5_000), ("gpu", 0.7, 70_000),
                               ("cpu", 0.9, 40_000)])
    m = GatewayMetrics()
    m.watch(lambda: GatewayState(programs={}, held=0, replicas=[], idleness=idleness,
                                 context=ctx))
    text = m.render().decode()
    assert "# TYPE mori_program_idleness_ratio histogram" in text
    b = samples(text, "mori_program_idleness_ratio_bucket")
    assert b[(("le", "0.1"), ("tier", "gpu"))] == 1
    assert b[(("le", "0.6"), ("tier", "gpu"))] == 1
    assert b[(("le", "0.7"), ("tier", "gpu"))] == 2
    assert b[(("le", "0.8"), ("tier", "cpu"))] == 0
    assert b[(("le", "+Inf"), ("tier", "cpu"))] == 1
    assert samples(text, "mori_program_idleness_ratio_gcount")[(("tier", "gpu"),)] == 2
    assert abs(samples(text, "mori_program_idleness_ratio_gsum")[(("tier", "gpu"),)]
               - 0.8) < 1e-9
    c = samples(text, "mori_program_context_tokens_bucket")
    assert c[(("le", "4096.0"), ("tier", "gpu"))] == 0
    assert c[(("le", "16384.0"), ("tier", "gpu"))] == 1
    assert c[(("le", "65536.0"), ("tier", "cpu"))] == 1
    assert c[(("le", "131072.0"), ("tier", "gpu"))] == 2


def _drive(url: str, n: int) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = c.models.list().data[0].id
    for i in range(n):
        c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"program_id": f"agent-{i}",
                        "mori": {"prompt_tokens": 15_000 * (i + 1)}})


def test_live_distributions_match_the_program_listing(loop_thread: LoopThread) -> None:
    # GPU KV of 100k tokens: the first programs fit, the later ones are demoted or dropped
    g = serve_on_simulated(loop_thread, GatewaySettings(policy="mori", time_scale=10.0),
                           gpu_kv_tokens=100_000)
    _drive(g.url, 5)
    progs = httpx.get(g.url + "/v1/programs").json()["data"]
    text = httpx.get(g.url + "/metrics").text
    tiers = {p["tier"] for p in progs}
    b = samples(text, "mori_program_idleness_ratio_bucket")
    counts = samples(text, "mori_program_idleness_ratio_gcount")
    for tier in tiers:
        mine = [p for p in progs if p["tier"] == tier]
        assert b[(("le", "+Inf"), ("tier", tier))] == len(mine)
        assert counts[(("tier", tier),)] == len(mine)
        ctx = samples(text, "mori_program_context_tokens_bucket")
        for le in ("32768.0", "65536.0", "131072.0"):
            assert ctx[(("le", le), ("tier", tier))] == sum(
                1 for p in mine if p["context_tokens"] <= float(le))
    assert sum(v for k, v in b.items() if ("le", "+Inf") in k) == len(progs) == 5
    # idleness grows while programs sit in their tool call: read both within a moment
    gsum = sum(samples(text, "mori_program_idleness_ratio_gsum").values())
    assert abs(gsum - sum(p["idleness"] for p in progs)) < 0.05 * len(progs)


def _dashboard_series(d: dict[str, object]) -> set[str]:
    names: set[str] = set()
    for p in d["panels"]:  # type: ignore[attr-defined]
        for t in p.get("targets", []):
            names.update(re.findall(r"\bmori_[a-z_]+", t["expr"]))
    return names


def test_grafana_dashboard_queries_only_exported_series(loop_thread: LoopThread) -> None:
    d = json.loads(DASHBOARD.read_text())
    panels = d["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:  # no two panels overlap on the grid
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        assert g["x"] + g["w"] <= 24
        cells |= mine
    wanted = _dashboard_series(d)
    assert {"mori_program_idleness_ratio_bucket", "mori_program_context_tokens_bucket",
            "mori_replica_gpu_kv_used_ratio", "mori_ttft_seconds_bucket"} <= wanted
    g = serve_on_simulated(loop_thread, GatewaySettings(policy="mori", time_scale=10.0),
                           gpu_kv_tokens=100_000)
    _drive(g.url, 2)
    exported = {line.split("{")[0].split(" ")[0]
                for line in httpx.get(g.url + "/metrics").text.splitlines()
                if line and not line.startswith("#")}
    # a labelled counter with no sample yet (no engine error) exports no series; its
    # family is still in the gateway's registry
    families = {m.name for m in g.gw.metrics.registry.collect()}
    for name in sorted(wanted):
        base = re.sub(r"_(bucket|total|count|sum)$", "", name)
        assert name in exported or base in families, f"{name} is not exported"
