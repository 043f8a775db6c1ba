"""The dashboard page: one HTML document with its CSS and JavaScript inline.

The assets (``assets/``) ship inside the package, so the page needs no internet and no
second request. ``live_page`` is the shell ``mori serve`` answers at ``/dashboard`` (it
holds no data: the script polls the admin-only state endpoint); ``timeline_page`` embeds
every frame of a simulated run in one self-contained file.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True, slots=True)
class Page:
    """An HTML document and the Content-Security-Policy that fits it (``header_csp``
    adds what only a response header can carry)."""

    html: str
    csp: str

    @property
    def header_csp(self) -> str:
        return self.csp + "; frame-ancestors 'none'"


@cache
def _asset(name: str) -> str:
    return (resources.files("mori.dashboard") / "assets" / name).read_text(encoding="utf-8")


def _json_for_script(data: Any) -> str:
    """JSON safe inside ``<script>``: no ``<`` can close the element early."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029"))


def _page(mode: str, title: str, subtitle: str, data: dict[str, Any]) -> Page:
    js = _asset("dashboard.js")
    html = (_asset("page.html").replace("{{css}}", _asset("dashboard.css"))
            .replace("{{title}}", _escape(title)).replace("{{subtitle}}", _escape(subtitle))
            .replace("{{mode}}", mode))
    # the data and the script last, so no placeholder inside them is ever replaced
    html = html.replace("{{js}}", js).replace("{{data}}", _json_for_script({"mode": mode, **data}))
    digest = base64.b64encode(hashlib.sha256(js.encode()).digest()).decode()
    csp = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
           f"connect-src 'self'; script-src 'sha256-{digest}'; base-uri 'none'; "
           "form-action 'none'")
    return Page(html, csp)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def live_page(state_url: str, poll_ms: int = 1000, subtitle: str = "live") -> Page:
    """The live view's shell: it polls ``state_url`` every ``poll_ms``."""
    return _page("live", "MORI dashboard", subtitle, {"stateUrl": state_url, "pollMs": poll_ms})


def timeline_page(frames: list[dict[str, Any]], charts: dict[str, str], duration_s: float,
                  run: str) -> str:
    """A self-contained file: every frame, the whole-run charts and a time slider."""
    page = _page("timeline", f"MORI timeline: {run}", run,
                 {"frames": frames, "charts": charts, "duration": duration_s, "run": run})
    meta = f'<meta http-equiv="Content-Security-Policy" content="{page.csp}">'
    return page.html.replace('<meta charset="utf-8">', '<meta charset="utf-8">\n' + meta, 1)
