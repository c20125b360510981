"""Headless Chromium for tests and benchmarks: render a local HTML file, report its script errors and DOM.

Debian's ``chromium`` (scripts/install_chromium.sh) run with a fresh profile and everything that would reach
the network off. Script errors come from Chromium's console log (``--enable-logging=stderr``: an uncaught
error is logged as ``CONSOLE ... Uncaught ...``); the rendered DOM from ``--dump-dom``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
_CONSOLE = re.compile(r":CONSOLE[^\]]*\] (.*)")


def chromium() -> str | None:
    """The Chromium binary, or None (the caller skips with scripts/install_chromium.sh as the way out)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    dom: str
    console: list[str]     # console messages (errors, warnings, logs) the page produced
    seconds: float         # wall time of the whole Chromium run

    @property
    def script_errors(self) -> list[str]:
        return [m for m in self.console if "Uncaught" in m or "Error" in m]


def _run(args: list[str], timeout: float) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix="nvrx-chromium-") as profile:
        t0 = time.perf_counter()
        proc = subprocess.run([chromium() or "chromium", *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return proc.stdout, proc.stderr, time.perf_counter() - t0


def render(page: Path, timeout: float = 90.0) -> Rendered:
    """Load PAGE (a local file), run its scripts, return the DOM after load and its console messages."""
    out, err, seconds = _run(["--dump-dom", page.resolve().as_uri()], timeout)
    return Rendered(out, [m.group(1) for m in map(_CONSOLE.search, err.splitlines()) if m], seconds)


def screenshot(page: Path, png: Path, size: str = "1400,1800", timeout: float = 90.0) -> Path:
    """A PNG of PAGE as a browser window of SIZE shows it."""
    png.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--screenshot={png.resolve()}", f"--window-size={size}", page.resolve().as_uri()], timeout)
    return png
