"""Every measured number the documentation quotes comes from data stored in the repository.

- The pages (``docs/*.md``) write a stored value with the ``{stored}`` role,
  ``{stored}`bench:models[A].runs[engine,k=2].overhead|+pct```: the value is read from the JSON
  or the notebook's outputs when the site is built (``docs/_ext/offload_docs.py``), and a value
  that is not there fails the build. Here every such reference must resolve.
- A number the prose writes by itself (arithmetic on stored values, a rounded range, a claim such
  as "on every model", a default of the code) is listed in :data:`QUOTED` with where it comes
  from, and is recomputed from the data: the test fails when the prose or the data changes
  without the other.
- Any other number with a unit (GiB, ms, %, GB/s, ...) in a page fails the test: it has no source.
- Notebook Markdown is converted by pandoc (nbsphinx), where Sphinx roles do not exist. A number
  with a unit there must be one the notebook's stored outputs print (rounded as the prose writes
  it), or be listed in :data:`QUOTED`.

CPU only, no Sphinx build except one small project that checks the role itself.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import offload_docs  # noqa: E402

#: Pages whose numbers are not checked yet, and why. Keep this empty.
NOT_CHECKED: dict[str, str] = {}


def _stored_sources() -> dict[str, str]:
    """conf.py's ``stored_sources``, read without running conf.py."""
    for node in ast.parse((ROOT / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "stored_sources" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("conf.py defines no stored_sources")


def _pages() -> list[str]:
    skipped = ("snippets", "evidence")
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
                  if not any(part.startswith("_") or part in skipped for part in p.relative_to(ROOT / "docs").parts))


NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb"))


# ----------------------------------------------------------------------------------- the data
class Data:
    """The stored results, loaded once. Tests of this test put altered copies into ``cache``."""

    def __init__(self) -> None:
        self.cache: dict[str, object] = {}

    def load(self, rel: str):
        if rel not in self.cache:
            self.cache[rel] = offload_docs.load_stored(ROOT / rel)
        return self.cache[rel]

    @property
    def bench(self) -> dict:
        return self.load(BENCH)

    def model(self, name: str) -> dict:
        return next(m for m in self.bench["models"] if m["model"] == name)

    def run(self, model: str, strategy: str, k: int) -> dict:
        return next(r for r in self.model(model)["runs"] if r["strategy"] == strategy and r["k"] == k)

    def runs(self, strategy: str) -> list[dict]:
        return [r for m in self.bench["models"] for r in m["runs"] if r["strategy"] == strategy and r["status"] == "ok"]

    def printed(self, rel: str, label: str, nth: int = 1) -> float:
        """A number a notebook (or a text file) printed after ``label``, as a float."""
        return float(re.match(offload_docs._NUMBER, offload_docs.quote(self.load(rel), label, nth)).group(0))

    # Derived quantities more than one page uses.
    def copy_ms(self, model: str = "A") -> float:
        """One layer of ``model`` (layer 1: the first has no Linear input saved) over the measured
        device-to-host bandwidth: the copy time the hardware page's example works with."""
        return self.model(model)["saved_bytes_per_layer"][1] / self.bench["link_gb_per_s"]["d2h"] / 1e6

    def forward_ms(self, model: str = "A") -> float:
        return statistics.median(self.model(model)["forward_ms"])

    def backward_ms(self, model: str = "A") -> float:
        return statistics.median(self.model(model)["backward_ms"])

    def models(self, te: bool) -> list[dict]:
        """The models made of Transformer Engine's layers (``te``), or of PyTorch's."""
        return [m for m in self.bench["models"] if (m["layer_kind"] == TE_LAYER_KIND) == te]

    def rows(self, strategies: tuple[str, ...], te: bool) -> list[dict]:
        return [r for m in self.models(te) for r in m["runs"] if r["strategy"] in strategies and r["status"] == "ok"]

    def lane_ms(self, timeline: str, lane: str) -> float:
        return sum(e["end"] - e["start"] for e in self.model("A")["timelines"][timeline] if e["lane"] == lane)


EVIDENCE = "docs/evidence"
BENCH = f"{EVIDENCE}/h200-bench/bench.json"
PLANNER_BENCH = f"{EVIDENCE}/h200-planner-bench/bench.json"
TE_HOST_TIME = f"{EVIDENCE}/h100-te-host-time"


def _f(value: float, decimals: int = 0) -> str:
    return f"{value:.{decimals}f}"


WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _claim(holds: bool, numbers: tuple[str, ...], why: str) -> tuple[str, ...]:
    """The numbers as written when the claim around them holds; otherwise what the data says."""
    return numbers if holds else (f"<not so: {why}>",)


def _bench_copy_threshold(d: Data) -> tuple[str, ...]:
    (ratio,) = set(re.findall(r"copy bound > ([\d.]+) x baseline", d.load(f"{EVIDENCE}/h200-bench/bench.md")))
    return (_f(100 * (float(ratio) - 1)),)


def _checkpoint_keeps(d: Data) -> tuple[str, ...]:
    kept = [100 * (1 - r["saving_ratio"]) for r in d.runs("checkpoint") if r["k"] >= 2]
    return _f(min(kept)), _f(max(kept))


ENGINE_ROWS = ("engine", "engine (fresh pinned)")


def _engine_saves_all_on_torch_layers(d: Data) -> tuple[str, ...]:
    ratios = {_f(100 * r["saving_ratio"], 1) for r in d.rows(ENGINE_ROWS, te=False)}
    return tuple(ratios) if len(ratios) == 1 else (f"<differs: {sorted(ratios)}>",)


def _saving_on_te_layers(d: Data) -> tuple[str, ...]:
    """Saving / theory on Transformer Engine's layers, the same at every k: the engine's, then TE's offload's."""
    out = []
    for strategies in (ENGINE_ROWS, ("transformer_engine",)):
        ratios = {_f(100 * r["saving_ratio"], 1) for r in d.rows(strategies, te=True)}
        out += list(ratios) if len(ratios) == 1 else [f"<differs: {sorted(ratios)}>"]
    return tuple(out)


def _torchtune_behind(d: Data) -> tuple[str, ...]:
    """On A-torch torchtune saves less and takes longer than the engine at every k."""
    ks = d.bench["config"]["ks"]
    behind = [k for k in ks if (r := d.run(EXAMPLE, "torchtune", k))["status"] == "ok"
              and r["saving_bytes"] < d.run(EXAMPLE, "engine", k)["saving_bytes"]
              and r["overhead"] > d.run(EXAMPLE, "engine", k)["overhead"]]
    return _claim(behind == ks, (WORDS[len(ks)],), f"behind only at k = {behind}")


def _pinned_buffers_alike(d: Data) -> tuple[str, ...]:
    """Reusing pinned buffers or dropping them after every step: overheads within one percentage point
    of each other on every model of PyTorch's layers at every k."""
    gaps = {(m["model"], r["k"]): abs(r["overhead"] - d.run(m["model"], "engine (fresh pinned)", r["k"])["overhead"])
            for m in d.models(te=False) for r in m["runs"] if r["strategy"] == "engine" and r["status"] == "ok"}
    return _claim(bool(gaps) and max(gaps.values()) < 0.01, ("one",), f"gaps: {gaps}")


def _graphed_above_bound(d: Data) -> tuple[str, ...]:
    """Per-layer graphs with the engine: above the larger of the graphs without it and the copy bound,
    on every model at every k of the graphed column."""
    ks = d.bench["config"]["ks"]
    above = {(m["model"], g["k"]): g["over_reference"] > 0 for m in d.bench["models"] for g in m.get("graphed", [])
             if g["status"] == "ok"}
    holds = len(above) == len(ks) * len(d.bench["models"]) and all(above.values())
    return _claim(holds, (WORDS[len(ks)],), f"above the bound: {above}")


def _graphed_bound_margin(d: Data) -> tuple[str, ...]:
    """Model A, k = 2: how far the copy bound of the per-layer graphs lies below their step without
    offloading, in %; the claim that it lies below."""
    g = next(g for g in d.model("A")["graphed"] if g["k"] == 2)
    below = 1 - g["bound_ms"] / g["per_layer_ms"]
    return _claim(below > 0, (_f(100 * below, 1),), f"the bound is {100 * -below:+.1f} % against that step")


def _checkpoint_cheaper_on_a(d: Data) -> tuple[str, ...]:
    """On model A recomputation's overhead is below the engine's at every k."""
    ks = d.bench["config"]["ks"]
    cheaper = [k for k in ks if d.run("A", "checkpoint", k)["overhead"] < d.run("A", "engine", k)["overhead"]]
    return _claim(cheaper == ks, (WORDS[len(ks)],), f"cheaper only at k = {cheaper}")


def _within_bound(d: Data, te: bool) -> tuple[str, ...]:
    """The largest step / bound of any engine row on those layers, as a percentage rounded up."""
    return (_f(math.ceil(100 * (max(r["step_over_bound"] for r in d.rows(ENGINE_ROWS, te)) - 1))),)


def _te_fits_up_to(d: Data) -> tuple[str, ...]:
    """Model A (TE layers): the last k at which the inequality holds, the forward compute and the
    copies there; the claim that the schedule's bound puts the line at the next k."""
    n, fwd, copy = d.bench["config"]["layers"], d.forward_ms("A"), d.copy_ms("A")
    k = max(k for k in range(1, n) if k * copy <= (n - k) * fwd)
    stop = d.model("A")["predicted"]["copies_stop_fitting_at_k"]
    return _claim(stop == k + 1, (str(k), _f((n - k) * fwd), _f(k * copy)), f"the bound's line is at k = {stop}")


def _k_fits(d: Data, model: str) -> float:
    """The most layers whose copies hide behind the others' forward: ``k <= N t / (t + B / W)``."""
    t = d.forward_ms(model)
    return d.bench["config"]["layers"] * t / (t + d.copy_ms(model))


def _k_worked(model: str, words: bool = True) -> Callable[[Data], tuple[str, ...]]:
    """``N``, ``t_fwd``, ``t_fwd``, ``B / W`` (ms, two decimals), ``k`` solved (one decimal), and with
    ``words`` the layers that hide, in a word."""
    def expected(d: Data) -> tuple[str, ...]:
        t, copy, k = d.forward_ms(model), d.copy_ms(model), _k_fits(d, model)
        out = (str(d.bench["config"]["layers"]), _f(t, 2), _f(t, 2), _f(copy, 2), _f(k, 1))
        return out + ((WORDS[math.floor(k)],) if words else ())
    return expected


#: How close to the step without offloading the hardware page calls a step that hides its copies.
HIDDEN_WITHIN = 0.02


def _sweep_turns(d: Data) -> tuple[str, ...]:
    """On A-torch: the engine's overhead stays within 2 % at every measured k up to the solved k rounded
    down, and exceeds it at every measured k beyond."""
    k = math.floor(_k_fits(d, EXAMPLE))
    over = {j: d.run(EXAMPLE, "engine", j)["overhead"] for j in d.bench["config"]["ks"]}
    holds = any(j <= k for j in over) and any(j > k for j in over) and \
        all((o <= HIDDEN_WITHIN) == (j <= k) for j, o in over.items())
    return _claim(holds, (_f(100 * HIDDEN_WITHIN), str(k)), f"overheads: {over}")


def _bound_line_on_torch_layers(d: Data) -> tuple[str, ...]:
    """The copy bound's line on A-torch: the k after the solved k."""
    line = d.model(EXAMPLE)["predicted"]["copies_stop_fitting_at_k"]
    solved = math.floor(_k_fits(d, EXAMPLE)) + 1
    return _claim(line == solved, (str(line),), f"bound's line {line}, solved k + 1 {solved}")


def _copies_past_forward(d: Data) -> tuple[str, ...]:
    copies, forward = d.lane_ms("engine k=4", "device-to-host"), sum(d.model("A")["forward_ms"])
    return _claim(copies > forward, (_f(copies), _f(forward)), f"copies {copies} ms, forward {forward} ms")


def _bandwidth_in_every_row(d: Data) -> tuple[str, ...]:
    """The lowest and highest share of the measured bandwidth any engine row's copies reached, in %."""
    shares = [round(100 * r[key]) for r in d.runs("engine") + d.runs("engine (fresh pinned)")
              for key in ("d2h_of_link", "h2d_of_link")]
    return str(min(shares)), str(max(shares))


def _pinned_vs_pageable(d: Data) -> tuple[str, ...]:
    nb = "notebooks/01_concepts.ipynb"
    ratios = [d.printed(nb, f"{way} pinned") / d.printed(nb, f"{way} pageable") for way in ("h2d", "d2h")]
    return f"{min(ratios):.1f}", f"{max(ratios):.1f}"


def _nvlink_speedup(d: Data) -> tuple[str, ...]:
    return (WORDS[round(NVLINK_C2C_GB_S / d.bench["link_gb_per_s"]["d2h"])],)


def _nvlink_copy(d: Data) -> tuple[str, ...]:
    copy = d.copy_ms(EXAMPLE)
    return _f(copy, 1), _f(math.ceil(copy * d.bench["link_gb_per_s"]["d2h"] / NVLINK_C2C_GB_S))


def _engine_1mib_threshold(d: Data) -> tuple[str, ...]:
    """The ``min_offload_bytes`` of the ``engine_1mib`` variant, in MiB, as its evidence README gives it."""
    (mib,) = re.findall(r"`min_offload_bytes` of (\d+) MiB \(`engine_1mib`\)", d.load(f"{TE_HOST_TIME}/README.md"))
    return (mib,)


def _code_default_kib(d: Data) -> tuple[str, ...]:
    from offload_examples import get_cpu_offload_context

    return (_f(inspect.signature(get_cpu_offload_context).parameters["min_offload_bytes"].default / 1024),)


def _fsdp_bar(d: Data) -> tuple[str, ...]:
    (bar,) = re.findall(r'r\["saving_ratio"\] >= ([\d.]+)', (ROOT / "tests" / "test_fsdp.py").read_text())
    return (_f(100 * float(bar)),)


def _optimizer_theory(d: Data) -> tuple[str, ...]:
    shares = set(re.findall(r"\(([\d.]+)%\)", d.load("notebooks/06_optimizer_offload.ipynb")))
    return tuple(shares) if len(shares) == 1 else (f"<differs: {sorted(shares)}>",)


def _te_plain_range(d: Data, recipe: str) -> tuple[str, ...]:
    """Notebook 02's Transformer Engine table: the fastest and slowest step of ``recipe``'s run without offloading."""
    return re.search(rf"^{recipe} +no offload +\S+(?: B| \S?iB)? +[\d.]+ +([\d.]+)–([\d.]+)",
                     d.load("notebooks/02_basic.ipynb"), re.M).groups()


PIPELINE_2GPU = f"{EVIDENCE}/2xh200-nccl/pipeline_dist_nccl.json"


def _pipeline_2gpu_steps(d: Data) -> tuple[str, ...]:
    """The stored two-GPU pipeline run: each rank's median step without, then with offloading (ms)."""
    return tuple(_f(r[case]["step_ms"], 1)
                 for r in d.load(PIPELINE_2GPU)["ranks"] for case in ("no offload", "offload"))


def _pipeline_2gpu_costs(d: Data) -> tuple[str, ...]:
    """The stored two-GPU pipeline run, round by round: each rank's overhead (the median over the rounds of
    the step with offloading over the one without it, less one, in %), then each rank's quartiles of it."""
    ranks = d.load(PIPELINE_2GPU)["ranks"]
    return tuple(f"{100 * v:+.1f}" for v in [*(r["overhead"] for r in ranks),
                                               *(q for r in ranks for q in r["overhead_quartiles"])])


def _pipeline_notebook_run(d: Data) -> tuple[str, ...]:
    """Notebook 03's two-GPU table (its own run of the same command): each rank's median step without
    offloading (ms), then each rank's overhead (%), as printed."""
    rows = re.findall(r"^\d+ .* ([\d.]+) / [\d.]+ ms +([-+][\d.]+)% \(", d.load("notebooks/03_pipeline.ipynb"), re.M)
    return tuple(without for without, _ in rows) + tuple(overhead for _, overhead in rows)


PIPELINE_REPEATS = f"{EVIDENCE}/2xh200-nccl/pipeline_dist_repeats.json"


def _rank0_ranges(steps: list[tuple[float, float]]) -> tuple[str, ...]:
    """Fastest and slowest of rank 0's steps without offloading, then with it (ms), over runs."""
    without, with_ = zip(*steps)
    return tuple(_f(v, 1) for v in (min(without), max(without), min(with_), max(with_)))


def _pipeline_repeats(d: Data) -> list[tuple[float, float]]:
    """The four further runs of the two-GPU pipeline: rank 0's median step without and with offloading."""
    return [(run["report"]["ranks"][0]["no offload"]["step_ms"], run["report"]["ranks"][0]["offload"]["step_ms"])
            for run in d.load(PIPELINE_REPEATS)["runs"]]


def _pipeline_six_runs(d: Data) -> tuple[str, ...]:
    """Rank 0's steps over the six runs: the four repeats, the stored run and notebook 03's (its table)."""
    stored = d.load(PIPELINE_2GPU)["ranks"][0]
    notebook = re.search(r"^0 .* ([\d.]+) / ([\d.]+) ms", d.load("notebooks/03_pipeline.ipynb"), re.M).groups()
    return _rank0_ranges([*_pipeline_repeats(d), (stored["no offload"]["step_ms"], stored["offload"]["step_ms"]),
                          tuple(float(v) for v in notebook)])


GPU_TESTS = f"{EVIDENCE}/h200-gpu-tests"


def _test_code(rel: str, pattern: str) -> str:
    """The one number ``pattern`` (a regex with one group) finds in a test file: a bar the test sets."""
    (found,) = re.findall(pattern, (ROOT / rel).read_text())
    return found


def _summaries(text: str) -> list[tuple[dict[str, int], float]]:
    """pytest's summary lines (one per pass of ``tests/repeat.py``), ``4 failed, 33 passed, 1 skipped, ... in
    12.3s``, each as ({outcome: count}, seconds)."""
    lines = re.findall(r"^(?:=+ )?((?:\d+ \w+, )*\d+ \w+) in ([\d.]+)s.*$", text, re.M)
    return [({outcome: int(n) for n, outcome in re.findall(r"(\d+) (\w+)", counts)}, float(seconds))
            for counts, seconds in lines]


def _summary(text: str) -> dict[str, int]:
    """The one summary line of a log of one pytest run, as {outcome: count}."""
    ((counts, _),) = _summaries(text)
    return counts


LONG_CONTEXT = f"{EVIDENCE}/h200-long-context"


def _long_context_ratio(d: Data) -> tuple[str, ...]:
    """How many times checkpointing's longest sequence checkpoint + offload trained."""
    longest = {name: r["longest"] for name, r in d.load(f"{LONG_CONTEXT}/long_context.json")["strategies"].items()}
    return (f"{longest['checkpoint + offload'] / longest['checkpoint']:.2f}",)


def _long_context_turns(d: Data) -> tuple[str, ...]:
    """The planner's median tokens/s against checkpointing's at checkpointing's longest, from the run where
    they took turns: each strategy's probe, its step at the common length, the planner's at checkpointing's."""
    t = d.load(f"{LONG_CONTEXT}/at_checkpoint.json")
    speeds = {name: [p["tokens_per_s"] for p in r["probes"] if p["ok"]] + [t["at_common"][name]["tokens_per_s"]]
              for name, r in t["strategies"].items()}
    speeds["planner"].append(t["at_checkpoint"]["planner"]["tokens_per_s"])
    ratio = statistics.median(speeds["planner"]) / statistics.median(speeds["checkpoint"])
    return (f"{100 * (ratio - 1):+.1f}",)


LONG_CONTEXT_FULL = f"{EVIDENCE}/h200-long-context-full"


def _full_first_failure(name: str, report: str = "checkpoint_no_offload.json") -> Callable[[Data], tuple[str, ...]]:
    """The whole-GPU search of ``name`` in ``report``: the shortest length that ran out of memory above its
    longest."""
    def numbers(d: Data) -> tuple[str, ...]:
        r = d.load(f"{LONG_CONTEXT_FULL}/{report}")["strategies"][name]
        return (f"{min(p['seq'] for p in r['probes'] if not p['ok'] and p['seq'] > r['longest']):,}",)
    return numbers


def _full_planner(d: Data) -> tuple[str, ...]:
    """The planner's whole-GPU search, from its log (it stopped before writing a report): its first
    prediction, the longest length that ran, the shortest above it that ran out of memory."""
    probes = [(why, int(seq.replace(",", "")), ok == "ran") for why, seq, ok in re.findall(
        r"\[planner\]\s+(\w+)\s+(\d+) tokens: (ran|out of memory)", d.load(f"{LONG_CONTEXT_FULL}/planner.log"))]
    longest = max(seq for _, seq, ok in probes if ok)
    failed = min(seq for _, seq, ok in probes if not ok and seq > longest)
    predicted = next(seq for why, seq, _ in probes if why == "predicted")
    return f"{predicted:,}", f"{longest:,}", f"{failed:,}"


def _planner_search(d: Data) -> dict:
    """The planner's whole-GPU search up to its longest length (capped there; its report)."""
    return d.load(f"{LONG_CONTEXT_FULL}/planner_405504.json")["strategies"]["planner"]


def _planner_failed_above(d: Data) -> tuple[str, ...]:
    """The planner's and checkpoint + offload's whole-GPU steps that ran out of memory one resolution above
    the planner's longest: the planner's search capped there, and checkpoint + offload's first prediction."""
    longest, step = _planner_search(d)["longest"], d.load(f"{LONG_CONTEXT_FULL}/planner_405504.json")["config"]
    above = d.load(f"{LONG_CONTEXT_FULL}/planner_409600.json")["strategies"]["planner"]["probes"]
    co = d.load(f"{LONG_CONTEXT_FULL}/engine_checkpoint_offload.json")["strategies"]["checkpoint + offload"]
    failed = {p["seq"] for p in above if not p["ok"]} & {p["seq"] for p in co["probes"] if not p["ok"]}
    assert longest + step["resolution"] in failed, (longest, failed)
    return (f"{longest + step['resolution']:,}",)


def _planner_over_checkpoint(d: Data) -> tuple[str, ...]:
    """How many times checkpointing's longest sequence the planner trained, both on the whole GPU."""
    checkpoint = d.load(f"{LONG_CONTEXT_FULL}/checkpoint_no_offload.json")["strategies"]["checkpoint"]["longest"]
    return (f"{_planner_search(d)['longest'] / checkpoint:.2f}",)


def _planner_input_buffer(d: Data) -> tuple[str, ...]:
    """One layer's input at the planner's longest length (hidden size x 2 bytes a token), as the pinned
    allocator reserves it: the next power of two, in GiB."""
    config = d.load(f"{LONG_CONTEXT_FULL}/planner_search.json")["config"]
    size = _planner_search(d)["longest"] * config["batch"] * config["hidden"] * 2
    return (f"{2 ** math.ceil(math.log2(size)) / 2**30:.0f}",)


def _planner_model_miss(d: Data) -> tuple[str, ...]:
    """How far the cost model's predicted peak was from the measured one at the planner's longest (MiB, up)."""
    best = next(p for p in _planner_search(d)["probes"] if p["ok"] and p["seq"] == _planner_search(d)["longest"])
    return (f"{math.ceil(abs(best['peak_bytes'] - best['predicted_peak_bytes']) / 2**20)}",)


def _planner_kept_miss(d: Data) -> tuple[str, ...]:
    """The planner's whole-GPU step with kept layers near the limit: its length, measured and predicted peaks."""
    probes = d.load(f"{LONG_CONTEXT_FULL}/planner_search.json")["strategies"]["planner"]["probes"]
    p = next(p for p in probes if p["ok"] and "keep" in p["note"] and p["seq"] > 100_000)
    return f"{p['seq']:,}", f"{p['peak_bytes'] / 2**30:.2f}", f"{p['predicted_peak_bytes'] / 2**30:.2f}"


def _suite_green(d: Data, name: str) -> bool:
    """A stored repeated GPU suite (``gpu_suite_<name>.log``): three passes, none failed, all exit codes 0."""
    text = d.load(f"{GPU_TESTS}/gpu_suite_{name}.log")
    passes = _summaries(text)
    return (len(passes) == 3 and "exit codes of the 3 runs: [0, 0, 0]" in text
            and not any(c.get("failed") or c.get("error") for c, _ in passes))


def _one_pass(name: str) -> Callable[[Data], tuple[str, ...]]:
    """A GPU suite run once (``gpu_suite_<name>_one_pass.log``): passed, skipped and seconds; none failed."""
    def numbers(d: Data) -> tuple[str, ...]:
        ((counts, seconds),) = _summaries(d.load(f"{GPU_TESTS}/gpu_suite_{name}_one_pass.log"))
        return _claim(not counts.get("failed") and not counts.get("error"),
                      (str(counts.get("passed", 0)), str(counts.get("skipped", 0)), f"{seconds:.0f}"),
                      f"a test failed in gpu_suite_{name}_one_pass.log")
    return numbers


def _soak_gpu_drift(d: Data) -> tuple[str, ...]:
    """The drift test_soak_gpu asserts; the claim that it holds on a GPU: each of the three passes with TE
    ran it and nothing failed."""
    asserted = _test_code("tests/test_reliability.py", r'assert max\(map\(abs, report\["drift"\]\)\) == (\d+)')
    lines = d.load(f"{GPU_TESTS}/gpu_suite_te_by_test.txt").splitlines()
    soak = [line.split()[0] for line in lines if line.endswith(" call     tests/test_reliability.py::test_soak_gpu")]
    return _claim(soak == ["passed"] * 3 and _suite_green(d, "te"), (asserted,),
                  f"gpu_suite_te_by_test.txt: {soak}")


def _suite_passes(name: str) -> Callable[[Data], tuple[str, ...]]:
    """A repeated GPU suite: passed and skipped (the same in every pass), each pass's seconds (rounded) and
    the longest test's seconds."""
    def numbers(d: Data) -> tuple[str, ...]:
        passes = _summaries(d.load(f"{GPU_TESTS}/gpu_suite_{name}.log"))
        counts = {(c.get("passed"), c.get("skipped")) for c, _ in passes}
        lines = d.load(f"{GPU_TESTS}/gpu_suite_{name}_by_test.txt").splitlines()
        longest = max(float(line.split()[1].rstrip("s")) for line in lines)
        first = passes[0][0] if passes else {}
        return _claim(_suite_green(d, name) and len(counts) == 1,
                      (str(first.get("passed", 0)), str(first.get("skipped", 0)),
                       *(_f(seconds) for _, seconds in passes), _f(longest)),
                      f"gpu_suite_{name}.log: {passes}")
    return numbers


def _te_gpu_bars(d: Data) -> tuple[str, ...]:
    held = float(_test_code("tests/test_te_gpu.py", r"assert offloaded >= ([\d.]+) \* sum\(held"))
    within = float(_test_code("tests/test_te_gpu.py", r"<= ([\d.]+) \* released"))
    return _f(100 * held), _f(100 * within)


def _suite(rel: str, *outcomes: str) -> Callable[[Data], tuple[str, ...]]:
    """The counts of ``outcomes`` in a stored pytest log's summary line; no test may have failed."""
    def counts(d: Data) -> tuple[str, ...]:
        found = _summary(d.load(rel))
        return _claim(not found.get("failed") and not found.get("error"),
                      tuple(str(found.get(o, 0)) for o in outcomes), f"{rel}: {found}")
    return counts


def _planner_checks(d: Data) -> tuple[str, ...]:
    """Plans that met every check, of all; the lowest and highest step error; the largest peak error."""
    checks = d.load(PLANNER_BENCH)["planner_checks"]
    steps = [c["step_error"] for c in checks]
    return (str(sum(bool(c["met"]) for c in checks)), str(len(checks)), f"{100 * min(steps):+.1f}",
            f"{100 * max(steps):+.1f}", _f(100 * max(abs(c["peak_error"]) for c in checks), 1))


#: The model of the hardware page's worked example: model A's shapes with PyTorch's layers, whose
#: forward the GPU paces (model A itself has Transformer Engine's layers, whose forward the host paces).
EXAMPLE = "A-torch"

#: The bench's row of Transformer Engine's layers on their default path, without offloading.
NO_OFFLOAD_DEFAULT_PATH = "no offload, TE's default path"

#: The bench's ``layer_kind`` of a Transformer Engine model.
TE_LAYER_KIND = "te.TransformerLayer"

#: NVIDIA's figure for NVLink-C2C, per direction (900 GB/s in total): a specification, not a
#: measurement of this project; the hardware page says so.
NVLINK_C2C_GB_S = 450


@dataclass(frozen=True)
class Quoted:
    """Numbers the prose writes itself. ``pattern`` is the prose around them, ``{}`` where each
    number stands (any whitespace matches a space); ``expected`` gives them from the data."""

    page: str
    pattern: str
    expected: Callable[[Data], tuple[str, ...]]
    source: str

    def regex(self) -> re.Pattern:
        tokens = re.split(r"(\{\}|\s+)", self.pattern)
        regex = "".join(r"(?<![\w.])([-+]?[\w.,]*\w)" if t == "{}" else r"\s+" if t.isspace() else re.escape(t)
                        for t in tokens if t)
        return re.compile(regex)


QUOTED = [
    # docs/long_context.md
    Quoted("docs/long_context.md", "tokens, {} times as long", _long_context_ratio,
           "long_context.json: checkpoint + offload's longest over checkpointing's"),
    Quoted("docs/long_context.md", "faster than checkpointing: {} % tokens per second", _long_context_turns,
           "at_checkpoint.json: the planner's median tokens/s over checkpointing's, taking turns"),
    Quoted("docs/long_context.md", "strategies.checkpoint.longest` | {} |", _full_first_failure("checkpoint"),
           "h200-long-context-full/checkpoint_no_offload.json: checkpointing's shortest failed length"),
    Quoted("docs/long_context.md", "strategies[no offload].longest` | {} |", _full_first_failure("no offload"),
           "h200-long-context-full/checkpoint_no_offload.json: no offload's shortest failed length"),
    Quoted("docs/long_context.md", "strategies.engine.longest` | {} |",
           _full_first_failure("engine", "engine_checkpoint_offload.json"),
           "h200-long-context-full/engine_checkpoint_offload.json: the engine's shortest failed length"),
    Quoted("docs/long_context.md", "(the search stopped unfinished) | {} |", _planner_failed_above,
           "h200-long-context-full: checkpoint + offload's step one resolution above the planner's longest"),
    Quoted("docs/long_context.md", "strategies.planner.longest` | {} |", _planner_failed_above,
           "h200-long-context-full/planner_409600.json: the planner's step one resolution above its longest"),
    Quoted("docs/long_context.md", "its step at {} tokens ran out of memory: its longest", _planner_failed_above,
           "h200-long-context-full/planner_409600.json: the planner's step one resolution above its longest"),
    Quoted("docs/long_context.md", "its step at {} tokens ran out of memory too", _planner_failed_above,
           "h200-long-context-full/engine_checkpoint_offload.json: checkpoint + offload's failed step"),
    Quoted("docs/long_context.md", "tokens, {} times checkpointing's", _planner_over_checkpoint,
           "h200-long-context-full: the planner's longest over checkpointing's, whole GPU"),
    Quoted("docs/long_context.md", "`long-context-planner:strategies.planner.longest`, {} times as long",
           _planner_over_checkpoint, "h200-long-context-full: the planner's longest over checkpointing's, whole GPU"),
    Quoted("docs/index.md", "`long-context-planner:strategies.planner.longest` tokens, {} times as long",
           _planner_over_checkpoint, "h200-long-context-full: the planner's longest over checkpointing's, whole GPU"),
    Quoted("docs/long_context.md", "rounds up to {} GiB", _planner_input_buffer,
           "h200-long-context-full/planner_405504.json: one layer's input at the longest, rounded as pinned"),
    Quoted("docs/long_context.md", "within {} MiB of the cost model's prediction", _planner_model_miss,
           "h200-long-context-full/planner_405504.json: measured against predicted peak at the longest"),
    Quoted("docs/long_context.md", "at {} tokens a plan that keeps two layers peaked at {} GiB, predicted {} GiB",
           _planner_kept_miss, "h200-long-context-full/planner_search.json: the step with kept layers"),
    Quoted("docs/long_context.md", "it predicted {} tokens, and every length", lambda d: _full_planner(d)[:1],
           "h200-long-context-full/planner.log: the first search's first prediction"),
    # docs/benchmarks.md
    Quoted("docs/benchmarks.md", "where it exceeds that by {} %", _bench_copy_threshold,
           "the threshold bench.md states: copy bound > 1.01 x baseline"),
    Quoted("docs/benchmarks.md", "take {} ms each way over PCIe", lambda d: (_f(d.copy_ms()),),
           "bench.json: one layer's saved bytes over the measured bandwidth"),
    Quoted("docs/benchmarks.md", "keeps each layer's input, {} to {} % of the saving", _checkpoint_keeps,
           "bench.json: 1 - saving / theory of every checkpoint row with k >= 2"),
    Quoted("docs/benchmarks.md", "The engine's saving is {} % of theory on PyTorch's layers",
           _engine_saves_all_on_torch_layers,
           "bench.json: saving / theory of every engine row on the models of PyTorch's layers"),
    Quoted("docs/benchmarks.md",
           "On Transformer Engine's layers its saving is {} % of theory at both `k`, where Transformer Engine's "
           "offload saves {} %",
           _saving_on_te_layers,
           "bench.json: saving / theory of the engine's and TE's offload's rows on the models of TE layers"),
    Quoted("docs/benchmarks.md", "it freed less than the engine and took longer at each of the {} values of `k`",
           _torchtune_behind, "bench.json: A-torch's torchtune rows against the engine's of the same k"),
    Quoted("docs/benchmarks.md", "recomputation cost less than offloading at each of the {} values of `k`",
           _checkpoint_cheaper_on_a, "bench.json: model A's checkpoint and engine overheads at every k"),
    Quoted("docs/benchmarks.md", "is {} to {} % of the measured pinned bandwidth in every row", _bandwidth_in_every_row,
           "bench.json: d2h_of_link and h2d_of_link of every engine row, lowest and highest"),
    Quoted("docs/benchmarks.md", "changed the overhead by under {} percentage point at each `k`",
           _pinned_buffers_alike, "bench.json: engine and engine (fresh pinned) overheads of A-torch at every k"),
    Quoted("docs/benchmarks.md", "took longer than the copy bound predicts at each of the {} values of `k` on both",
           _graphed_above_bound, "bench.json: over_reference of every graphed entry"),
    Quoted("docs/benchmarks.md", "the bound lies {} % below the graphs without offloading", _graphed_bound_margin,
           "bench.json: model A's graphed k=2 bound_ms against per_layer_ms"),
    # docs/hardware.md
    Quoted("docs/hardware.md", "| {} GB/s (NVIDIA's figure: {} GB/s in total) | not measured here",
           lambda d: (str(NVLINK_C2C_GB_S), str(2 * NVLINK_C2C_GB_S)), "NVIDIA's specification of NVLink-C2C"),
    Quoted("docs/hardware.md", "`torch.empty(..., pin_memory=True)` of {} GiB took",
           lambda d: (re.search(r"pinning (\S+) GiB", d.load("notebooks/01_concepts.ipynb")).group(1),),
           "notebook 01's output: the size it pins"),
    Quoted("docs/hardware.md", "page-locking {} GiB already in use",
           lambda d: (re.search(r"pinning (\S+) GiB", d.load("notebooks/01_concepts.ipynb")).group(1),),
           "notebook 01's output: the size it pins"),
    Quoted("docs/hardware.md", "a copy is {} to {} times slower", _pinned_vs_pageable,
           "notebook 01's output: pinned over pageable bandwidth, each direction, to one decimal"),
    Quoted("docs/hardware.md", "about {} times faster (NVIDIA's figure against the bandwidth measured here)",
           _nvlink_speedup, "NVIDIA's NVLink-C2C figure over bench.json's device-to-host bandwidth"),
    Quoted("docs/hardware.md", "whose copy takes {} ms over PCIe, as in the example below, takes under {} ms",
           _nvlink_copy, "the worked example's copy time, and the same bytes at NVIDIA's NVLink-C2C figure"),
    Quoted("docs/hardware.md", "layer's copy takes {} ms", lambda d: (_f(d.copy_ms(EXAMPLE), 1),),
           "bench.json: model A-torch's layer 1 saved bytes over the device-to-host bandwidth"),
    Quoted("docs/hardware.md", "The forward of one layer takes about {} ms", lambda d: (_f(d.forward_ms(EXAMPLE), 1),),
           "bench.json: median of model A-torch's forward_ms"),
    Quoted("docs/hardware.md", "at `k = 4` ({} ms against {} ms, the forward of the {} other layers)",
           lambda d: (_f(4 * d.copy_ms(EXAMPLE)), _f((d.bench["config"]["layers"] - 4) * d.forward_ms(EXAMPLE)),
                      str(d.bench["config"]["layers"] - 4)),
           "bench.json: layers, forward and copy times above"),
    Quoted("docs/hardware.md", "({} ms of copies against {} ms)",
           lambda d: (_f(2 * d.copy_ms(EXAMPLE)), _f((d.bench["config"]["layers"] - 2) * d.forward_ms(EXAMPLE))),
           "as above, k = 2"),
    Quoted("docs/hardware.md", "the measured steps on PyTorch's layers stay within {} % of",
           lambda d: _within_bound(d, te=False),
           "bench.json: the largest step / bound of any engine row on PyTorch's layers, rounded up"),
    Quoted("docs/hardware.md",
           "Model A's forward took about {} ms a layer (the median), longer than on PyTorch's layers, and its "
           "backward {} ms, less than half as long as theirs",
           lambda d: _claim(d.forward_ms("A") > d.forward_ms(EXAMPLE) and 2 * d.backward_ms("A") < d.backward_ms(EXAMPLE),
                            (_f(d.forward_ms("A"), 1), _f(d.backward_ms("A"), 1)),
                            "model A's forward is not longer than model A-torch's, or its backward not under half"),
           "bench.json: medians of model A's forward_ms and backward_ms, against model A-torch's"),
    Quoted("docs/hardware.md", "its copies fit up to `k = {}` ({} ms of forward compute against {} ms of copies)",
           _te_fits_up_to, "bench.json: model A's forward and copy times; its bound's copies_stop_fitting_at_k"),
    Quoted("docs/hardware.md", "and `k` ≤ {} × {} / ({} + {}) = {}: {} layers hide", _k_worked(EXAMPLE),
           "bench.json: layers, model A-torch's median forward_ms and copy time, and k solved from them"),
    Quoted("docs/hardware.md", "The inequality gives `k` ≤ {}: its copies fit",
           lambda d: _claim(math.ceil(_k_fits(d, "A")) - _k_fits(d, "A") < 0.1, (_f(_k_fits(d, "A"), 2),),
                            f"k solved is {_k_fits(d, 'A'):.2f}, not just short of a whole number"),
           "bench.json: k solved from model A's forward and copy times, two decimals; the prose's 'only just not' "
           "at the next k: within a tenth of it"),
    Quoted("docs/hardware.md", "stays within {} % of the step without offloading up to `k = {}`, and not beyond",
           _sweep_turns, "bench.json: the engine's overheads of model A-torch against the k solved for it"),
    Quoted("docs/hardware.md", "it puts the line at `k = {}`, and the measured", _bound_line_on_torch_layers,
           "bench.json: copies_stop_fitting_at_k of model A-torch"),
    Quoted("docs/hardware.md", "the four copies out took {} ms, more than the whole forward without offloading ({} ms",
           _copies_past_forward, "bench.json: device-to-host lane of model A's k = 4 timeline; the forwards without offloading"),
    Quoted("docs/hardware.md", "the engine's step on these layers took {} % longer than the bound,\nwhere on "
           "PyTorch's layers every step stayed within {} % of it",
           lambda d: (_f(100 * (d.run("A", "engine", 2)["step_over_bound"] - 1), 1),) + _within_bound(d, te=False),
           "bench.json: model A's engine row at k = 2, step / bound - 1; the largest step / bound of any engine "
           "row on PyTorch's layers, rounded up"),
    # defaults of the code and of other libraries
    Quoted("docs/caveats.md", "Leaving every storage under {} MiB on the device", _engine_1mib_threshold,
           "h100-te-host-time/README.md: the engine_1mib variant's min_offload_bytes"),
    Quoted("docs/caveats.md", "`min_offload_bytes` ({} KiB by default)", _code_default_kib,
           "get_cpu_offload_context's signature"),
    Quoted("docs/api_mapping.md", "`min_offload_bytes` (keyword-only, {} KiB by default)", _code_default_kib,
           "get_cpu_offload_context's signature"),
    Quoted("docs/api_mapping.md", "storages under `min_offload_bytes` ({} KiB by default)", _code_default_kib,
           "get_cpu_offload_context's signature"),
    Quoted("docs/api_mapping.md", "tensors with fewer than {} × {} ({}) elements are not offloaded",
           lambda d: ("256", "1024", f"{256 * 1024:,}"),
           "Transformer Engine's fixed threshold (its source): another library's constant, not a measurement"),
    Quoted("docs/api_mapping.md", "`min_offload_size` bytes ({} KiB by default)", lambda d: ("1",),
           "torchtune's OffloadActivations(min_offload_size=1024): another library's default, not a measurement"),
    Quoted("docs/fsdp.md", "at least {} % of the theoretical one", _fsdp_bar, "the bar tests/test_fsdp.py's GPU test sets"),
    # docs/reliability.md (its other GPU figures are {stored} values)
    Quoted("docs/reliability.md", "(drift {} B)", _soak_gpu_drift,
           "tests/test_reliability.py: test_soak_gpu asserts no drift; it passed in the stored GPU suite with TE"),
    Quoted("docs/reliability.md", "give up at least {} % of what their forwards hold (allocator's count); GPU bytes plus "
           "offloaded host bytes equal the bytes without offloading within {} % of the offloaded bytes",
           _te_gpu_bars, "the bars tests/test_te_gpu.py sets"),
    Quoted("docs/reliability.md", "`docs/evidence/h200-gpu-tests/gpu_suite_te_by_test.txt`): each pass {} passed and {} "
           "skipped (the NCCL pipeline test, which needs two GPUs), in {}, {} and {} s; the longest test took {} s",
           _suite_passes("te"), "gpu_suite_te.log: pytest's summary line of each pass; gpu_suite_te_by_test.txt: "
           "the longest test's seconds"),
    Quoted("docs/reliability.md", "`docs/evidence/h200-gpu-tests/gpu_suite_no_te_by_test.txt`): each pass {} passed "
           "and {} skipped (the Transformer Engine tests and the two-GPU pipeline test), in {}, {} and {} s; the longest test "
           "took {} s", _suite_passes("no_te"), "gpu_suite_no_te.log: pytest's summary line of each pass; "
           "gpu_suite_no_te_by_test.txt: the longest test's seconds"),
    Quoted("docs/reliability.md", "`docs/evidence/h200-gpu-tests/gpu_suite_te_one_pass.log`): {} passed and {} skipped "
           "in {} s", _one_pass("te"), "gpu_suite_te_one_pass.log: pytest's summary"),
    Quoted("docs/reliability.md", "`docs/evidence/h200-gpu-tests/gpu_suite_no_te_one_pass.log`): {} passed and {} "
           "skipped in {} s", _one_pass("no_te"), "gpu_suite_no_te_one_pass.log: pytest's summary"),
    Quoted("docs/reliability.md", "the GPU tests of the pipeline and FSDP files: {} passed",
           _suite(f"{EVIDENCE}/2xh200-nccl/tests_2gpu.log", "passed"), "tests_2gpu.log: pytest's summary line"),
    # docs/planner.md
    Quoted("docs/planner.md", "In this run {} of {} plans met every check, every step prediction was within {} to {} % "
           "of the measurement, and every peak within {} %", _planner_checks,
           "the planner bench's planner_checks: met, step_error and peak_error of every plan"),
    # notebooks (their Markdown)
    Quoted("notebooks/01_concepts.ipynb", "run at {} to {} times the pageable bandwidth", _pinned_vs_pageable,
           "the notebook's output: pinned over pageable bandwidth, each direction, to one decimal"),
    Quoted("notebooks/01_concepts.ipynb",
           "there the step without offloading took {} ms, and four offloaded layers {} ms, {} %",
           lambda d: (_f(d.run("A-torch", "no offload", 0)["step_ms"], 1), _f(d.run("A-torch", "engine", 4)["step_ms"], 1),
                      f"{100 * d.run('A-torch', 'engine', 4)['overhead']:+.1f}"),
           "bench.json: model A-torch's step without offloading, its engine step and paired overhead at k = 4"),
    Quoted("notebooks/02_basic.ipynb",
           "and measured {} % with two layers offloaded, its pairs spreading from {} % to {} % between quartiles",
           lambda d: tuple(f"{100 * v:+.1f}" for v in (d.run("A", "engine", 2)["overhead"],
                                                        *d.run("A", "engine", 2)["overhead_quartiles"])),
           "bench.json: model A's engine overhead at k = 2 and its quartiles"),
    Quoted("notebooks/02_basic.ipynb", "measured the default path at {} % against the offload path (the middle half "
           "of its pairs from {} % to {} %)",
           lambda d: tuple(f"{100 * v:+.1f}" for v in (d.run("A", NO_OFFLOAD_DEFAULT_PATH, 0)["overhead"],
                                                        *d.run("A", NO_OFFLOAD_DEFAULT_PATH, 0)["overhead_quartiles"])),
           "bench.json: model A's row for TE's default path without offloading, its overhead and quartiles"),
    Quoted("notebooks/02_basic.ipynb", "by its count the copies stop fitting at `k = {}`",
           lambda d: (str(d.model("A")["predicted"]["copies_stop_fitting_at_k"]),),
           "bench.json: model A's copies_stop_fitting_at_k"),
    Quoted("notebooks/02_basic.ipynb", "In that step a forward took about {} ms, so one layer's copy lasted about {} forwards",
           lambda d: (_f(d.forward_ms("A"), 1), WORDS[round(d.copy_ms("A") / d.forward_ms("A"))]),
           "bench.json: median of model A's forward_ms; its layer 1 copy time over that, in words"),
    Quoted("notebooks/02_basic.ipynb", "Steps without offloading took from {} ms to {} ms in bf16, from {} ms to {} ms "
           "with delayed scaling and from {} ms to {} ms with current scaling",
           lambda d: tuple(x for r in ("bf16", "DelayedScaling", "Float8CurrentScaling")
                           for x in _te_plain_range(d, r)),
           "the notebook's Transformer Engine table: fastest–slowest of each recipe's run without offloading"),
    Quoted("notebooks/02_basic.ipynb", "(in bf16, steps without offloading from {} ms to {} ms)",
           lambda d: _te_plain_range(d, "bf16"),
           "the notebook's Transformer Engine table: fastest–slowest of bf16's run without offloading"),
    Quoted("notebooks/03_pipeline.ipynb", "measured {} to {} ms on rank 0 and {} to {} ms on rank 1",
           _pipeline_2gpu_steps, "pipeline_dist_nccl.json: each rank's step_ms without and with offloading"),
    Quoted("notebooks/03_pipeline.ipynb",
           "on rank 1, an overhead of {}% and {}% (quartiles {}% .. {}% and {}% .. {}%)", _pipeline_2gpu_costs,
           "pipeline_dist_nccl.json: each rank's overhead, then its overhead_quartiles"),
    Quoted("notebooks/03_pipeline.ipynb", "measured {} to {} ms without offloading on rank 0 and {} to {} ms with",
           lambda d: _rank0_ranges(_pipeline_repeats(d)),
           "pipeline_dist_repeats.json: fastest and slowest of rank 0's step_ms without, then with offloading"),
    Quoted("notebooks/03_pipeline.ipynb", "step without offloading spread from {} to {} ms and its step with "
           "offloading from {} to {} ms", _pipeline_six_runs,
           "rank 0's step_ms over pipeline_dist_repeats.json, pipeline_dist_nccl.json and the notebook's table"),
    # docs/api/scenarios/basic.md (the stored two-GPU run's figures are {stored} values)
    Quoted("docs/api/scenarios/basic.md", "gave rank 0 {} to {} ms without offloading and {} to {} ms with it",
           lambda d: _rank0_ranges(_pipeline_repeats(d)),
           "pipeline_dist_repeats.json: fastest and slowest of rank 0's step_ms without, then with offloading"),
    Quoted("docs/api/scenarios/basic.md",
           "longer steps without offloading ({} and {} ms) and so an overhead of only {} % and {} %",
           _pipeline_notebook_run,
           "notebook 03's two-GPU table: each rank's median step without offloading, then its overhead"),
    Quoted("notebooks/06_optimizer_offload.ipynb", "matches the theory ({}% at every fraction)", _optimizer_theory,
           "the notebook's table: measured over theoretical state bytes of every fraction"),
]


# ------------------------------------------------------------------------------------ the prose
_UNIT = r"(?:GB/s|GiB|MiB|KiB|TiB|GB|MB|KB|TB|ms|µs|us|ns|s|min|minutes?|seconds?|hours?|%|B|x|×|times)"
MEASURED = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?\s?" + _UNIT + r"(?![\w/])"
                      + r"|\b(?:" + "|".join(WORDS[2:]) + r")\s+times\b")
_STORED = re.compile(r"\{stored\}`[^`]*`")


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str, markdown_math: bool = False) -> str:
    """``text`` with what is not prose blanked out (offsets kept): code blocks and spans, roles
    (``{stored}`` ones included: their numbers come from the data), link targets, math."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", _blank, text, flags=re.S | re.M)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", _blank, text)
    text = re.sub(r"``[^`]+``|`[^`\n]+`", _blank, text)
    text = re.sub(r"\]\([^)]*\)|<!--.*?-->", _blank, text, flags=re.S)
    if markdown_math:
        text = re.sub(r"\$\$.+?\$\$|\$[^$\n]+\$", _blank, text, flags=re.S)
    return text


def page_text(page: str) -> str:
    if page.endswith(".ipynb"):
        cells = json.loads((ROOT / page).read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return (ROOT / page).read_text()


def check_quoted(page: str, text: str, data: Data) -> list[str]:
    """Problems with the numbers :data:`QUOTED` lists for ``page``: prose that is gone or that
    disagrees with the data."""
    problems = []
    for q in (q for q in QUOTED if q.page == page):
        found = list(q.regex().finditer(text))
        if not found:
            problems.append(f"{page}: the prose no longer says {q.pattern!r}: update QUOTED in {Path(__file__).name}")
        try:
            expected = q.expected(data)
        except (StopIteration, KeyError, IndexError) as err:  # the data no longer has what the entry reads
            problems.append(f"{page}: {q.pattern!r}: the data has no such value ({type(err).__name__} {err}; "
                            f"{q.source}): update the prose and QUOTED in {Path(__file__).name}")
            continue
        for m in found:
            if m.groups() != expected:
                said = q.pattern.format(*m.groups())
                problems.append(f"{page}: {said!r} says {', '.join(m.groups())}; the data gives "
                                f"{', '.join(expected)} ({q.source})")
    return problems


def unsourced(page: str, text: str) -> list[str]:
    """Numbers with a unit in ``page`` that come neither from ``{stored}`` nor from :data:`QUOTED`."""
    covered = [m.span() for q in QUOTED if q.page == page for m in q.regex().finditer(text)]
    return [f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for m in MEASURED.finditer(prose(text))
            if not any(a <= m.start() and m.end() <= b for a, b in covered)]


def _value(number: str) -> tuple[float, int]:
    digits = number.replace(",", "")
    return float(digits), len(digits.split(".")[1]) if "." in digits else 0


def not_in_outputs(notebook: str, text: str, outputs: str) -> list[str]:
    """Numbers with a unit in a notebook's Markdown that are not in :data:`QUOTED` and that its
    stored outputs do not print (at the precision the Markdown writes)."""
    printed: dict[str, set[float]] = {}
    for m in re.finditer(r"(?<![\w.])([-+]?\d+(?:\.\d+)?)\s?(" + _UNIT + r")(?![\w/])", outputs):
        printed.setdefault(m.group(2), set()).add(float(m.group(1)))
    problems = []
    for where in unsourced(notebook, prose(text, markdown_math=True)):
        quoted = where.split(": ", 1)[1].strip("'")
        m = re.fullmatch(r"([-+]?[\d.,]+)\s?(\S+)", quoted)
        if m:
            value, decimals = _value(m.group(1))
            if any(round(p, decimals) == value for p in printed.get(m.group(2), ())):
                continue
        problems.append(f"{where} is not in the notebook's stored outputs")
    return problems


# ------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def data() -> Data:
    return Data()


@pytest.mark.parametrize("page", _pages())
def test_stored_references_resolve(page):
    """Every ``{stored}`` reference on a page names one value of its source (the build needs it)."""
    sources = _stored_sources()
    errors = []
    for ref in _STORED.findall(page_text(page)):
        spec = ref[len("{stored}`"):-1].replace("\\|", "|")  # \| in a table cell is a |
        try:
            offload_docs.stored_value(spec, sources, ROOT)
        except offload_docs.StoredValueError as err:
            errors.append(f"{ref}: {err}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", _pages() + NOTEBOOKS)
def test_quoted_numbers_agree_with_the_data(page, data):
    problems = check_quoted(page, page_text(page), data)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in _pages() if p not in NOT_CHECKED])
def test_page_numbers_have_a_source(page):
    """A number with a unit on a page is a ``{stored}`` value or listed in QUOTED."""
    found = unsourced(page, page_text(page))
    assert not found, ("numbers with no stored source (write them with {stored}`source:path|format`, "
                       "or list them in QUOTED with their source):\n" + "\n".join(found))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_numbers_are_in_its_outputs(notebook, data):
    problems = not_in_outputs(notebook, page_text(notebook), data.load(notebook))
    assert not problems, "\n".join(problems)


def test_notebooks_do_not_use_the_role():
    """nbsphinx converts notebook Markdown with pandoc: a role there would show as its source."""
    used = [nb for nb in NOTEBOOKS if "{stored}" in page_text(nb)]
    assert not used, f"{{stored}} does not work in notebook Markdown: {used}; quote what the outputs print"


def test_pages_not_checked_are_named_for_a_reason():
    assert set(NOT_CHECKED) <= set(_pages()), "NOT_CHECKED names a page that does not exist"


def test_quoted_entries_name_existing_pages():
    pages = set(_pages()) | set(NOTEBOOKS)
    assert {q.page for q in QUOTED} <= pages


# ------------------------------------------------------------------- the checks catch changes
def test_a_changed_stored_value_is_caught(data):
    """Change the measured bandwidth, a timeline and a notebook's output: the quoted numbers
    that depend on them disagree."""
    changed = Data()
    bench = json.loads(json.dumps(data.bench))
    bench["link_gb_per_s"]["d2h"] *= 0.8
    for e in next(m for m in bench["models"] if m["model"] == "A")["timelines"]["engine k=4"]:
        e["end"] += 1.0
    changed.cache[BENCH] = bench
    concepts, n = re.subn(r"^(d2h pageable +)[\d.]+ GB/s", r"\g<1>27.5 GB/s", data.load("notebooks/01_concepts.ipynb"),
                          flags=re.M)
    assert n == 1, "notebook 01 no longer prints the d2h pageable bandwidth: change this test"
    changed.cache["notebooks/01_concepts.ipynb"] = concepts
    assert check_quoted("docs/hardware.md", page_text("docs/hardware.md"), changed)
    assert check_quoted("docs/benchmarks.md", page_text("docs/benchmarks.md"), changed)
    assert any("times slower" in p for p in check_quoted("docs/hardware.md", page_text("docs/hardware.md"), changed))
    nb01 = "notebooks/01_concepts.ipynb"
    assert any("times the pageable" in p for p in check_quoted(nb01, page_text(nb01), changed))


def test_an_edited_number_in_the_prose_is_caught(data):
    text = page_text("docs/hardware.md")
    assert "(41 ms of copies against 56 ms)" in text
    assert check_quoted("docs/hardware.md", text.replace("(41 ms of copies", "(40 ms of copies"), data)
    added = text + "\nA step takes 12.5 ms on a good day, and 3 % more on a bad one.\n"
    assert len(unsourced("docs/hardware.md", added)) == 2
    nb_md = page_text("notebooks/06_optimizer_offload.ipynb") + "\nThe step takes 999.9 ms.\n"
    assert not_in_outputs("notebooks/06_optimizer_offload.ipynb", nb_md, data.load("notebooks/06_optimizer_offload.ipynb"))
    assert not not_in_outputs("notebooks/06_optimizer_offload.ipynb",
                              nb_md.replace("999.9 ms", "161.8 ms"), data.load("notebooks/06_optimizer_offload.ipynb"))


# --------------------------------------------------------------------------------- the role
@pytest.mark.parametrize("value, fmt, text", [
    (1142423552, "gib", "1.06 GiB"), (1142423552, "gib:3", "1.064 GiB"), (1142423552, "gb", "1.14 GB"),
    (186.7605, "ms", "186.8 ms"), (0.0137, "+pct", "+1.4 %"), (-0.036, "+pct", "-3.6 %"), (0.997, "pct", "99.7 %"),
    (0.99, "pct:0", "99 %"), (1.0088, "+excess", "+0.9 %"), (1.05, "excess:0", "5 %"), (55.007, "gbps", "55.0 GB/s"),
    (True, "met", "met"), (False, "met", "missed"), ({"start": 0.2, "end": 4.55}, "span", "4.3 ms"),
    (40, None, "40"), ("NVIDIA H100 80GB HBM3", None, "NVIDIA H100 80GB HBM3"),
])
def test_formats(value, fmt, text):
    assert offload_docs.format_value(value, fmt) == text


@pytest.mark.parametrize("reference, error", [
    ("bench:models[A].runs[engine].overhead|+pct", "matches 2 elements"),
    ("bench:models[Z].runs", "matches 0 elements"),
    ("bench:link_gb_per_s.up|gbps", "has no up"),
    ("bench:link_gb_per_s.d2h", "needs a format"),
    ("bench:link_gb_per_s.d2h|furlongs", "unknown format"),
    ("nowhere:x", "unknown source"),
    ('concepts:"no such label"', "occurs 0 times"),
    ('concepts:"pinned"', "occurs 5 times"),
    ("concepts:d2h pinned", "quote a label"),
    ('concepts:"d2h pinned"|gbps', "as printed"),
])
def test_bad_references_are_errors(reference, error):
    with pytest.raises(offload_docs.StoredValueError, match=re.escape(error)):
        offload_docs.stored_value(reference, _stored_sources(), ROOT)


def test_the_role_in_a_build(tmp_path):
    """In a Sphinx build the role writes the value, follows a changed file on the next
    (incremental) build, and fails the build (``-W``) on a value that is not there."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'docs' / '_ext')!r})\n"
        "extensions = ['myst_parser', 'offload_docs']\n"
        "stored_sources = {'run': 'run.json', 'nb': 'nb.ipynb'}\n")
    (src / "run.json").write_text(json.dumps({"runs": [{"strategy": "engine", "k": 2, "overhead": 0.0137}]}))
    notebook = {"cells": [{"cell_type": "code", "source": [], "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["d2h pinned     55.0 GB/s\n"]}]}]}
    (src / "nb.ipynb").write_text(json.dumps(notebook))
    page = src / "index.md"
    page.write_text("# Numbers\n\n| what | value |\n|---|---|\n"
                    "| overhead | {stored}`run:runs[engine,k=2].overhead\\|+pct` |\n\n"
                    "Pinned copies ran at {stored}`nb:\"d2h pinned\"`.\n")

    def build() -> tuple[subprocess.CompletedProcess, str]:
        proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(src), str(out)],
                              capture_output=True, text=True, timeout=300)
        html = (out / "index.html").read_text() if (out / "index.html").is_file() else ""
        return proc, re.sub(r"<[^>]+>", "", html)

    proc, html = build()
    assert proc.returncode == 0, proc.stderr
    assert "+1.4 %" in html and "Pinned copies ran at 55.0 GB/s." in html
    (src / "run.json").write_text(json.dumps({"runs": [{"strategy": "engine", "k": 2, "overhead": 0.0251}]}))
    proc, html = build()
    assert proc.returncode == 0, proc.stderr
    assert "+2.5 %" in html and "+1.4 %" not in html
    page.write_text(page.read_text().replace("k=2", "k=3"))
    proc, _ = build()
    assert proc.returncode != 0 and "matches 0 elements" in proc.stderr, proc.stderr
