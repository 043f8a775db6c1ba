"""bench/bench_vllm_agents.py's own logic, without an engine: its settings, the split of
CPUs between the engine and the rest, the load it samples, and the tables it prints.
(The benchmark itself runs engines for many minutes: docs/benchmarks.md.)"""

from __future__ import annotations

import argparse
import http.server
import threading
import time
from types import ModuleType
from typing import Any

import pytest

from bench import bench_vllm_agents
from mori.core.costmodel import CostModel
from mori.core.hardware import get_preset


@pytest.fixture(scope="module")
def agents() -> ModuleType:
    return bench_vllm_agents


def test_cpu_blocks_take_a_list(agents: ModuleType) -> None:
    assert agents.parse_cpu_blocks("512,256") == [512, 256]
    assert agents.parse_cpu_blocks("0") == [0]
    for bad in ("", "x", "-1", "256,,-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="block counts"):
            agents.parse_cpu_blocks(bad)


def test_mori_args_take_flags_as_their_value(agents: ModuleType) -> None:
    """``--mori-args '--fill-idle'``, as its help shows it, reaches the option whole;
    argparse alone would read ``--fill-idle`` as an unknown option of the bench's."""
    glue = agents.glue_flag_values
    assert glue(["--seed", "5", "--mori-args", "--fill-idle --no-learn-costs"]) == [
        "--seed", "5", "--mori-args=--fill-idle --no-learn-costs"]
    assert glue(["--mori-args=--fill-idle"]) == ["--mori-args=--fill-idle"]
    assert glue(["--mori-args"]) == ["--mori-args"]  # no value: argparse says so
    ap = argparse.ArgumentParser()
    ap.add_argument("--mori-args", default="")
    assert ap.parse_args(glue(["--mori-args", "--fill-idle"])).mori_args == "--fill-idle"


def test_engine_cpus_split(agents: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agents.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert agents.split_cpus("auto") == ({2}, {0, 1})
    assert agents.split_cpus("0") == ({0}, {1, 2})
    assert agents.split_cpus("1,2") == ({1, 2}, {0})
    assert agents.split_cpus("none") == (None, None)
    for bad in ("0,1,2", "7", "x", ""):  # nothing left, not ours, not a number, empty
        with pytest.raises(argparse.ArgumentTypeError, match="engine-cpus"):
            agents.split_cpus(bad)
    monkeypatch.setattr(agents.os, "sched_getaffinity", lambda pid: {3})
    assert agents.split_cpus("auto") == (None, None)  # one CPU: nothing to split


def test_policy_rates_are_the_presets_in_policy_time(agents: ModuleType) -> None:
    preset = get_preset("cpu-tiny-llama")
    recompute, reload = agents.policy_rates(100.0)
    assert recompute == pytest.approx(CostModel(preset).prefill_rate(context=2_048) / 100)
    assert reload == pytest.approx(preset.gpu.reload_bw / 1e9 / 100)
    assert agents.policy_rates(10.0)[0] == pytest.approx(10 * recompute)


class _Metrics(http.server.BaseHTTPRequestHandler):
    """An engine's /metrics whose gauges step through ``states``, one per scrape."""

    states: list[tuple[int, int]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        running, waiting = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        body = (f"vllm:num_requests_running{{engine=\"0\"}} {running}\n"
                f"vllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_load_sampler_counts_queued_samples(agents: ModuleType) -> None:
    _Metrics.states = [(1, 2), (0, 0), (3, 1), (2, 0)]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with agents.LoadSampler(url, interval_s=0.01) as load:
            deadline = time.monotonic() + 10
            while len(load.samples) < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
        got = load.summary()
    finally:
        server.shutdown()
    n = got["load_samples"]
    assert n >= 8
    # three scrapes step through the states, then the last state repeats
    assert load.samples[:4] == [(1, 2), (0, 0), (3, 1), (2, 0)]
    assert got["queued_share"] == pytest.approx(2 / n)
    assert got["running_mean"] == pytest.approx((1 + 0 + 3 + 2 * (n - 3)) / n)
    empty = agents.LoadSampler("http://127.0.0.1:9").summary()
    assert empty == {"load_samples": 0, "queued_share": None, "running_mean": None,
                     "waiting_mean": None}


def _row(arm: str, rnd: int, rps: float, ok: bool = True) -> dict[str, Any]:
    return {"arm": arm, "name": arm, "round": rnd, "ok": ok, "requests_per_s": rps,
            "output_tokens_per_s": 2 * rps, "ttft_p50_wall_s": 0.1 * rnd,
            "ttft_p90_wall_s": 0.3, "recomputed_per_request": 100.0 * rnd,
            "queued_share": 0.5}


def test_summary_and_verdict_over_rounds(agents: ModuleType) -> None:
    rows = [_row("a", 1, 40.0), _row("d", 1, 48.0), _row("a", 2, 44.0), _row("d", 2, 44.0),
            _row("a", 3, 50.0), _row("d", 3, 60.0), _row("b", 1, 30.0),
            _row("b", 2, 0.0, ok=False)]
    text = agents.summary_table(rows)
    line_a = next(line for line in text.splitlines() if line.startswith("(a)"))
    assert "44.00 [40.00 - 50.00]" in line_a and " 3 " in line_a  # median [min - max], runs
    line_b = next(line for line in text.splitlines() if line.startswith("(b)"))
    assert "30.00" in line_b and "[" not in line_b  # one run that worked: no range
    lines = agents.verdict(rows)
    assert lines[0] == ("(d) / (a) requests per second, by round: 1.200, 1.000, 1.200 "
                        "(min 1.000, median 1.200)")
    assert lines[1].startswith("(d) / (b) requests per second, by round: 1.600 ")
    assert len(lines) == 2  # no line of (d) over itself


def test_cpu_busy_shares_between_two_readings(agents: ModuleType) -> None:
    before = {0: (100, 1_000), 1: (500, 1_000)}
    after = {0: (150, 1_100), 1: (600, 1_100), 2: (5, 10)}  # CPU 2: no first reading
    shares = agents.busy_shares(before, after)
    assert shares == {0: pytest.approx(0.5), 1: pytest.approx(1.0)}
    assert agents.mean_busy(shares, frozenset({1})) == pytest.approx(1.0)
    assert agents.mean_busy(shares, None) == pytest.approx(0.75)
    assert agents.mean_busy(shares, frozenset({7})) is None
    now = agents.cpu_times()  # this machine's, where /proc/stat exists
    assert all(0 <= busy <= total for busy, total in now.values())


def test_the_run_calibration_sets_the_rates_mori_serve_is_told(agents: ModuleType) -> None:
    from mori.core.calibration import EngineCalibration

    preset_rates = agents.policy_rates(100.0)
    slow = EngineCalibration(tau=0.005, flops=1.9e10, eta_gemm=0.37, eta_attn=1.0,
                             mem_bw=2e10, eta_mem=1.0, request_overhead_s=0.01,
                             copy_bw=1.5e8)
    recompute, reload = agents.policy_rates(100.0, slow)
    assert recompute < preset_rates[0] / 2  # the slower engine recomputes more slowly
    assert reload == pytest.approx(1.5e8 / 1e9 / 100.0)


class _Timers(http.server.BaseHTTPRequestHandler):
    """A /metrics with the engine's TTFT histogram and the gateway's two, each reading
    advancing the counts (``readings`` of (sum, count) per histogram)."""

    readings: list[dict[str, tuple[float, int]]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        now = _Timers.readings.pop(0)
        body = "".join(f'{name}_sum{{model_name="m"}} {total}\n{name}_count{{model_name="m"}} '
                       f"{count}\n" for name, (total, count) in now.items())
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_the_mean_ttft_is_split_between_engine_gateway_and_hops(agents: ModuleType) -> None:
    _Timers.readings = [
        {"vllm:time_to_first_token_seconds": (1.0, 10), "mori_ttft_seconds": (2.0, 10),
         "mori_held_seconds": (0.5, 10)},
        {"vllm:time_to_first_token_seconds": (3.0, 30), "mori_ttft_seconds": (8.0, 30),
         "mori_held_seconds": (2.5, 30)},
    ]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Timers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        keys = ("engine_ttft", "gateway_ttft", "gateway_held")
        before, after = agents.timer_sums(url, keys), agents.timer_sums(url, keys)
    finally:
        server.shutdown()
    means = agents.timer_means(before, after)
    # 20 requests between the readings: 2 s engine, 6 s gateway, 2 s held
    assert means == pytest.approx({"engine_ttft": 0.1, "gateway_ttft": 0.3,
                                   "gateway_held": 0.1})
    split = agents.latency_split(0.35, means)
    assert split == pytest.approx({"ttft_mean_ms": 350.0, "engine_ttft_mean_ms": 100.0,
                                   "gateway_held_mean_ms": 100.0,
                                   "gateway_path_mean_ms": 100.0, "client_hop_mean_ms": 50.0})
    line = agents.latency_line({"arm": "d", "round": 1, **split})
    assert line == ("(d, round 1) TTFT mean 350.0 ms = engine 100.0 + held at the gateway "
                    "100.0 + gateway path 100.0 + client hops 50.0")
    # straight to the engine (arm a): the rest is the client's hop; nothing counted: None
    direct = agents.latency_split(0.12, {"engine_ttft": 0.1})
    assert direct == pytest.approx({"ttft_mean_ms": 120.0, "engine_ttft_mean_ms": 100.0,
                                    "client_hop_mean_ms": 20.0})
    assert agents.timer_means({}, {"engine_ttft": (0.0, 0.0)}) == {"engine_ttft": None}
    assert agents.latency_line({"arm": "a", "round": 1, "ttft_mean_ms": None}) is None
