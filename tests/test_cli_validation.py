"""Every command-line value is checked before any work starts.

Random bad values go to every scenario's command line and the benchmark's, in-process: each must
end the command with exit code 2 and exactly one line on standard error (no usage block, no
traceback), print nothing on standard output, and write nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import math
import os
import re
import string
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from offload_examples.instruments import bench, cli
from offload_examples.__main__ import main as dispatch
from offload_examples.instruments.cli import DTYPES, KINDS, MAX_SEED
from offload_examples.instruments.models import has_transformer_engine
from offload_examples.instruments.report import CPU_TIMING_NOTE
from offload_examples.scenarios import SCENARIOS

COMMANDS = {**{name: importlib.import_module(module).main for name, module in SCENARIOS.items()}, "bench": bench.main}
PREFIX = {**{name: f"offload_examples {name}: error: " for name in SCENARIOS}, "bench": "offload_examples bench: error: "}
PROFILE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLAGS = {"--small", "--tiny", "--no-plots", "--no-retain-pinned", "--reshard-after-forward", "--cpu-params",
         "--no-speeds"}
POSITIVE = {"layers", "offload", "hidden", "heads", "ffn", "seq", "batch", "steps", "replays", "checks", "width", "ks", "world",
            "kv_heads", "vocab", "lora_rank", "loss_chunk", "resolution", "max_seq"}
MAY_BE_ZERO = {"warmup", "seed", "checkpoint"}
CHOICES = {"dtype": DTYPES, "kind": KINDS, "backend": ("auto", "nccl", "gloo"), "models": tuple(bench.MODELS),
           "strategies": bench.STRATEGIES, "wrap": ("fsdp", "ddp"), "skip": ("", "graphed")}
CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        COMMANDS[command](["--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def _option_blocks(command: str) -> dict[str, str]:
    """Each option of ``command`` (its long name) and its help text, from ``--help``."""
    blocks: dict[str, str] = {}
    current = None
    for line in _help(command).split("\noptions:\n", 1)[1].splitlines():
        m = re.match(r"  (?:-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current:
            blocks[current] += " " + line.strip()
    return blocks


OPTIONS = {command: sorted(set(_option_blocks(command)) - {"--help"}) for command in COMMANDS}


# ----------------------------------------------------------------------------- bad values
def _is_int_at_least(text: str, minimum: int) -> bool:
    try:
        return int(text) >= minimum
    except ValueError:
        return False


def _bad_int(minimum: int, maximum: int | None = None) -> st.SearchStrategy[str]:
    bad = [st.integers(max_value=minimum - 1).map(str),
           st.text(max_size=8).filter(lambda s: not _is_int_at_least(s, minimum)),
           st.floats().map(str).filter(lambda s: not _is_int_at_least(s, minimum))]
    if maximum is not None:
        bad.append(st.integers(min_value=maximum + 1).map(str))
    return st.one_of(*bad)


def _good_fractions(text: str) -> bool:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        return False
    return all(math.isfinite(v) and 0 <= v <= 1 for v in values)


def _bad_device(command: str) -> st.SearchStrategy[str]:
    unusable = ["cuda", "cuda:0"] if (GPUS < 2 if command == "pipeline-dist" else not CUDA) else []
    if command != "pipeline-dist" and CUDA:
        unusable.append(f"cuda:{GPUS}")
    samples = ["gpu", "mps", "meta", "xla", "cuda:x", "cpu:", "CUDA", " cpu", "", *unusable]
    random = st.text(max_size=10).filter(lambda s: not s.startswith(("cpu", "cuda")))
    return st.one_of(st.sampled_from(samples), random)


def _bad_choice(name: str) -> st.SearchStrategy[str]:
    choices = CHOICES[name]
    unusable = []
    if name == "kind" and not (has_transformer_engine() and CUDA):
        unusable.append("te")  # Transformer Engine missing, or no GPU for its layers
    if name == "backend" and GPUS < 2:
        unusable.append("nccl")
    return st.one_of(st.text(max_size=10).filter(lambda s: s not in choices), *map(st.just, unusable))


# Paths relative to the test's working folder (tmp_path), which holds one file, "afile".
_names = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=8)
BAD_JSON = st.one_of(st.sampled_from(["", ".", "afile/r.json", "a\0b.json", "missing/r.json"]),
                     _names.map(lambda n: f"no-{n}/report.json"), _names.map(lambda n: f"no-{n}/deeper/r.json"))
BAD_READ = st.one_of(st.sampled_from(["", ".", "afile", "missing.json", "a\0b.json", "afile/r.json"]),
                     _names.map(lambda n: f"no-{n}.json"))  # "afile" exists, empty: not JSON
BAD_OUT = st.one_of(st.sampled_from(["", "afile", "afile/sub", "a\0b"]), _names.map(lambda n: f"afile/{n}"))


def _bad_option(command: str, option: str) -> st.SearchStrategy[list[str]]:
    """``argv`` pieces that give ``option`` of ``command`` a bad value."""
    name = option[2:].replace("-", "_")

    def value(values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
        return values.map(lambda v: [f"{option}={v}"])

    if option in FLAGS:
        return value(st.text(max_size=5))  # a flag takes no value
    if name in POSITIVE:
        return value(_bad_int(1))
    if name in MAY_BE_ZERO:
        return value(_bad_int(0, MAX_SEED if name == "seed" else None))
    if name in CHOICES:
        return value(_bad_choice(name))
    if name == "device":
        return value(_bad_device(command))
    if name in ("json", "plot", "progress_json"):
        return value(BAD_JSON)
    if name == "resume":  # a report to read
        return value(BAD_READ)
    if name in ("memory_limit", "host_budget"):  # a positive number of bytes, with or without a unit
        return value(st.one_of(st.sampled_from(["0", "-1", "0.5", "GiB", "", "12XB", "nan", "inf", "1 GB B"]),
                               st.text(max_size=8).filter(lambda s: not _is_bytes(s))))
    if name == "out":
        return value(BAD_OUT)
    if name == "fractions":
        return value(st.one_of(st.floats().filter(lambda f: not 0 <= f <= 1).map(str),
                               st.text(max_size=10).filter(lambda s: not _good_fractions(s))))
    if name == "plan":  # a fraction in (0, 1], or one letter of K, O, R per layer
        return value(st.one_of(st.floats().filter(lambda f: not 0 < f <= 1).map(str),
                               st.text(max_size=14).filter(lambda s: not _maybe_plan(s))))
    raise AssertionError(f"{command}: no bad values for {option}; add them to this test")


def _is_bytes(text: str) -> bool:
    try:
        cli.bytes_arg(text)
    except Exception:
        return False
    return True


def _maybe_plan(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return bool(text) and set(text.upper()) <= set("KOR")  # letters only: their count decides


def _bad_combination(command: str) -> list[st.SearchStrategy[list[str]]]:
    """Values fine alone but not together."""
    options = set(OPTIONS[command])
    combos = [_names.map(lambda n: [f"--zz-{n}"])]  # an unknown option
    if {"--layers", "--offload"} <= options:
        combos.append(st.integers(1, 8).flatmap(lambda layers: st.integers(layers, layers + 8).map(
            lambda k: [f"--layers={layers}", f"--offload={k}"])))
    if {"--hidden", "--heads"} <= options:
        combos.append(st.tuples(st.integers(1, 512), st.integers(1, 64)).filter(lambda t: t[0] % t[1]).map(
            lambda t: [f"--hidden={t[0]}", f"--heads={t[1]}"]))
    if command == "bench":
        combos.append(st.integers(1, 8).flatmap(lambda layers: st.integers(layers, layers + 8).map(
            lambda k: [f"--layers={layers}", "--ks", str(k)])))
    if command == "fsdp":
        combos.append(st.sampled_from([["--wrap=ddp", "--no-reshard-after-forward"], ["--wrap=ddp", "--cpu-params"],
                                       ["--device=cpu", "--cpu-params"]]))
        combos.append(st.integers(2, 8).flatmap(lambda layers: st.integers(layers + 1, layers + 8).map(
            lambda c: [f"--layers={layers}", "--offload=1", f"--checkpoint={c}"])))
    if command == "pipeline-dist":
        combos.append(st.just(["--backend=gloo", "--device=cuda"]))
        combos.append(st.just(["--backend=nccl", "--device=cpu"]))
    return combos


def _bad_argv(command: str) -> st.SearchStrategy[list[str]]:
    good = ["--json=ok.json"] + (["--tiny", "--no-plots"] if command == "bench" else ["--small"])
    bad = st.one_of(*(_bad_option(command, o) for o in OPTIONS[command]), *_bad_combination(command))
    return st.tuples(st.lists(st.sampled_from(good), max_size=2, unique=True), bad).map(lambda t: t[0] + t[1])


def _listing(folder) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def _assert_one_line_error(exit_, capsys, prefix: str, context) -> str:
    """``exit_``: ``pytest.raises``'s answer or the ``SystemExit`` itself."""
    out, err = capsys.readouterr()
    assert getattr(exit_, "value", exit_).code == 2, (context, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), (context, err)
    assert lines[0].startswith(prefix), (context, err)
    assert "Traceback" not in err and out == "", (context, out, err)
    return lines[0]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("command", sorted(COMMANDS))
@PROFILE
@given(data=st.data())
def test_bad_values_are_one_line_errors_before_any_work(command, data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    before = _listing(tmp_path)
    argv = data.draw(_bad_argv(command), label="argv")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        COMMANDS[command](argv)
    _assert_one_line_error(exit_, capsys, PREFIX[command], argv)
    assert _listing(tmp_path) == before, argv  # nothing written, no folder created


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_every_default(command):
    blocks = _option_blocks(command)
    assert set(OPTIONS[command]) <= set(blocks)
    for option in OPTIONS[command]:
        assert "default" in blocks[option], (command, option, blocks[option])


def test_specific_errors_say_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cases = [
        ("basic", ["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
        ("weight-streaming", ["--width=-1"], "argument --width: must be a positive integer, got -1"),
        ("basic", ["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
        ("basic", ["--json", "missing/basic.json"], "argument --json: folder missing does not exist"),
        ("basic", ["--layers", "4", "--offload", "4"], "offload must be between 1 and layers - 1 = 3, got 4"),
    ]
    if not CUDA:
        cases.append(("basic", ["--device", "cuda"], "CUDA is not available"))
    if not has_transformer_engine():
        cases.append(("cuda-graphs", ["--kind", "te"], "pip install 'offload_examples[te]'"))
    for command, argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            COMMANDS[command](argv)
        assert says in _assert_one_line_error(exit_, capsys, PREFIX[command], argv)
    assert not (tmp_path / "missing").exists()


def test_json_into_a_read_only_folder_is_an_error(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    real = os.access  # root may write anywhere: say the folder is read-only rather than chmod it
    monkeypatch.setattr(os, "access", lambda path, mode: real(path, mode) and os.fspath(path) != os.fspath(folder))
    with pytest.raises(SystemExit) as exit_:
        COMMANDS["basic"](["--json", str(folder / "r.json")])
    assert "is not writable" in _assert_one_line_error(exit_, capsys, PREFIX["basic"], "read-only")
    assert not any(folder.iterdir())


def test_bench_without_matplotlib_stops_before_any_work(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--out", str(tmp_path / "bench")])
    line = _assert_one_line_error(exit_, capsys, PREFIX["bench"], "no matplotlib")
    assert line == PREFIX["bench"] + bench.PLOTS_MISSING
    assert not (tmp_path / "bench").exists()


def test_unknown_scenario_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        dispatch(["nope\nx"])
    assert "unknown scenario 'nope\\nx'" in _assert_one_line_error(exit_, capsys, "offload_examples: error: ", "nope")


def test_cpu_report_says_its_times_measure_nothing():
    from offload_examples.scenarios.basic import format_report

    report = {"device_type": "cpu", "device": "x86_64", "torch": torch.__version__, "saving_ratio": None,
              "config": {"layers": 6, "hidden": 64, "seq": 32, "batch": 4, "dtype": "float32", "offload": 2},
              "peak_without_bytes": None, "peak_with_bytes": None, "saving_bytes": None,
              "theoretical_saving_bytes": 1, "offloaded_bytes": 1, "step_ms_without": 1.0, "step_ms_with": 2.0,
              "overhead": 1.0, "grads_equal": True, "grads_compared": 1, "max_abs_diff": 0.0,
              "resident_matches_theory": True}
    assert format_report(report).endswith(CPU_TIMING_NOTE)
    assert CPU_TIMING_NOTE not in format_report({**report, "device_type": "cuda"})


# ----------------------------------------------------------------------------- a newcomer's walk
# What a new user tried on a fresh CPU machine: sizes too large for it, paths that only look writable,
# options that contradict each other. Each must end in one line and exit code 2 before any work.
GiB = 2**30
RUNS = {**{name: (importlib.import_module(module), "run") for name, module in SCENARIOS.items()},
        "bench": (bench.cli, "run")}


class Ran(Exception):
    """Raised in place of a command's run: every check before it passed."""


@pytest.fixture
def machine(monkeypatch):
    """This machine, as a 24 GiB CPU machine (with an 80 GB GPU where CUDA is present)."""
    monkeypatch.setattr(cli, "host_available_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(cli, "gpu_free_bytes", lambda device, here=True: 80 * 10**9)
    monkeypatch.delenv(cli.SKIP_ENV, raising=False)


@pytest.fixture
def no_run(monkeypatch):
    """Every command's run replaced by one raising :class:`Ran` with the config it was given."""
    def ran(config, *args, **kwargs):
        raise Ran(config)

    for module, name in RUNS.values():
        monkeypatch.setattr(module, name, ran)


TOO_LARGE = [
    ("basic", ["--batch", "10000000", "--hidden", "100000"]),
    ("cuda-graphs", ["--batch", "10000000", "--hidden", "100000"]),
    ("weight-streaming", ["--batch", "10000000", "--width", "100000"]),
    ("optimizer-offload", ["--batch", "10000000", "--width", "100000"]),
    ("fsdp", ["--batch", "10000000", "--hidden", "100000"]),
    ("bench", ["--layers", "100000", "--no-plots"]),
]


@pytest.mark.parametrize("command, argv", TOO_LARGE, ids=[c for c, _ in TOO_LARGE])
def test_sizes_that_cannot_fit_stop_before_anything_is_allocated(command, argv, machine, no_run, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        COMMANDS[command]([*argv, "--device", "cpu"])
    line = _assert_one_line_error(exit_, capsys, PREFIX[command], argv)
    assert re.search(r"the sizes need about [\d.]+ GiB of host memory.*; 24\.0 GiB is available", line), line
    assert "lower --" in line and "--layers" in line and cli.SKIP_ENV in line  # what to change, and how to run anyway
    assert not any(tmp_path.iterdir())


def test_sizes_that_do_not_fit_the_gpu_name_its_free_memory(machine, no_run, monkeypatch, capsys):
    monkeypatch.setattr(cli, "gpu_free_bytes", lambda device, here=True: 10 * GiB)
    line = cli.memory_error(cli.Need(20 * GiB, GiB), [torch.device("cuda", 0)])
    assert line.startswith("the sizes need about 20.0 GiB of GPU memory") and line.endswith("cuda:0 has 10.0 GiB free")
    assert cli.memory_error(cli.Need(8 * GiB, GiB), [torch.device("cuda", 0)]) is None
    monkeypatch.setenv(cli.SKIP_ENV, "1")
    assert cli.memory_error(cli.Need(20 * GiB, GiB), [torch.device("cuda", 0)]) is None


def _configs():
    for name, module in SCENARIOS.items():
        mod = importlib.import_module(module)
        yield name, next(v for k, v in vars(mod).items() if k.endswith("Config") and k != "ScenarioConfig"
                         and isinstance(v, type))


@pytest.mark.parametrize("name, config_cls", list(_configs()), ids=list(SCENARIOS))
def test_default_sizes_fit_a_24_gib_cpu_machine_and_an_80_gb_gpu(name, config_cls, monkeypatch):
    monkeypatch.setattr(cli, "gpu_free_bytes", lambda device, here=True: 80 * 10**9)
    monkeypatch.delenv(cli.SKIP_ENV, raising=False)
    monkeypatch.setattr(cli, "host_available_bytes", lambda: 24 * GiB)
    assert cli.memory_error(config_cls.small().memory_need("cpu")) is None
    monkeypatch.setattr(cli, "host_available_bytes", lambda: 100 * GiB)  # a GPU node's host
    assert cli.memory_error(config_cls().memory_need("cuda"), [torch.device("cuda", 0)]) is None


def test_the_bench_default_grids_fit(monkeypatch):
    monkeypatch.setattr(cli, "gpu_free_bytes", lambda device, here=True: 80 * 10**9)
    monkeypatch.setattr(cli, "host_available_bytes", lambda: 24 * GiB)
    monkeypatch.delenv(cli.SKIP_ENV, raising=False)
    assert cli.memory_error(bench.memory_need(bench.BenchConfig.tiny(), "cpu")) is None
    monkeypatch.setattr(cli, "host_available_bytes", lambda: 100 * GiB)
    assert cli.memory_error(bench.memory_need(bench.BenchConfig(), "cuda"), [torch.device("cuda", 0)]) is None


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_with_its_defaults_passes_its_checks(command, machine, no_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Ran):
        COMMANDS[command](["--device", "cpu"] + (["--no-plots"] if command == "bench" else []))
    assert not any(tmp_path.iterdir())  # the output claimed for the run was given back when it failed


def test_the_estimates_follow_what_a_cpu_step_holds():
    """The transformer layer's per-token count against the bytes autograd saves (hooks, no allocation
    beyond one small step): within 2 % with and without the deterministic kernels' math attention."""
    from offload_examples.instruments.measure import deterministic_kernels
    from offload_examples.instruments.models import build_basic_model

    layer = build_basic_model(1, 64, 4, 256, kind="torch")[0]
    x = torch.randn(2, 48, 64, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    for math_attention in (False, True):
        storages: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with deterministic_kernels() if math_attention else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                layer(x)
        stack = cli.Stack.transformer(1, 64, 4, 256, 2, 48, "float32", "cpu" if math_attention else "cuda")
        assert abs(stack.saved_bytes() / sum(storages.values()) - 1) < 0.02, (math_attention, storages)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, which refuses new files even to root")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_paths_that_only_look_writable_are_refused_before_the_run(command, machine, no_run, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    option = ["--out", "/proc/offload-examples-x", "--no-plots"] if command == "bench" else ["--json", "/proc/x.json"]
    with pytest.raises(SystemExit) as exit_:
        COMMANDS[command](["--device", "cpu", *option])
    line = _assert_one_line_error(exit_, capsys, PREFIX[command], option)
    # as root the permission bits allow it and creating a file is refused; as anyone else the bits say no
    assert line.startswith(f"{PREFIX[command]}argument {option[0]}: ") and "/proc" in line, line
    assert not os.path.exists("/proc/x.json") and not any(tmp_path.iterdir())


def test_a_folder_that_refuses_new_files_is_refused_before_the_run(machine, no_run, tmp_path, monkeypatch, capsys):
    """A read-only mount, say: the permission bits allow writing, creating a file does not."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(SystemExit) as exit_:
        COMMANDS["basic"](["--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert "cannot write" in _assert_one_line_error(exit_, capsys, PREFIX["basic"], "read-only mount")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--no-plots", "--out", str(tmp_path / "new" / "deeper")])
    assert "Permission denied" in _assert_one_line_error(exit_, capsys, PREFIX["bench"], "read-only mount")
    assert not any(tmp_path.iterdir())  # the folders made for the check are gone again


def test_the_json_is_written_before_the_report_is_printed(machine, tmp_path, monkeypatch, capsys):
    from offload_examples.scenarios import basic

    report = {"grads_equal": True, "saving_bytes": 1, "events": ["left out"]}
    monkeypatch.setattr(basic, "run", lambda *args, **kwargs: report)
    monkeypatch.setattr(basic, "format_report", lambda report: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        basic.main(["--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == {"grads_equal": True, "saving_bytes": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it


def test_the_bench_writes_each_model_as_it_is_measured(machine, tmp_path, monkeypatch, capsys):
    done = []

    def model(args, bar, units, isolate):
        if done:
            raise RuntimeError("the machine went away")
        done.append(args[0])
        return {"model": args[0], "runs": []}

    monkeypatch.setattr(bench.runner, "_model", model)
    out = tmp_path / "bench"
    with pytest.raises(RuntimeError):
        bench.main(["--device", "cpu", "--tiny", "--no-plots", "--models", "A", "B", "--strategies", "no offload",
                    "engine", "--out", str(out)])
    data = json.loads((out / "bench.json").read_text())
    assert data["partial"] is True and [m["model"] for m in data["models"]] == ["A"]
    assert [p.name for p in out.iterdir()] == ["bench.json"]


def test_counts_in_errors_are_the_ones_typed(machine, no_run, tmp_path, monkeypatch, capsys):
    """An error names the values typed and the real constraint, and says which values it names are defaults
    (``basic --layers 1`` once said "= 0, got 2", naming the small size's --offload, never typed)."""
    monkeypatch.chdir(tmp_path)
    cases = [
        ("basic", ["--layers", "1"], "layers must be at least 2 (offload is between 1 and layers - 1), got 1"),
        ("basic", ["--offload", "7"],
         "offload must be between 1 and layers - 1 = 5, got 7 (--layers 6 is the default here, not a value you gave)"),
        ("basic", ["--layers", "3", "--offload", "3"], "offload must be between 1 and layers - 1 = 2, got 3"),
        ("fsdp", ["--checkpoint", "9"],
         "checkpoint (9) must be at most layers (4) (--layers 4 is the default here, not a value you gave)"),
        ("bench", ["--layers", "2", "--tiny", "--no-plots"],
         "every k must be between 1 and layers - 1 = 1, got [2] (--ks 1 2 is the default here, not a value you gave)"),
    ]
    for command, argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            COMMANDS[command](["--device", "cpu", *argv])
        assert _assert_one_line_error(exit_, capsys, PREFIX[command], argv) == PREFIX[command] + says


CONFLICTS = [
    ("fsdp", ["--plan", "0.5", "--offload", "2"], "--plan chooses which layers to offload itself: leave out --offload"),
    ("fsdp", ["--wrap", "ddp", "--reshard-after-forward"], "--reshard-after-forward is an FSDP option"),
    ("fsdp", ["--wrap", "ddp", "--no-reshard-after-forward"], "--no-reshard-after-forward is an FSDP option"),
    ("fsdp", ["--plan", "0.5", "--checkpoint", "1"], "--plan chooses the recomputed layers itself"),
    ("fsdp", ["--wrap", "ddp", "--cpu-params"], "--cpu-params is FSDP's CPUOffloadPolicy"),
    ("pipeline-dist", ["--backend", "nccl"], "needs one GPU per stage") if GPUS < 2 else None,
    ("bench", ["--strategies", "no offload", "--ks", "1", "--no-plots"], "--ks: 'no offload' treats no layers"),
    ("bench", ["--strategies", "torchtune", "--no-plots"], "--strategies torchtune: torchtune is not installed")
    if importlib.util.find_spec("torchtune") is None else None,
]


@pytest.mark.parametrize("command, argv, says", [c for c in CONFLICTS if c], ids=lambda v: v if isinstance(v, str) else "")
def test_options_that_contradict_each_other_are_refused(command, argv, says, machine, no_run, tmp_path, monkeypatch,
                                                        capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        COMMANDS[command](argv)
    assert says in _assert_one_line_error(exit_, capsys, PREFIX[command], argv)


# ----------------------------------------------------------------------------- any combination
_HUGE = st.sampled_from(["100000", str(2**40), str(10**400)])
_COUNT = st.one_of(st.integers(-1, 9).map(str), st.integers(10, 5000).map(str), _HUGE)
_VALUES = {
    "device": st.sampled_from(["cpu", "cuda", "cuda:1"]),
    "json": st.sampled_from(["ok.json", "sub/r.json", "/proc/x.json", "afile"]),
    "out": st.sampled_from(["out", "out/deeper", "/proc/offload-examples-x", "afile"]),
    "fractions": st.sampled_from(["0,0.5,1", "1", "0.25", "2", "x"]),
    "plan": st.sampled_from(["0.5", "1", "0", "OORK", "KO", "r", "nan"]),
}


def _any_option(option: str) -> st.SearchStrategy[list[str]]:
    """``option`` with a value that may or may not be fine, alone or with others."""
    name = option[2:].replace("-", "_")
    if option in FLAGS or option == "--no-reshard-after-forward":
        return st.just([option])
    if name in ("models", "strategies", "ks"):
        items = _COUNT if name == "ks" else st.sampled_from(CHOICES[name])
        return st.lists(items, min_size=1, max_size=3).map(lambda v: [option, *v])
    if name in CHOICES:
        return st.sampled_from([*CHOICES[name], "bogus"]).map(lambda v: [option, v])
    values = _VALUES.get(name, _COUNT)
    return values.map(lambda v: [option, v])


@pytest.mark.parametrize("command", sorted(COMMANDS))
@PROFILE
@given(data=st.data())
def test_any_combination_runs_or_is_one_line(command, data, machine, no_run, tmp_path, monkeypatch, capsys):
    """Options drawn together, each with a plausible or a wrong value, sizes up to absurd: the command
    either gets to its run or ends in one line with exit code 2; no traceback, nothing left behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    before = _listing(tmp_path)
    options = data.draw(st.lists(st.sampled_from(OPTIONS[command]), max_size=5, unique=True), label="options")
    argv = [piece for o in options for piece in data.draw(_any_option(o), label=o)]
    capsys.readouterr()
    try:
        COMMANDS[command](argv)
    except Ran:
        event("ran")
        out, err = capsys.readouterr()
        assert err == "", (argv, err)
    except SystemExit as exit_:
        event("stopped")
        _assert_one_line_error(exit_, capsys, PREFIX[command], argv)
    else:
        raise AssertionError(f"{argv}: neither ran nor stopped")
    assert _listing(tmp_path) == before, argv
