"""The dashboard in a real headless Chromium (``conftest.py``).

Live: ``mori serve`` (two simulated replicas, keys) runs as a child process while
``mori replay`` drives it with the shipped Claude Code traces; the page must show the
running programs, update within 3 s, log no console error, keep the admin key enforced
and show client-chosen program ids as text. Timeline: a file written by
``mori simulate --timeline`` is opened the same way, and its slider changes the view.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mori.cli.main import main
from support.serve_process import stop, wait_listening

ADMIN = "sk-dash-admin-5e1f0c"
USER = "sk-dash-user-9a7b2d"
ROWS = "#programs tbody tr"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.e2e  # a real browser (scripts/chromium_env.sh fetches it)


@dataclass(frozen=True)
class Live:
    url: str
    log: Path


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """``mori serve`` with keys, driven by ``mori replay`` for the whole module."""
    tmp = Path(tempfile.mkdtemp(prefix="mori-dash-"))
    serve_log = (tmp / "serve.log").open("w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "mori", "serve", "--port", "0", "--replicas", "2",
         "--time-scale", "20", "--admin-key", ADMIN, "--api-key", USER,
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=serve_log, text=True, env=ENV)
    replay = None
    try:
        url = wait_listening(serve)
        replay = subprocess.Popen(
            [sys.executable, "-m", "mori", "replay", "--target", url, "--programs", "12",
             "--time-scale", "20", "--duration", "100000", "--stagger", "20",
             "--api-key", USER, "--quiet"],
            stdout=subprocess.DEVNULL, stderr=(tmp / "replay.log").open("w"), env=ENV)
        yield Live(url, tmp)
    finally:
        if replay is not None:
            stop(replay)
        stop(serve)
        serve_log.close()


def rows(page: Any) -> list[list[str]]:
    return [[c.inner_text() for c in r.query_selector_all("td")]
            for r in page.query_selector_all(ROWS)]


def test_the_live_page_shows_the_running_programs_and_updates(live: Live, page: Any,
                                                               console: Any) -> None:
    page.goto(f"{live.url}/dashboard#key={ADMIN}")
    page.wait_for_selector(ROWS, timeout=20_000)
    assert "key=" not in page.url  # the key left the address bar
    # the programs shown are the gateway's programs, ranked busiest first
    shown = rows(page)
    listed = httpx.get(live.url + "/v1/programs", headers={"Authorization": f"Bearer {ADMIN}"},
                       timeout=10).json()["data"]
    known = {p["program_id"] for p in listed}
    assert shown and {r[1] for r in shown} & known
    idleness_values = [float(r[2]) for r in shown]
    assert idleness_values == sorted(idleness_values)
    assert page.inner_text("#summary").count("programs") == 1
    assert page.query_selector_all("#spectrum svg path")
    assert page.query_selector("#chart-gpu-box svg") is not None
    # it updates on its own within 3 s: a new state, at a later policy time
    before = page.evaluate("() => [+document.body.dataset.updates, "
                           "+document.body.dataset.frameTime]")
    page.wait_for_function(
        f"() => +document.body.dataset.updates > {before[0]} && "
        f"+document.body.dataset.frameTime > {before[1]}", timeout=3_000)
    assert console.problems() == []


def test_the_admin_key_is_enforced(live: Live, page: Any, console: Any) -> None:
    assert httpx.get(live.url + "/dashboard/state", timeout=10).status_code == 401
    assert httpx.get(live.url + "/dashboard/state", timeout=10,
                     headers={"Authorization": f"Bearer {USER}"}).status_code == 403
    page.goto(live.url + "/dashboard")
    page.wait_for_selector("#keybox", state="visible", timeout=10_000)
    assert not page.is_visible("#main") and rows(page) == []
    assert "needs an admin key" in page.inner_text("#keymsg")
    page.fill("#keyinput", USER)  # an API key is not an admin key
    page.click("#keybox button")
    page.wait_for_function("() => document.getElementById('keymsg').textContent"
                           ".includes('refused')", timeout=10_000)
    assert not page.is_visible("#main") and rows(page) == []
    page.fill("#keyinput", ADMIN)
    page.click("#keybox button")
    page.wait_for_selector(ROWS, timeout=10_000)
    assert page.is_visible("#main") and not page.is_visible("#keybox")
    # the browser reports the refused requests themselves; nothing else may go wrong
    assert console.problems(allow=("status of 401", "status of 403")) == []


def test_client_chosen_ids_are_shown_as_text(live: Live, page: Any, console: Any) -> None:
    evil = '<img src=x onerror="window.__pwned=1">"</td>'
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=USER, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2, extra_body={"program_id": evil})
    page.goto(f"{live.url}/dashboard#key={ADMIN}")
    page.wait_for_selector(ROWS, timeout=20_000)
    page.fill("#filter", "onerror")
    page.wait_for_function(f"() => document.querySelector({ROWS!r})?.innerText.includes('<img')",
                           timeout=5_000)
    assert all(r[1].endswith(evil) for r in rows(page))  # the key's namespace, then the id
    assert page.query_selector("#programs img") is None
    assert page.evaluate("() => window.__pwned") is None
    assert console.problems() == []


# -- the timeline of a simulated run --------------------------------------------------------

@pytest.fixture(scope="module")
def timeline_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("timeline") / "run.html"
    assert main(["simulate", "--policy", "mori", "--programs", "10", "--replicas", "2",
                 "--duration", "600", "--timeline", str(path), "--timeline-frames", "60",
                 "--quiet"]) == 0
    return path


def test_the_timeline_slider_changes_what_is_shown(timeline_file: Path, page: Any,
                                                   console: Any) -> None:
    page.goto(timeline_file.as_uri())
    page.wait_for_selector(ROWS, timeout=10_000)
    assert page.is_visible("#timebar") and not page.is_visible("#keybox")
    assert page.inner_text("#clock").startswith("10.0 min")  # opens at the end of the run

    def view() -> tuple[str, str, str, str | None]:
        cursor = page.query_selector("#chart-gpu-box line.cursor")
        assert cursor is not None
        return (page.inner_text("#clock"), page.inner_text("#summary"),
                page.inner_text("#programs tbody"), cursor.get_attribute("x1"))

    end = view()
    page.eval_on_selector("#slider", "s => { s.value = '5'; "
                                     "s.dispatchEvent(new Event('input')); }")
    early = view()
    assert early[0].startswith("1.0 min")  # frame 5 of 60 over 600 s: t = 60 s
    assert early[1] != end[1] and early[2] != end[2]
    assert early[3] is not None and end[3] is not None and float(early[3]) < float(end[3])
    page.click("#play")  # plays forward from there
    page.wait_for_function("() => !document.getElementById('clock').textContent"
                           ".startsWith('1.0 min')", timeout=3_000)
    page.click("#play")
    assert console.problems() == []
