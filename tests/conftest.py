"""Shared fixtures. GPU tests carry the ``gpu`` marker: they run wherever CUDA is available, are
skipped where it is not, and fail instead of skipping when ``OFFLOAD_EXAMPLES_REQUIRE_GPU=1``."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# cuBLAS reads this when its first handle is made: set it before any test touches CUDA so that
# GPU runs are bit-for-bit reproducible (the bitwise gradient tests depend on it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import background  # noqa: E402

from offload_examples.instruments.models import has_transformer_engine, import_transformer_engine  # noqa: E402

# Transformer Engine must be imported before anything starts CUDA (else a system cuDNN may load).
import_transformer_engine()

if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    # On the CPU the tests, the notebooks' small runs and the docs build run side by side (background.py),
    # more processes than a small machine has cores: threads of one op that wait on each other would spin
    # while another process has the core. Small tensors lose little with one thread; the processes the
    # tests start inherit the variable. GPU runs keep torch's default for the host's share of their work.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: only the tests that will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The notebooks' tests, then the docs tests, last: the notebooks' small runs (one after another) and the
    # site's build run in the background while the others run (background.py). A test waiting for its job
    # leaves a core idle, and the small runs take nearly as long as all the other tests: met any earlier,
    # they are still running. A stable sort: the same order otherwise.
    items.sort(key=lambda item: (item.path.name == "test_docs.py", item.path.name == "test_notebooks.py"))
    if not config.option.collectonly:
        if any("build" in item.fixturenames for item in items):
            background.start_docs_build()
        background.start_small_runs([item.callspec.params["nb"] for item in items
                                     if item.originalname == "test_notebook_runs_small_on_cpu"])
    if torch.cuda.is_available() or os.environ.get("OFFLOAD_EXAMPLES_REQUIRE_GPU") == "1":
        return  # the GPU tests run (and, without CUDA, pytest_runtest_setup fails them)
    skip = pytest.mark.skip(reason="needs CUDA (set OFFLOAD_EXAMPLES_REQUIRE_GPU=1 to fail instead)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)  # pytest 7 has no wrapper=True
def pytest_runtestloop():
    """Run the tests with what collection left frozen. Each ``gc.collect()`` walks every object the collector
    tracks, and the modules imported by then (torch, transformers, matplotlib, the tests) are most of them,
    none garbage; the benchmark and the scenarios collect before every run they measure, dozens of times a
    test. Frozen, those objects are left out of each collection; what the tests create is collected as before.
    Unfrozen after the tests: ``gc.get_referrers`` does not see frozen objects, and Hypothesis, imported by its
    plugin for the summary where no test imported it, asks it who refers to each random generator it registers."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A GPU test fails, before any of its fixtures, where CUDA is missing but required: a fixture added
    to the test after collection would not be set up, and the test could pass without a GPU."""
    if ("gpu" in item.keywords and os.environ.get("OFFLOAD_EXAMPLES_REQUIRE_GPU") == "1"
            and not torch.cuda.is_available()):
        pytest.fail("OFFLOAD_EXAMPLES_REQUIRE_GPU=1 but CUDA is not available")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``OFFLOAD_EXAMPLES_TEST_LOG=FILE``, each test's outcome and seconds are appended to FILE as the
    test ends: a run stopped by a time limit (a GPU node's call) still says what each finished test took,
    where ``--durations`` prints only at the end."""
    path = os.environ.get("OFFLOAD_EXAMPLES_TEST_LOG")
    if not path or not (report.when == "call" or report.outcome != "passed" or report.duration >= 1):
        return
    with open(path, "a") as log:  # setup and teardown lines when they fail, skip or take a second or more
        log.write(f"{report.outcome:8s}{report.duration:9.2f}s  {report.when:8s} {report.nodeid}\n")


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_te(request):
    """Transformer Engine compiles some of its fused functions (the bias-GeLU gradient of its MLP
    among them) with torch.compile. Dynamo remembers the shapes it has seen in the process and
    recompiles a function it has seen at other shapes as a dynamic-shape kernel, whose reduction may
    add in another order: a test comparing bits would then depend on the tests before it. Each test
    that uses TE starts from a fresh Dynamo, as a process of its own would."""
    if "te" in request.fixturenames:
        torch.compiler.reset()
    yield


@pytest.fixture(scope="package")
def te():
    """``transformer_engine.pytorch``. Without Transformer Engine a test using it is skipped, unless
    ``OFFLOAD_EXAMPLES_REQUIRE_TE=1`` (set it on a node where TE belongs to the stack): then it fails."""
    if not has_transformer_engine():
        if os.environ.get("OFFLOAD_EXAMPLES_REQUIRE_TE") == "1":
            pytest.fail("OFFLOAD_EXAMPLES_REQUIRE_TE=1 but transformer_engine is not installed")
        pytest.skip("Transformer Engine is not installed")
    import_transformer_engine()
    import transformer_engine.pytorch as te

    return te


#: Runs that several test files check, each made once in a test run: name -> what it gave.
_ONCE: dict[str, Any] = {}


def _tiny_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from offload_examples.instruments import bench

    config = bench.BenchConfig.tiny(models=("A", "B"), ks=(1, 2))
    results = bench.run(config, "cpu", stream=io.StringIO())
    out = tmp_path_factory.mktemp("tiny_bench")
    return config, results, out, bench.write_outputs(results, out)


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """The tiny benchmark on the CPU, every strategy on models A and B at k = 1 and 2, and its outputs:
    ``(config, results, folder, paths written)``. test_bench checks its rows and outputs, test_plan_bench the
    planner's: a plan's rivals are the engine and checkpoint rows whatever else ran, so one run serves both."""
    if "tiny bench" not in _ONCE:
        _ONCE["tiny bench"] = _tiny_bench(tmp_path_factory)
    return _ONCE["tiny bench"]


#: Options that keep a command's run short where its own tests run it whole (tests/test_long_context.py).
SHORTER = {"long-context": ["--strategies", "checkpoint", "checkpoint + offload"]}


def _scenario_run(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp(name) / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "offload_examples", name, "--small", "--device", "cpu", "--json", str(out),
         *SHORTER.get(name, [])],
        capture_output=True, text=True, timeout=300,
    )
    return proc, out


@pytest.fixture(scope="module")
def scenario_cli(tmp_path_factory):
    """``scenario_cli(name)``: the scenario ``name`` run from the command line, small, on the CPU, its JSON
    report written into a folder of its own; the finished process and the report's path. Each scenario runs
    once in a test run: test_scenarios checks every run, test_fsdp and test_pipeline the fsdp and pipeline-dist
    ones further (their ranks each start a fresh torch, most of such a run's time)."""

    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        if name not in _ONCE:
            _ONCE[name] = _scenario_run(name, tmp_path_factory)
        return _ONCE[name]

    return run
