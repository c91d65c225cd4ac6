"""Transformer Engine layers, CUDA graphs and offloading, on the GPU (issue #16, item 4).

A whole training step captured in one graph (:func:`~offload_examples.features.graphs.capture_step`)
replays with offloading bit for bit like the same captured step without it, in bf16 and under
the FP8 recipes an H100 runs (``DelayedScaling``, ``Float8CurrentScaling``), and the captured step
without offloading replays like eager steps (the eager side of the square, offloading against
none, is ``tests/test_te_gpu.py``). Transformer Engine detects a plain ``torch.cuda.graph``
capture by itself (its FP8 state manager asks ``torch.cuda.is_current_stream_capturing()``), and
its ``DelayedScaling`` amax and scale updates are kernels on the modules' own tensors, so they are
captured with the step and every replay updates the FP8 state as an eager step does.

``make_graphed_callables`` captures forward and backward as separate graphs. What that does with
this package's context inside the callables is checked here, in fresh processes started when the
module starts (a capture CUDA aborts leaves the process unable to capture again): per-layer
callables (Transformer Engine's per-layer recipe) fail when the first layer's forward capture
ends, with CUDA's unjoined-work error, unless the context is told that captures hold single layers
(``ctx.set_capture_scope("layer")``), and then capture; one callable for the whole model
(Transformer Engine's documented recipe for its own offloading) captures as it is. The
CUDA-graph section of ``docs/caveats.md`` gives the reasons; the numerics of per-layer graphs are
``tests/test_graphed_layers.py``'s.

They need CUDA and Transformer Engine. Without TE they are skipped, unless
``OFFLOAD_EXAMPLES_REQUIRE_TE=1``, which makes them fail instead. Determinism comes from
``tests/conftest.py`` (``CUBLAS_WORKSPACE_CONFIG``) and
:func:`~offload_examples.instruments.models.import_transformer_engine`
(``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` before TE is imported); each comparison first checks that
two runs without offloading agree, so a mismatch is not blamed on offloading.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.features.graphs import capture_step
from offload_examples.instruments.measure import Measurement, compare_grads, snapshot
from offload_examples.instruments.te_compare import RECIPES, fp8_autocast

from fresh_processes import start_for_selected_tests

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, SEQ, BATCH = 512, 2048, 8, 256, 2
LAYERS, K = 4, 2
WARMUP, REPLAYS = 3, 3


def _fp8_state_manager():
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # releases before the quantization module
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


@pytest.fixture(autouse=True)
def _fresh_fp8_state(te):
    """FP8 state is global in TE (the delayed-scaling amax buffers of every module ever run): each
    test leaves it as it found it, as TE's own graph tests do."""
    yield
    _fp8_state_manager().reset()


def te_stack(te, cuda) -> torch.nn.ModuleList:
    """Four TE TransformerLayers in bf16, the same weights on every call; FP8 state starts anew."""
    _fp8_state_manager().reset()
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                            attn_input_format="bshd", params_dtype=torch.bfloat16, device=cuda)
        for _ in range(LAYERS)
    )


def batches(cuda) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(1)
    return [torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.bfloat16).to(cuda) for _ in range(REPLAYS)]


def recipe_autocast(te, recipe: str):
    """A factory of the autocast each forward runs under: none for bf16, else TE's FP8 autocast."""
    return lambda: fp8_autocast(recipe)


def make_step(model, autocast, ctx=None, sync=None):
    """One training step: the forward under the recipe's autocast (TE's rule: backward outside it),
    every layer inside ``ctx`` with its output through ``sync``, then the backward."""

    def step(x: torch.Tensor) -> torch.Tensor:
        with autocast():
            h = x
            for layer in model:
                with ctx if ctx is not None else contextlib.nullcontext():
                    h = layer(h)
                if sync is not None:
                    h = sync(h)
        h.float().square().mean().backward()
        return h.detach()

    return step


def captured_replays(te, cuda, recipe: str, inputs: list[torch.Tensor], offload: bool):
    """Capture a fresh model's step (``WARMUP`` eager steps first) and replay it on every input.

    Returns each replay's output and gradients (copied to the host), and the offload context.
    """
    model = te_stack(te, cuda)
    ctx = sync = None
    if offload:
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=LAYERS,
                                            retain_pinned_cpu_buffers=True)
    step = make_step(model, recipe_autocast(te, recipe), ctx, sync)
    example = inputs[0].clone().requires_grad_()
    try:
        captured = capture_step(step, example, model.parameters(), warmup=WARMUP)
    except Exception as err:
        if offload:
            raise
        pytest.fail(f"Transformer Engine could not capture a {recipe} training step in one torch.cuda.graph, "
                    f"without any offloading (a TE limit, not this package's): {err!r}")
    runs = [snapshot(model, captured.static_input, captured.replay(x)) for x in inputs]
    model.zero_grad(set_to_none=True)
    del captured
    torch.cuda.synchronize()
    return runs, ctx


def eager_steps(te, cuda, recipe: str, inputs: list[torch.Tensor]) -> list[Measurement]:
    """What :func:`captured_replays` does without a graph: the same warm-up, then one eager step per
    input (FP8 scaling state goes through the same updates in the same order)."""
    model = te_stack(te, cuda)
    step = make_step(model, recipe_autocast(te, recipe))
    x = inputs[0].clone().requires_grad_()
    for _ in range(WARMUP):
        model.zero_grad(set_to_none=True)
        x.grad = None
        step(x)
    runs = []
    for xi in inputs:
        model.zero_grad(set_to_none=True)
        x = xi.clone().requires_grad_()
        runs.append(snapshot(model, x, step(x)))
    model.zero_grad(set_to_none=True)
    return runs


def assert_bitwise(expected: list[Measurement], got: list[Measurement], what: str) -> None:
    assert len(expected) == len(got) == REPLAYS
    for i, (a, b) in enumerate(zip(expected, got)):
        check = compare_grads(a, b)
        assert check.equal, f"{what}, replay {i}: {check}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_te_captured_step_with_offloading_replays_bitwise_like_the_captured_step_without(te, cuda, recipe):
    """Every replay's output and every gradient (input included) equal, bit for bit, those of the same
    step captured without offloading; the capture really offloaded and released the first K layers."""
    inputs = batches(cuda)
    plain, _ = captured_replays(te, cuda, recipe, inputs, offload=False)
    again, _ = captured_replays(te, cuda, recipe, inputs, offload=False)
    assert_bitwise(plain, again, f"{recipe}: two captures without offloading differ (not deterministic here)")
    got, ctx = captured_replays(te, cuda, recipe, inputs, offload=True)
    assert_bitwise(plain, got, f"{recipe}: the captured step with offloading differs from the one without")
    # The captured iteration: what every replay repeats.
    assert sorted(j for kind, j in ctx.events if kind == "release") == list(range(K)), ctx.events
    assert ctx.offloaded_bytes > 0 and ctx.live_views == 0
    assert ctx.pool.graph_bytes == ctx.offloaded_bytes  # every offloaded storage copies through a graph's buffer


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_te_captured_step_replays_bitwise_like_eager_steps(te, cuda, recipe):
    """Without offloading, a replay equals an eager step on the same input after the same warm-up,
    FP8 scaling updates included: the graph changes no numerics, so the eager comparison in
    test_te_gpu.py and the captured one above are the same comparison."""
    inputs = batches(cuda)
    eager = eager_steps(te, cuda, recipe, inputs)
    replays, _ = captured_replays(te, cuda, recipe, inputs, offload=False)
    assert_bitwise(eager, replays, f"{recipe}: replays of the captured step differ from eager steps")


# ---------------------------------------------------------------------- make_graphed_callables

_PREAMBLE = f"""
import torch
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import transformer_engine.pytorch as te
from offload_examples import get_cpu_offload_context

N, K = {LAYERS}, {K}
torch.manual_seed(0)
layers = [te.TransformerLayer({HIDDEN}, {FFN}, {HEADS}, hidden_dropout=0.0, attention_dropout=0.0,
                              attn_input_format="bshd", params_dtype=torch.bfloat16) for _ in range(N)]
ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True)


def sample():
    return torch.randn({BATCH}, {SEQ}, {HIDDEN}, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def say(line):
    print(line, flush=True)


def warmed_up():
    say("warm-up done")
"""


_PER_LAYER = _PREAMBLE + """
SCOPE = None
class Offloaded(torch.nn.Module):
    def __init__(self, index, layer):
        super().__init__()
        self.index, self.layer = index, layer

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            say(f"capturing the forward of layer {self.index}")
        with ctx:
            h = self.layer(x)
        return sync(h)


callables = tuple(Offloaded(i, layer) for i, layer in enumerate(layers))
if SCOPE:
    ctx.set_capture_scope(SCOPE)
te.make_graphed_callables(callables, tuple((sample(),) for _ in callables), post_warmup_hook=warmed_up)
say("captured")
"""

_PER_LAYER_SCOPED = _PER_LAYER.replace("SCOPE = None", "SCOPE = 'layer'")

_WHOLE_MODEL = _PREAMBLE + """
class Whole(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, h):
        for layer in self.layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        return h


te.make_graphed_callables(Whole(), (sample(),), post_warmup_hook=warmed_up)
say("captured")
"""


@pytest.fixture(scope="module", autouse=True)
def _capture_programs(request, te):
    """The two captures that must fail, each in a fresh process, started when this module starts so
    that they run beside its other tests."""
    programs = {"test_gpu_te_per_layer_graphed_callables_with_the_context_inside_fail_at_the_first_forward_capture":
                _PER_LAYER,
                "test_gpu_te_per_layer_graphed_callables_capture_once_the_context_knows_the_scope": _PER_LAYER_SCOPED,
                "test_gpu_te_whole_model_graphed_callable_captures": _WHOLE_MODEL}
    yield from start_for_selected_tests(request, programs, timeout_s=600)


def _capture_fails(request, programs) -> tuple[str, str]:
    """What the fresh process of the requesting test left; it must have failed."""
    done = programs.result(request.node.originalname)
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, done.stderr


def _captured(request, programs) -> str:
    """The output of the requesting test's fresh process, which must have captured every graph."""
    done = programs.result(request.node.originalname)
    assert done.returncode == 0 and "captured" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_gpu_te_per_layer_graphed_callables_with_the_context_inside_fail_at_the_first_forward_capture(
        request, _capture_programs):
    """TE's per-layer recipe: one callable per layer, each entering the context. TE warms them up in
    the order of a training step (every forward, then every backward), which the engine follows;
    then it captures layer 0's forward alone. Its saved tensors' copies were forked onto the
    device-to-host stream, and are joined back only by their release, at the forward of layer
    N - k: CUDA ends that capture with "capturing stream has unjoined work". (docs/caveats.md)"""
    out, err = _capture_fails(request, _capture_programs)
    assert "warm-up done" in out, out + err[-3000:]
    assert "capturing the forward of layer 0" in out, out + err[-3000:]
    assert "capturing the forward of layer 1" not in out, out + err[-3000:]
    assert "unjoined" in err, err[-3000:]


def test_gpu_te_per_layer_graphed_callables_capture_once_the_context_knows_the_scope(request, _capture_programs):
    """The same per-layer recipe after ``ctx.set_capture_scope("layer")``: each layer's copies to the host
    are spread over the later layers' graphs and joined at their exits, the reloads are joined at the end of
    each backward capture, and every graph captures (numerics: tests/test_graphed_layers.py)."""
    _captured(request, _capture_programs)


def test_gpu_te_whole_model_graphed_callable_captures(request, _capture_programs):
    """TE's documented recipe for its own offloading: the whole model as one callable, so one forward
    graph and one backward graph. The forward capture offloads and releases layers 0..K-1 (each release
    joins its copies); the reloads in the backward graph need no wait for copies of the forward graph
    (the stream orders them), and are joined when the backward capture's call ends."""
    out = _captured(request, _capture_programs)
    assert "warm-up done" in out, out
