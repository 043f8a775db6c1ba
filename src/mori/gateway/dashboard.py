"""The live dashboard of ``mori serve``: ``GET /dashboard`` and ``GET /dashboard/state``.

``/dashboard`` is the page (``mori.dashboard.page``): a shell with no data, open to
anyone who reaches the port. Its script polls ``/dashboard/state`` about once a second;
that endpoint answers only an admin key (``--admin-key``; with no keys configured, the
loopback gateway is open as its other admin endpoints are). The page asks for the key
and keeps it in the tab's session storage; ``/dashboard#key=KEY`` hands it over without
it reaching the server or its logs.

``LiveDashboard`` samples the gateway once a second into a ``History`` (the last five
minutes, wall-clock seconds): the policy's tier ledgers, the held requests, and the
completion tokens and TTFTs the metrics saw since the previous sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mori.dashboard.history import History
from mori.dashboard.page import live_page
from mori.dashboard.payload import charts, frame
from mori.dashboard.snapshot import take_snapshot, tier_rows

if TYPE_CHECKING:
    from mori.gateway.app import Gateway

log = logging.getLogger("mori.gateway")

STATE_PATH = "/dashboard/state"
DECISIONS_SHOWN = 50
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


class LiveDashboard:
    """Samples one gateway and answers the dashboard's two endpoints."""

    def __init__(self, gw: Gateway, period_s: float = 1.0, keep_s: float = 300.0) -> None:
        self.gw = gw
        self.period_s = period_s
        self.keep_s = keep_s
        self.history = History(window_s=30.0, keep_s=keep_s)
        self.page = live_page(STATE_PATH, poll_ms=int(period_s * 1000))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.sample()
            except Exception:  # the dashboard must never take the gateway down
                log.exception("dashboard sample failed")

    def sample(self) -> None:
        ctl = self.gw.ctl
        m = self.gw.metrics
        self.history.record(ctl.wall(), tier_rows(ctl.policy), ctl.policy.held_count,
                            int(m.completion_tokens.total), m.ttft.take())

    # -- endpoints ------------------------------------------------------------------------
    async def page_endpoint(self, request: Request) -> Response:
        return Response(self.page.html, media_type="text/html; charset=utf-8",
                        headers={**_HEADERS, "Content-Security-Policy": self.page.header_csp})

    def state_endpoint(self, denied: Callable[[Request], Response | None]
                       ) -> Callable[[Request], Any]:
        async def state(request: Request) -> Response:
            refusal = denied(request)
            if refusal is not None:
                return refusal
            return JSONResponse(self.state(), headers=_HEADERS)

        return state

    def state(self) -> dict[str, Any]:
        ctl = self.gw.ctl
        s = self.gw.settings
        agents = {pid: (info.agent.agent, ", ".join(
                      f"{n} ×{c}" for n, c in info.agent.tools.most_common(5)))
                  for pid, info in ctl.programs.items() if not info.anonymous}
        snap = take_snapshot(ctl.policy, ctl.now(), ctl.log.latest(DECISIONS_SHOWN),
                             time_scale=s.time_scale, agents=agents)
        shown = frame(snap, self.history.latest)
        shown["prices"] = [price_row(r, ctl.prices.learners[r].view())
                           for r in range(len(ctl.replicas.all))]
        return {
            "frame": shown,
            "charts": charts(self.history, (-self.keep_s, 0.0), origin=ctl.wall(),
                             x_label="s, 0 = now"),
            "meta": {"policy": s.policy, "replicas": len(ctl.replicas.all),
                     "time_scale": s.time_scale},
        }


def price_row(replica: int, measured: dict[str, Any]) -> list[Any]:
    """A replica's learned engine prices as the page shows them: [replica, stretches,
    recompute ms per 1,000 tokens, reload ms fixed, reload ms per 1,000 tokens] (None:
    not learned yet)."""
    def ms(key: str, per: float) -> float | None:
        v = measured.get(key)
        return None if v is None else round(v * 1000 * per, 2)
    return [replica, measured["samples"], ms("recompute_per_token_s", 1000),
            ms("reload_fixed_s", 1), ms("reload_per_token_s", 1000)]

