"""Programs that must each run in a fresh Python process, started together.

A CUDA graph capture that CUDA aborts leaves the process unable to use its random generator or to
capture again, so the tests that provoke one run their program in a process of its own. Most of
such a test's time is the start of Python, torch (and Transformer Engine) and CUDA; started at once
when their module first asks, the programs overlap one another instead of running one by one.
Output goes to files rather than pipes, so a program that writes much never waits for a reader.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO, Iterator

import pytest


@dataclass
class Finished:
    """What one program left: its exit status, standard output and standard error."""

    returncode: int
    stdout: str
    stderr: str


class FreshProcesses:
    """Start every program of ``programs`` (name -> Python source) now, each in a fresh interpreter.

    :meth:`result` waits for one of them (at most ``timeout_s``) and returns what it left;
    :meth:`close` kills those still running, so none outlives its module's tests.
    """

    def __init__(self, programs: dict[str, str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._started: dict[str, tuple[subprocess.Popen, IO[str], IO[str]]] = {}
        self._done: dict[str, Finished] = {}
        try:
            for name, source in programs.items():
                # undecodable bytes (a library's binary noise) must not keep the rest from being read
                out, err = (tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") for _ in range(2))
                proc = subprocess.Popen([sys.executable, "-c", source], stdout=out, stderr=err, text=True)
                self._started[name] = (proc, out, err)
        except BaseException:  # those started already must not outlive the failure
            self.close()
            raise

    def result(self, name: str) -> Finished:
        if name not in self._done:
            proc, out, err = self._started[name]
            try:
                proc.wait(timeout=self.timeout_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            out.seek(0)
            err.seek(0)
            self._done[name] = Finished(proc.returncode, out.read(), err.read())
            out.close()
            err.close()
        return self._done[name]

    def close(self) -> None:
        """Kill every program still running, then collect them all."""
        for name, (proc, _, _) in self._started.items():
            if name not in self._done and proc.poll() is None:
                proc.kill()
        for name in self._started:
            self.result(name)


def start_for_selected_tests(request: pytest.FixtureRequest, programs: dict[str, str],
                             timeout_s: float) -> Iterator[FreshProcesses]:
    """The body of a module-scoped fixture: start the program of each test (keyed by the test's
    function name) that this run selected in the requesting module, yield them, kill what is left."""
    # The root of the collection holds the tests that will run, once every plugin (-m, -k, --lf) has chosen.
    root = request.node.listchain()[0]
    selected = {item.originalname for item in root.items if item.path == request.path}
    fresh = FreshProcesses({name: src for name, src in programs.items() if name in selected}, timeout_s)
    try:
        yield fresh
    finally:
        fresh.close()
