"""Slow work the tests wait for, started in the background as soon as pytest knows which tests will run.

Two jobs: the docs site's build (Sphinx reads the notebooks and the package for most of a minute) and
the notebooks' small runs on the CPU (a kernel process each, one after another). Each keeps one core
busy; the tests keep about one more busy on average, so on a small machine the jobs fill what the
tests leave idle. The tests that need a job wait for its result, and fail with its output if it failed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_work = Path(tempfile.mkdtemp(prefix="offload-examples-tests-"))
_docs: subprocess.Popen | None = None
_notebooks: dict[str, subprocess.CompletedProcess | None] = {}
_notebooks_done = threading.Condition()
_running: set[subprocess.Popen] = set()


def start_docs_build() -> None:
    """Build the site (warnings as errors, every reference checked) unless the build has started."""
    global _docs
    if _docs is not None:
        return
    # --keep-going writes the whole site even when a warning fails the build, so that the browser
    # tests still look at it; the build test fails on the warnings.
    args = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(ROOT),
            str(_work / "html")]
    _docs = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def docs_build(timeout: float = 600) -> tuple[Path, subprocess.CompletedProcess]:
    """The site's folder and the finished build (started here if it was not)."""
    start_docs_build()
    stdout, stderr = _docs.communicate(timeout=timeout)
    return _work / "html", subprocess.CompletedProcess(_docs.args, _docs.returncode, stdout, stderr)


def _small_run(nb: Path) -> subprocess.CompletedProcess:
    """Execute ``nb`` at the small size on the CPU in a process of its own; its results JSON goes next to
    the executed copy. The kernel imports the package from the repository, installed or not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "offload_examples.instruments.notebooks", str(nb), "-o", str(_work / nb.name),
            "-p", "device", "cpu", "-p", "size", "small", "-p", "results_json", str(_results(nb))]
    # a process group of its own: stopping it stops the kernel it started too
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            process_group=0)
    _running.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    finally:
        _running.discard(proc)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def _results(nb: Path) -> Path:
    return _work / f"{nb.stem}.json"


def start_small_runs(notebooks: list[Path]) -> None:
    """Run each notebook small, one after another, on a thread that waits for their processes."""
    todo = [nb for nb in notebooks if nb.name not in _notebooks]
    if not todo:
        return
    _notebooks.update(dict.fromkeys((nb.name for nb in todo), None))

    def run_all() -> None:
        for nb in todo:
            done = _small_run(nb)
            with _notebooks_done:
                _notebooks[nb.name] = done
                _notebooks_done.notify_all()

    threading.Thread(target=run_all, name="notebooks", daemon=True).start()


def small_run(nb: Path, timeout: float = 1800) -> dict:
    """The results JSON of ``nb``'s small run; an AssertionError with the run's output if it failed."""
    start_small_runs([nb])
    with _notebooks_done:
        if not _notebooks_done.wait_for(lambda: _notebooks[nb.name] is not None, timeout=timeout):
            raise TimeoutError(f"{nb.name}'s small run did not finish in {timeout} s")
    done = _notebooks[nb.name]
    assert done.returncode == 0, f"{nb.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return json.loads(_results(nb).read_text())


@atexit.register
def _stop() -> None:
    """End a build still running (an interrupted test run) and delete what the jobs wrote."""
    if _docs is not None and _docs.poll() is None:
        _docs.kill()
        _docs.wait()
    for proc in list(_running):
        os.killpg(proc.pid, signal.SIGKILL)
    shutil.rmtree(_work, ignore_errors=True)
