"""Charts drawn on the server as SVG text: line charts and the idleness spectrum.

No charting library and nothing fetched by the browser: each function returns one
``<svg>`` element as a string, with every text escaped (program ids come from clients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from mori.core.types import Status, Tier

PALETTE = ("#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#0891b2", "#db2777",
           "#65a30d", "#ea580c", "#475569")
STATUS_COLOUR = {Status.REASONING: "#2563eb", Status.ACTING: "#f59e0b", Status.HELD: "#ef4444"}
TIER_LANES = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.NONE)
"""The spectrum's lanes, top to bottom (the disk's only where a program is on a disk)."""


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    values: Sequence[float]  # NaN breaks the line
    colour: str


def nice_step(span: float, ticks: int = 4) -> float:
    """A 1-2-5 step giving about ``ticks`` intervals over ``span``."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def fmt(v: float) -> str:
    """A short tick label: 1.2k, 3.5M, 0.25."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e3:
        return f"{v / 1e3:.3g}k"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def line_chart(title: str, xs: Sequence[float], series: Sequence[Series], *,
               x_range: tuple[float, float], y_max: float | None = None, unit: str = "",
               x_label: str = "", width: int = 400, height: int = 160,
               cursor: bool = False, chart_id: str = "") -> str:
    """A line chart of ``series`` over ``xs`` (one value per x each).

    ``y_max``: the top of the y axis (None: from the data). ``cursor``: add a hidden
    vertical line the page moves (timeline view); its data attributes map time to x.
    """
    ml, mr, mt, mb = 44, 10, 24, 24
    pw, ph = width - ml - mr, height - mt - mb
    x0, x1 = x_range
    xspan = (x1 - x0) or 1.0
    finite = [v for s in series for v in s.values if math.isfinite(v)]
    top = y_max if y_max is not None else (max(finite) if finite else 1.0)
    step = nice_step(top if top > 0 else 1.0)
    top = max(step, math.ceil((top if top > 0 else 1.0) / step - 1e-9) * step)

    def px(x: float) -> float:
        return ml + (x - x0) / xspan * pw

    def py(y: float) -> float:
        return mt + ph - min(max(y, 0.0), top) / top * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} '
             f'{height}" width="{width}" height="{height}" role="img" '
             f'aria-label={quoteattr(title)}'
             + (f' id={quoteattr(chart_id)}' if chart_id else "") + ">",
             f'<text x="{ml}" y="14" class="ct">{escape(title)}</text>']
    lx = ml + 8 + 7 * len(title)
    if len(series) > 8:  # too many to name: one line each, coloured in turn
        parts.append(f'<text x="{lx:.0f}" y="11" class="lg">{len(series)} lines: '
                     f'{escape(series[0].name)}…{escape(series[-1].name)}</text>')
    else:
        for s in series:
            parts.append(f'<rect x="{lx:.0f}" y="6" width="10" height="3" fill="{s.colour}"/>'
                         f'<text x="{lx + 13:.0f}" y="11" class="lg">{escape(s.name)}</text>')
            lx += 22 + 6 * len(s.name)
    y = 0.0
    while y <= top + 1e-9:
        yy = py(y)
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     'class="grid"/>'
                     f'<text x="{ml - 4}" y="{yy + 3:.1f}" class="tk" text-anchor="end">'
                     f'{fmt(y)}{escape(unit)}</text>')
        y += step
    xstep = nice_step(xspan, 5)
    xt = math.ceil(x0 / xstep) * xstep
    while xt <= x1 + 1e-9:
        parts.append(f'<text x="{px(xt):.1f}" y="{height - 8}" class="tk" '
                     f'text-anchor="middle">{fmt(xt)}</text>')
        xt += xstep
    if x_label:
        parts.append(f'<text x="{width - mr}" y="11" class="tk" text-anchor="end">'
                     f'x: {escape(x_label)}</text>')
    for s in series:
        d, pen = [], False
        for x, v in zip(xs, s.values, strict=True):
            if not math.isfinite(v):
                pen = False
                continue
            d.append(f"{'L' if pen else 'M'}{px(x):.1f} {py(v):.1f}")
            pen = True
        if d:
            parts.append(f'<path d="{"".join(d)}" fill="none" stroke="{s.colour}" '
                         'stroke-width="1.5"/>')
    if cursor:
        parts.append(f'<line class="cursor" x1="{ml}" x2="{ml}" y1="{mt}" y2="{mt + ph}" '
                     f'data-x0="{x0}" data-x1="{x1}" data-left="{ml}" data-width="{pw}"/>')
    parts.append("</svg>")
    return "".join(parts)


def spectrum(points: Sequence[tuple[float, Status, Tier]], width: int = 940) -> str:
    """The idleness spectrum: one mark per program at its idleness (0 busy .. 1 idle),
    in a lane per tier, coloured by status. Marks of a colour and lane are one path."""
    ml, mr, lane = 48, 12, 22
    pw = width - ml - mr
    disk = any(tier is Tier.DISK for _, _, tier in points)
    lanes = [t for t in TIER_LANES if disk or t is not Tier.DISK]
    height = 24 + lane * len(lanes) + 20
    paths: dict[tuple[int, Status], list[str]] = {}
    for idleness, status, tier in points:
        i = lanes.index(tier)
        x = ml + min(max(idleness, 0.0), 1.0) * pw
        y = 24 + i * lane
        paths.setdefault((i, status), []).append(f"M{x:.1f} {y + 3}v{lane - 6}")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart spectrum" viewBox="0 0 '
             f'{width} {height}" width="{width}" height="{height}" role="img" '
             'aria-label="idleness spectrum">',
             '<text x="48" y="14" class="ct">Idleness spectrum</text>']
    lx = 200.0
    for status, colour in STATUS_COLOUR.items():
        parts.append(f'<rect x="{lx:.0f}" y="6" width="10" height="8" fill="{colour}"/>'
                     f'<text x="{lx + 13:.0f}" y="14" class="lg">{status.value}</text>')
        lx += 30 + 7 * len(status.value)
    for i, tier in enumerate(lanes):
        y = 24 + i * lane
        parts.append(f'<rect x="{ml}" y="{y + 1}" width="{pw}" height="{lane - 2}" '
                     f'class="lane"/><text x="{ml - 6}" y="{y + lane / 2 + 4:.0f}" class="tk" '
                     f'text-anchor="end">{tier.value.upper()}</text>')
    for (_, status), segs in sorted(paths.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
        parts.append(f'<path d="{"".join(segs)}" stroke="{STATUS_COLOUR[status]}" '
                     'stroke-width="1.5" stroke-opacity="0.8"/>')
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        x = ml + v * pw
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" class="tk" text-anchor="middle">'
                     f'{v:g}</text>')
    parts.append(f'<text x="{ml + pw}" y="{height - 6}" class="tk" text-anchor="end" '
                 'dy="-12">idleness: busy → idle</text></svg>')
    return "".join(parts)
