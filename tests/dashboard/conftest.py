"""A real headless Chromium for the dashboard's browser tests, driven by Playwright.

The browser is Debian's ``chromium`` package, fetched without root by
``scripts/chromium_env.sh`` (apt-get download, unpacked with dpkg -x into
``~/.cache/mori/chromium``; the first run on a machine takes about a minute, later runs
reuse it), or ``$MORI_CHROMIUM`` where that names another build. The script's path is
asked for once per test session. When the script cannot provide a browser (no apt-get,
Debian's repositories unreachable) the browser tests are skipped, with the script's own
words as the reason; ``MORI_SKIP_BROWSER=1`` skips them outright.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chromium_env.sh"
INSTALL_TIMEOUT_S = 900
# as root in a container, without the sandbox; no network of its own (these machines may
# have none) and a fresh profile each launch
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


@cache
def _fetch_chromium() -> tuple[Path | None, str]:
    """The browser's path from ``scripts/chromium_env.sh``, or None and why not."""
    try:
        res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                             timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{SCRIPT.name} ran past {INSTALL_TIMEOUT_S} s"
    lines = res.stdout.strip().splitlines()
    if res.returncode == 0 and lines and Path(lines[-1]).exists():
        return Path(lines[-1]), ""
    return None, f"{SCRIPT.name} exited {res.returncode}: {res.stderr.strip()[-1500:]}"


def ensure_chromium() -> Path:
    if os.environ.get("MORI_SKIP_BROWSER") == "1":
        pytest.skip("MORI_SKIP_BROWSER=1: the dashboard's browser tests are skipped")
    if os.environ.get("MORI_CHROMIUM"):
        path = Path(os.environ["MORI_CHROMIUM"])
        if not path.exists():
            pytest.fail(f"MORI_CHROMIUM={path} does not exist")
        return path
    path, why = _fetch_chromium()
    if path is None:
        pytest.skip(f"no headless Chromium for the dashboard's browser tests: {why}")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One browser per test module: Playwright's synchronous API runs an event loop in
    this thread while it is open, so it must be closed before other tests that start
    their own loop (``asyncio.run``)."""
    path = ensure_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(path), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Console:
    """What a page reported: console messages by type, and uncaught errors."""

    def __init__(self, page: Any) -> None:
        self.messages: list[tuple[str, str]] = []
        self.errors: list[str] = []
        page.on("console", lambda m: self.messages.append((m.type, m.text)))
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def problems(self, allow: tuple[str, ...] = ()) -> list[str]:
        """Console errors and warnings (but those containing an ``allow`` text) and
        uncaught exceptions."""
        bad = [f"{t}: {text}" for t, text in self.messages
               if t in ("error", "warning") and not any(a in text for a in allow)]
        return bad + [f"uncaught: {e}" for e in self.errors]


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 1000})
    try:
        yield ctx.new_page()
    finally:
        ctx.close()


@pytest.fixture
def console(page: Any) -> Console:
    return Console(page)
