"""A real headless Chromium for the dashboard's browser tests, driven by Playwright.

The browser is Debian's ``chromium`` package (``/usr/bin/chromium``, or ``$MORI_CHROMIUM``),
not one Playwright downloads. When it is missing, the ``browser`` fixture installs it
with ``apt-get`` (as root, or with password-less ``sudo``), once per machine.
``MORI_SKIP_BROWSER=1`` skips these tests; anything else that goes wrong fails them
with what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("MORI_CHROMIUM", "/usr/bin/chromium"))
INSTALL_TIMEOUT_S = 900
# as root in a container, without the sandbox; no network of its own (these machines may
# have none) and a fresh profile each launch
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    return subprocess.run([*sudo, "apt-get", *args], capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def ensure_chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if os.environ.get("MORI_SKIP_BROWSER") == "1":
        pytest.skip("MORI_SKIP_BROWSER=1: the dashboard's browser tests are skipped")
    can_install = shutil.which("apt-get") is not None and (
        os.geteuid() == 0 or shutil.which("sudo") is not None)
    log = ""
    if can_install:
        res = _apt("install", "-y", "-q", "chromium")
        if res.returncode != 0:  # stale package lists: refresh them once, then retry
            _apt("update", "-q")
            res = _apt("install", "-y", "-q", "chromium")
        log = (res.stdout + res.stderr)[-2000:]
    if not CHROMIUM.exists():
        pytest.fail(f"the dashboard's browser tests need Chromium at {CHROMIUM}: install "
                    "Debian's package (apt-get install chromium), point MORI_CHROMIUM at "
                    "another build, or set MORI_SKIP_BROWSER=1 to skip them. "
                    + (f"apt-get said:\n{log}" if log else "apt-get cannot run here."))
    return CHROMIUM


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
