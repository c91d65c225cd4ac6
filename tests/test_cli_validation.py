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
import math
import os
import re
import string

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_examples.instruments import bench
from offload_examples.__main__ import main as dispatch
from offload_examples.instruments.cli import DTYPES, KINDS, MAX_SEED
from offload_examples.instruments.models import has_transformer_engine
from offload_examples.instruments.report import CPU_TIMING_NOTE
from offload_examples.scenarios import SCENARIOS

COMMANDS = {**{name: importlib.import_module(module).main for name, module in SCENARIOS.items()}, "bench": bench.main}
PREFIX = {**{name: f"offload_examples {name}: error: " for name in SCENARIOS}, "bench": "offload_examples bench: error: "}
PROFILE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLAGS = {"--small", "--tiny", "--no-plots", "--no-retain-pinned", "--reshard-after-forward", "--cpu-params"}
POSITIVE = {"layers", "offload", "hidden", "heads", "ffn", "seq", "batch", "steps", "replays", "checks", "width", "ks", "world"}
MAY_BE_ZERO = {"warmup", "seed", "checkpoint"}
CHOICES = {"dtype": DTYPES, "kind": KINDS, "backend": ("auto", "nccl", "gloo"), "models": tuple(bench.MODELS),
           "strategies": bench.STRATEGIES, "wrap": ("fsdp", "ddp")}
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
    if name == "json":
        return value(BAD_JSON)
    if name == "out":
        return value(BAD_OUT)
    if name == "fractions":
        return value(st.one_of(st.floats().filter(lambda f: not 0 <= f <= 1).map(str),
                               st.text(max_size=10).filter(lambda s: not _good_fractions(s))))
    if name == "plan":  # a fraction in (0, 1], or one letter of K, O, R per layer
        return value(st.one_of(st.floats().filter(lambda f: not 0 < f <= 1).map(str),
                               st.text(max_size=14).filter(lambda s: not _maybe_plan(s))))
    raise AssertionError(f"{command}: no bad values for {option}; add them to this test")


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
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (context, out, err)
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
