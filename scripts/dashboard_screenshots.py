"""Take the dashboard screenshots (docs/dashboard-live.png, -timeline.png).

Live: ``mori serve`` (2 simulated replicas, an admin key) driven by ``mori replay`` for
``--warmup`` wall seconds, then ``/dashboard`` in headless Chromium. Timeline:
``mori simulate --timeline`` over the same traces, shown at ``--frame``.

    python scripts/dashboard_screenshots.py [--out docs] [--chromium /usr/bin/chromium]

Needs Debian's ``chromium`` and the ``playwright`` package (both come with the tests;
without root, ``scripts/chromium_env.sh`` fetches the browser and prints its path:
``--chromium "$(scripts/chromium_env.sh | tail -1)"``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ADMIN = "sk-screenshot-admin"
USER = "sk-screenshot-user"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_serve() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mori", "serve", "--port", "0", "--replicas", "2",
         "--time-scale", "20", "--admin-key", ADMIN, "--api-key", USER,
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("mori serve exited")
    return proc, line.split("listening on ")[1].split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--chromium", default=os.environ.get("MORI_CHROMIUM", "/usr/bin/chromium"))
    ap.add_argument("--programs", type=int, default=24, help="replayed programs (live view)")
    ap.add_argument("--warmup", type=float, default=40.0, help="wall seconds of replay first")
    ap.add_argument("--frame", type=int, default=150, help="timeline frame shown (of 300)")
    a = ap.parse_args()
    serve, url = start_serve()
    replay = subprocess.Popen(
        [sys.executable, "-m", "mori", "replay", "--target", url, "--programs",
         str(a.programs), "--time-scale", "20", "--duration", "100000", "--api-key", USER,
         "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(a.warmup)
        with tempfile.TemporaryDirectory() as tmp:
            timeline = Path(tmp) / "timeline.html"
            subprocess.run([sys.executable, "-m", "mori", "simulate", "--policy", "mori",
                            "--programs", "40", "--replicas", "2", "--duration", "1200",
                            "--timeline", str(timeline), "--quiet"], check=True,
                           stdout=subprocess.DEVNULL)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=a.chromium, args=ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 1500})
                page.goto(f"{url}/dashboard#key={ADMIN}")
                page.wait_for_selector("#programs tbody tr")
                page.wait_for_timeout(1500)
                page.screenshot(path=str(a.out / "dashboard-live.png"))
                page.goto(timeline.as_uri())
                page.wait_for_selector("#programs tbody tr")
                page.eval_on_selector("#slider", f"s => {{ s.value = '{a.frame}'; "
                                      "s.dispatchEvent(new Event('input')); }")
                page.screenshot(path=str(a.out / "dashboard-timeline.png"))
                browser.close()
    finally:
        replay.terminate()
        serve.terminate()
        replay.wait(20)
        serve.wait(20)
    print(f"wrote {a.out / 'dashboard-live.png'}, {a.out / 'dashboard-timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
