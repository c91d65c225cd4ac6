"""Manual synchronization and ``synchronization_dict`` schedules, on the CPU."""

from __future__ import annotations

import pytest
import torch

from offload_examples import OffloadWarning, SyncDictSchedule, get_cpu_offload_context
from offload_examples.instruments.measure import compare_grads, measure_steps, resident_vs_theory
from offload_examples.instruments.models import build_basic_model
from offload_examples.scenarios import pipeline
from offload_examples.core.schedule import one_f_one_b_order, parse_order, sync_dict_for_order

CPU = torch.device("cpu")
ORDER = parse_order(pipeline.ORDER)


def setup(seed: int = 0):
    model = build_basic_model(1, 32, 4, 64, kind="torch", seed=seed)
    x = torch.randn(8, 2, 8, 32, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    return model, x


def dict_ctx(sync_dict, n: int = 8):
    return get_cpu_offload_context(enabled=True, model_layers=n, synchronization_dict=sync_dict, device=CPU)


def manual_ctx(n: int = 8):
    return get_cpu_offload_context(enabled=True, model_layers=n, manual_synchronization=True, device=CPU)


def step(model, x, ctx, sync, order=ORDER):
    return measure_steps(model, x, steps=2, warmup=0,
                         step=lambda: pipeline.pipeline_step(model[0], x, order, ctx, sync))


def reference(model, x, order=ORDER):
    return measure_steps(model, x, steps=1, warmup=0, step=lambda: pipeline.pipeline_step(model[0], x, order))


# ---------------------------------------------------------------- gradients and order of events
def test_dict_mode_grads_bitwise_equal_and_events_in_order():
    model, x = setup()
    ref = reference(model, x)
    ctx, sync = dict_ctx(pipeline.SYNC_DICT)
    got = step(model, x, ctx, sync)
    assert compare_grads(ref, got).equal
    assert ctx.phase_order() == ORDER
    ev = ctx.events
    pos = {e: k for k, e in enumerate(ev)}
    phases = [k for k, (kind, _) in enumerate(ev) if kind in ("forward", "backward")]

    def triggered_by(event):
        """Phases whose start may have run ``event``: a forward runs its actions before its own
        event, a backward (from its gradient hook) after its own."""
        k = pos[event]
        nxt = next(p for p in phases if p > k)
        prev = max(p for p in phases if p < k)
        return {ev[p] for p in (prev, nxt) if (ev[p][0] == "backward") == (p == prev)}

    for i, (ofwd, onum, rfwd, rnum) in pipeline.SYNC_DICT.items():
        assert pos[("forward", i)] < pos[("offload_start", i)] < pos[("release", i)] < pos[("reload_start", i)] < pos[("backward", i)]
        assert ("forward" if ofwd else "backward", onum) in triggered_by(("release", i))
        assert ("forward" if rfwd else "backward", rnum) in triggered_by(("reload_start", i))
    assert [s.offloaded_bytes > 0 for s in ctx.stats] == [i in pipeline.SYNC_DICT for i in range(8)]
    assert all(g == w for _, _, g, w in resident_vs_theory(ctx))


def test_manual_mode_matches_dict_mode():
    model, x = setup()
    ref = reference(model, x)
    ctx, sync, synchronizer = manual_ctx()
    got = measure_steps(model, x, steps=2, warmup=0,
                        step=lambda: pipeline.manual_step(model[0], x, ctx, sync, synchronizer))
    assert compare_grads(ref, got).equal
    dctx, dsync = dict_ctx(pipeline.SYNC_DICT)
    step(model, x, dctx, dsync)
    keep = ("offload_start", "release", "reload_start")
    assert sorted(e for e in ctx.events if e[0] in keep) == sorted(e for e in dctx.events if e[0] in keep)
    assert ctx.theoretical().peak_with == dctx.theoretical().peak_with
    assert [s.offloaded_bytes for s in ctx.stats] == [s.offloaded_bytes for s in dctx.stats]


def test_manual_layer_never_touched_stays_on_the_device():
    model, x = setup()
    ref = reference(model, x)
    ctx, sync, synchronizer = manual_ctx()
    got = step(model, x, ctx, sync)  # no synchronizer calls at all
    assert compare_grads(ref, got).equal
    assert ctx.offloaded_bytes == 0 and not [e for e in ctx.events if e[0] != "forward" and e[0] != "backward"]


def test_manual_release_without_reload_reloads_on_demand_with_a_warning():
    model, x = setup()
    ref = reference(model, x)
    ctx, sync, synchronizer = manual_ctx()

    def after_forward(j):
        if j == 2:
            synchronizer.start_offload_layer(2)
            synchronizer.release_activation_forward_gpu_memory(2)

    with pytest.warns(OffloadWarning, match="reloaded on demand"):
        got = measure_steps(model, x, steps=1, warmup=0, step=lambda: pipeline.pipeline_step(
            model[0], x, ORDER, ctx, sync, after_forward=after_forward))
    assert compare_grads(ref, got).equal


def test_sync_dict_for_order_and_one_f_one_b():
    assert one_f_one_b_order(1, 2, 4) == parse_order("0F 0B 1F 1B 2F 2B 3F 3B")
    assert one_f_one_b_order(0, 2, 4) == parse_order("0F 1F 0B 2F 1B 3F 2B 3B")
    d = sync_dict_for_order(ORDER, offload=range(1, 7))
    schedule = SyncDictSchedule(d, 8, ORDER)  # valid against the order
    trace = schedule.simulate([10] * 8, [0] * 8)
    assert trace.peak_without == 40 and trace.peak_with == 30  # one micro-batch fewer at the warm-up peak
    # the schedule releases only from 0B on: the warm-up peak stays
    assert SyncDictSchedule(pipeline.SYNC_DICT, 8, ORDER).simulate([10] * 8, [0] * 8).saving == 0


def test_early_release_dict_grads_equal_and_resident_bytes_follow_theory():
    model, x = setup()
    ref = reference(model, x)
    ctx, sync = dict_ctx(sync_dict_for_order(ORDER, offload=range(1, 7)))
    got = step(model, x, ctx, sync)
    assert compare_grads(ref, got).equal
    assert all(g == w for _, _, g, w in resident_vs_theory(ctx))
    assert ctx.theoretical().saving == ctx.stats[1].offloaded_bytes


def test_pipeline_scenario_small():
    report = pipeline.run(pipeline.PipelineConfig.small(), "cpu", progress=None)
    assert report["grads_equal"] and report["order_followed"]
    cases = report["cases"]
    assert cases["synchronization_dict"]["offloaded_bytes"] == 6 * report["saved_bytes_per_microbatch"]
    assert cases["manual synchronizer"]["offloaded_bytes"] == cases["synchronization_dict"]["offloaded_bytes"]
    assert cases["early-release dict"]["theoretical_saving_bytes"] > 0
    assert all(c["resident_matches_theory"] for n, c in cases.items() if n != "manual synchronizer")


# ---------------------------------------------------------------- validation up front
@pytest.mark.parametrize(
    "sync_dict, match",
    [
        ({8: (True, 1, True, 2)}, r"synchronization_dict\[8\].*layer index"),
        ({-1: (True, 1, True, 2)}, r"synchronization_dict\[-1\]"),
        ({"1": (True, 2, True, 3)}, r"synchronization_dict\['1'\]"),
        ({1: (True, 2, True)}, r"synchronization_dict\[1\].*expected a tuple"),
        ({1: [True, 2, True, 3]}, r"synchronization_dict\[1\].*expected a tuple"),
        ({1: (1, 2, True, 3)}, r"synchronization_dict\[1\].*offload_fwd must be a bool"),
        ({1: (True, 2.0, True, 3)}, r"synchronization_dict\[1\].*offload_num must be a int"),
        ({1: (True, 9, True, 3)}, r"synchronization_dict\[1\].*offload_num=9 is out of range"),
        ({1: (True, 2, True, -1)}, r"synchronization_dict\[1\].*reload_num=-1 is out of range"),
        ({1: (True, 1, True, 3)}, r"synchronization_dict\[1\].*its own"),
        ({1: (True, 2, False, 1)}, r"synchronization_dict\[1\].*its own"),
        ({1: (True, 3, True, 3)}, r"synchronization_dict\[1\].*same phase"),
    ],
)
def test_bad_sync_dict_rejected_up_front(sync_dict, match):
    with pytest.raises(ValueError, match=match):
        dict_ctx(sync_dict)


def test_sync_dict_must_be_a_dict():
    with pytest.raises(TypeError, match="must be a dict"):
        dict_ctx([(1, (True, 2, True, 3))])


def test_sync_dict_checked_against_a_given_order():
    with pytest.raises(ValueError, match=r"synchronization_dict\[1\].*before the reload"):
        SyncDictSchedule({1: (True, 5, True, 4)}, 8, ORDER)
    with pytest.raises(ValueError, match="cannot read"):
        parse_order("0F 1X")


# ---------------------------------------------------------------- run-time detection, naming the entry
def run_dict(sync_dict, order=ORDER):
    model, x = setup()
    ctx, sync = dict_ctx(sync_dict)
    pipeline.pipeline_step(model[0], x, order, ctx, sync)


def test_reload_triggered_before_release_names_the_entry():
    # layer 2 released at 5F, but its reload trigger 4F comes first
    with pytest.raises(RuntimeError, match=r"synchronization_dict\[2\].*reload came at the forward of layer 4.*not been released"):
        run_dict({2: (True, 5, True, 4)})


def test_backward_before_reload_names_the_entry():
    # reload at 7B: after 3's backward (3B comes before 7B)
    with pytest.raises(RuntimeError, match=r"synchronization_dict\[3\].*backward of layer 3 started.*not started its reload"):
        run_dict({3: (True, 4, False, 7)})


def test_release_that_never_came_names_the_entry():
    # released at 6B: layer 2's backward (2B) starts long before
    with pytest.raises(RuntimeError, match=r"synchronization_dict\[2\].*backward of layer 2 started.*not been released"):
        run_dict({2: (False, 6, False, 7)})


def test_release_before_the_layer_ran_names_the_entry():
    with pytest.raises(RuntimeError, match=r"synchronization_dict\[5\].*release came at the forward of layer 1.*has not run"):
        run_dict({5: (True, 1, True, 6)})


# ---------------------------------------------------------------- manual misuse
def manual_after_forward(calls):
    model, x = setup()
    ctx, sync, synchronizer = manual_ctx()
    with ctx:
        model[0](x[0])
    for name, arg in calls:
        getattr(synchronizer, name)(arg)


@pytest.mark.parametrize(
    "calls, error, match",
    [
        ([("release_activation_forward_gpu_memory", 0)], RuntimeError, r"release_activation_forward_gpu_memory\(0\).*not started its offload"),
        ([("start_reload_layer", 0)], RuntimeError, r"start_reload_layer\(0\).*not started its offload"),
        ([("start_offload_layer", 0), ("start_reload_layer", 0)], RuntimeError, r"start_reload_layer\(0\).*not been released"),
        ([("start_offload_layer", 0), ("release_activation_forward_gpu_memory", 0), ("start_reload_layer", 0),
          ("start_reload_layer", 0)], RuntimeError, r"start_reload_layer\(0\).*already started its reload"),
        ([("start_offload_layer", 0), ("start_offload_layer", 0)], RuntimeError, r"start_offload_layer\(0\).*not been released"),
        ([("start_offload_layer", 1)], RuntimeError, r"start_offload_layer\(1\).*has not run its forward"),
        ([("start_offload_layer", 8)], IndexError, r"start_offload_layer\(8\).*out of range \[0, 7\]"),
        ([("start_reload_layer", -1)], IndexError, "out of range"),
        ([("release_activation_forward_gpu_memory", True)], IndexError, "out of range"),
    ],
)
def test_manual_wrong_order_raises(calls, error, match):
    with pytest.raises(error, match=match):
        manual_after_forward(calls)


def test_synchronizer_of_a_default_context_refuses():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    with pytest.raises(RuntimeError, match="manual_synchronization=True"):
        ctx.synchronizer.start_offload_layer(0)


def test_disabled_manual_context_returns_three_items():
    ctx, sync, synchronizer = get_cpu_offload_context(enabled=False, manual_synchronization=True)
    assert synchronizer is None


@pytest.mark.parametrize("sync_dict", [pipeline.SYNC_DICT, {}])
def test_an_extra_forward_that_misaligns_the_entries_is_an_error(sync_dict):
    """A forward outside the step (like a pipeline stage's shape inference) would shift every
    entry by one: the engine refuses when the dict's moves no longer fit, or warns once the step's
    backwards come after the next step began, instead of offloading the wrong ones silently."""
    model, x = setup()
    ctx, sync = dict_ctx(sync_dict)
    with ctx:
        stray = model[0](x[0])  # kept alive, as a pipeline stage keeps its outputs
    with pytest.raises((RuntimeError, OffloadWarning),
                       match=r"synchronization_dict\[1\]|ran after this step's forwards began.*model_layers=8"):
        for _ in range(2):
            pipeline.pipeline_step(model[0], x, ORDER, ctx, sync)
    del stray
