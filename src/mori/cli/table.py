"""Plain aligned text tables: the results of ``mori simulate`` and the listings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from mori.core.costmodel import get_preset
from mori.sim.metrics import RunResult


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool] | None = None) -> str:
    """Columns padded to their widest cell, a dashed rule under the header.

    ``right[i]`` right-aligns column i (numbers); by default every column is left-aligned.
    The last column is not padded, so no line ends in spaces.
    """
    align = list(right) if right is not None else [False] * len(headers)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if a else c.ljust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def short_hardware(names: Iterable[str]) -> dict[str, str]:
    """A short label per preset name: its GPU (x TP when > 1), e.g. ``H200`` or ``B200x2``.

    Falls back to the full preset names when two presets would get the same label.
    """
    unique = list(dict.fromkeys(names))
    labels = {}
    for name in unique:
        p = get_preset(name)
        labels[name] = p.gpu.name + (f"x{p.tp}" if p.tp > 1 else "")
    if len(set(labels.values())) < len(labels):
        return {n: n for n in unique}
    return labels


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return format(value * scale, fmt)


RESULT_HEADERS = ("policy", "programs", "hardware", "cpu", "tok/s", "steps/s", "TTFT mean (s)",
                  "TTFT p90 (s)", "TTFT p99 (s)", "GPU busy %", "GPU hit %", "CPU hit %",
                  "recomputed (M tok)", "reloaded (M tok)")
DISK_HEADERS = ("disk hit %", "disk read (M tok)", "disk written (TB)")
"""The columns a results table adds (with a ``disk`` ratio column after ``cpu``) when a
run has a disk tier."""


def shown_programs(r: RunResult, per_replica: bool) -> int:
    """The programs of a run as shown: in total, or ``per_replica`` (a sweep's convention
    at DP > 1, where a run simulates programs x replicas programs)."""
    c = r.config
    return c.programs // c.replicas if per_replica else c.programs


def results_table(results: Sequence[RunResult], per_replica: bool = False) -> str:
    """One row per run, in the order given; ``per_replica``: the programs column counts
    programs per replica."""
    short = short_hardware(r.config.hardware for r in results)
    disk = any(r.config.disk_ratio or r.config.disk_kv_tokens for r in results)
    rows = []
    for r in results:
        row = [r.config.policy, str(shown_programs(r, per_replica)), short[r.config.hardware],
               format(r.config.cpu_ratio, "g"),
               _num(r.output_tokens_per_s, ".1f"), _num(r.steps_per_s, ".3f"),
               _num(r.ttft_mean_s, ".2f"), _num(r.ttft_p90_s, ".2f"),
               _num(r.ttft_p99_s, ".2f"),
               _num(r.gpu_busy_frac, ".1f", 100), _num(r.gpu_hit_rate, ".1f", 100),
               _num(r.cpu_hit_rate, ".1f", 100), _num(r.recomputed_tokens, ".2f", 1e-6),
               _num(r.reloaded_tokens, ".2f", 1e-6)]
        if disk:
            row[4:4] = [format(r.config.disk_ratio, "g") if r.config.disk_kv_tokens is None
                        else f"{r.disk_kv_capacity_tokens:,} tok"]
            row += [_num(r.disk_hit_rate, ".1f", 100), _num(r.disk_read_tokens, ".2f", 1e-6),
                    _num(r.disk_written_bytes, ".2f", 1e-12)]
        rows.append(tuple(row))
    headers = (RESULT_HEADERS if not disk else
               (*RESULT_HEADERS[:4], "disk", *RESULT_HEADERS[4:], *DISK_HEADERS))
    right = [False, True, False] + [True] * (len(headers) - 3)
    return format_table(headers, rows, right)


def left_out_note(results: Sequence[RunResult], trace_set: str, total: int,
                  max_context: int | None) -> str | None:
    """One line on the programs the context-window rule left out, or None if none was."""
    by_hw: dict[str, int] = {}
    for r in results:
        if r.programs_left_out:
            by_hw.setdefault(r.config.hardware, r.programs_left_out)
    if not by_hw:
        return None

    def window(hw: str) -> int:
        return max_context or get_preset(hw).model.context_window

    if len(set(by_hw.values())) == 1 and len({window(h) for h in by_hw}) == 1:
        hw = next(iter(by_hw))
        where = f"{window(hw):,} tokens"
        if len(by_hw) == 1:
            where += f" on {hw}"
        return (f"note: {by_hw[hw]} of the {total} programs of trace set {trace_set!r} were left "
                f"out: their first step does not fit the context window ({where})")
    parts = ", ".join(f"{n} on {hw} ({window(hw):,} tokens)" for hw, n in by_hw.items())
    return (f"note: programs of trace set {trace_set!r} ({total}) were left out because their "
            f"first step does not fit the context window: {parts}")
