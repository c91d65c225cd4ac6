"""The docs site's build, started in the background as soon as pytest knows a docs test will run.

Sphinx spends most of a minute on one core reading the notebooks and the package; on a small
machine the tests that come before the docs tests keep the other core busy meanwhile. The docs
tests run last (``conftest.py`` moves them there) and wait for the build only if it is not done.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_build: tuple[Path, subprocess.Popen] | None = None


def start() -> None:
    """Start the build (warnings as errors, every reference checked) unless it has started."""
    global _build
    if _build is not None:
        return
    out = Path(tempfile.mkdtemp(prefix="offload-examples-html-"))
    # --keep-going writes the whole site even when a warning fails the build, so that the browser
    # tests still look at it; the build test fails on the warnings.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(ROOT), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    _build = out, proc
    atexit.register(stop)  # an interrupted test run leaves no build behind


def result(timeout: float = 600) -> tuple[Path, subprocess.CompletedProcess]:
    """The site's folder and the finished build (started here if it was not)."""
    start()
    out, proc = _build
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def stop() -> None:
    """End a build still running and delete the site."""
    global _build
    if _build is None:
        return
    out, proc = _build
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(out, ignore_errors=True)
    _build = None
