"""OptimizerOffload on the CPU device: bitwise equal to the plain optimizer at any fraction."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_examples.features.optim_offload import SUPPORTED_OPTIMIZERS, OptimizerOffload

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def make_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4)
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def train(model: torch.nn.Module, optimizer, steps: int = 5) -> None:
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_nbytes(optimizer: torch.optim.Optimizer, params) -> int:
    ids = {id(p) for p in params}
    return sum(
        nbytes(v)
        for p, state in optimizer.state.items()
        if id(p) in ids
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def assert_params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bitwise_equal_to_plain_optimizer(name: str, fraction: float) -> None:
    cls, kwargs = OPTIMIZERS[name]
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = cls(ref_model.parameters(), **kwargs)
    opt = OptimizerOffload(model.parameters(), cls, fraction=fraction, **kwargs)
    train(ref_model, ref)
    train(model, opt)
    assert_params_equal(model, ref_model)
    assert opt.late_grad_copies == 0  # every gradient went out through the backward hook

    params = list(model.parameters())
    ref_params = list(ref_model.parameters())
    n_host = len(opt.host_params)
    assert opt.host_params == params[:n_host]  # a prefix, in order
    # the states match too, parameter by parameter
    for slot_opt, p in zip(opt.host_optimizers, ref_params[:n_host]):
        (host_state,) = slot_opt.state.values()
        for key, value in ref.state[p].items():
            assert torch.equal(host_state[key], value), key

    host_bytes = state_nbytes(ref, ref_params[:n_host])
    device_bytes = state_nbytes(ref, ref_params[n_host:])
    assert opt.state_bytes() == {"device": device_bytes, "host": host_bytes}
    if fraction == 0.0:
        assert n_host == 0 and opt.offloaded_fraction == 0.0
        assert opt.gpu_optimizer.param_groups[0]["params"] == params
    elif fraction == 1.0:
        assert n_host == len(params) and opt.offloaded_fraction == 1.0
        assert opt.gpu_optimizer is None
        assert opt.state_bytes()["device"] == 0
    else:
        assert 0 < n_host < len(params)
        assert opt.gpu_optimizer.param_groups[0]["params"] == params[n_host:]


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.73, 0.99, 1.0])
def test_partition_rule(fraction: float) -> None:
    params = list(make_model().parameters())
    opt = OptimizerOffload(params, torch.optim.Adam, fraction=fraction)
    sizes = [nbytes(p) for p in params]
    total = sum(sizes)
    n_host = len(opt.host_params)
    # parameter i goes to the host iff the bytes offloaded before it are < fraction * total
    for i in range(len(params)):
        assert (i < n_host) == (sum(sizes[:i]) < fraction * total), i
    assert opt.offloaded_fraction == sum(sizes[:n_host]) / total
    assert opt.offloaded_fraction >= fraction
    assert opt.fraction == fraction


def test_fraction_one_offloads_zero_size_parameters() -> None:
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.empty(0))]
    opt = OptimizerOffload(params, torch.optim.Adam, fraction=1.0)
    assert opt.host_params == params and opt.gpu_optimizer is None
    params[0].grad = torch.ones(3)
    params[1].grad = torch.empty(0)
    opt.step()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_theoretical_device_saving_matches_measured_states(fraction: float) -> None:
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=fraction, lr=1e-3)
    theory_before_any_step = opt.theoretical_device_saving()
    train(model, opt, steps=2)
    # On the CPU device the step counters lie on "the device" too, so the theory counts them.
    offloaded = sum(nbytes(p) for p in opt.host_params)
    assert opt.theoretical_device_saving() == theory_before_any_step == 2 * offloaded + 4 * len(opt.host_params)
    assert opt.theoretical_device_saving() == opt.state_bytes()["host"]
    # What the device side lost, compared with the plain optimizer (fraction 0), is the theory.
    plain_model = make_model()
    plain = OptimizerOffload(plain_model.parameters(), torch.optim.Adam, fraction=0.0, lr=1e-3)
    train(plain_model, plain, steps=2)
    assert plain.state_bytes()["device"] - opt.state_bytes()["device"] == opt.theoretical_device_saving()


def test_theoretical_saving_sgd_without_momentum_is_zero() -> None:
    opt = OptimizerOffload(make_model().parameters(), torch.optim.SGD, fraction=1.0, lr=0.1)
    assert opt.theoretical_device_saving() == 0


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
        (torch.optim.Adamax, {"lr": 1e-2}),
        (torch.optim.NAdam, {"lr": 1e-2}),
        (torch.optim.RAdam, {"lr": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "maximize": True}),
        (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
        (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
        (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "foreach": True}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_other_supported_optimizers_and_options_bitwise(cls, kwargs) -> None:
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = cls(ref_model.parameters(), **kwargs)
    opt = OptimizerOffload(model.parameters(), cls, fraction=0.5, **kwargs)
    train(ref_model, ref, steps=4)
    train(model, opt, steps=4)
    assert_params_equal(model, ref_model)


def test_subclass_of_supported_optimizer_is_accepted() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    opt = OptimizerOffload(make_model().parameters(), MyAdam, fraction=0.5)
    assert all(type(o) is MyAdam for o in opt.host_optimizers)
    assert type(opt.gpu_optimizer) is MyAdam


def test_unused_parameter_is_skipped_like_plain_optimizer() -> None:
    def run(make_opt):
        model = make_model()
        opt = make_opt(list(model.parameters()))
        for x, y in batches(4):
            h = model[1](model[0](x))  # model[2] and model[4] are not used: their grads stay None
            loss = torch.nn.functional.mse_loss(h[:, :4], y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    ref_model, _ = run(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    for fraction in (0.0, 0.5, 1.0):
        model, opt = run(lambda ps: OptimizerOffload(ps, torch.optim.Adam, fraction=fraction, lr=1e-2))
        assert_params_equal(model, ref_model)
        assert torch.equal(model[2].weight, make_model()[2].weight)  # never updated
        unused = {id(p) for p in (*model[2].parameters(), *model[4].parameters())}
        for slot_opt, p in zip(opt.host_optimizers, opt.host_params):
            assert bool(slot_opt.state) == (id(p) not in unused)  # no state for a parameter never stepped


def test_updates_follow_the_order_gradients_arrive_in() -> None:
    """The last layer's gradients reach the host first, so the CPU starts with them."""
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=1.0)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    order = [slot.param for slot in opt._update_order()]
    last_layer_first = [*model[4].parameters(), *model[2].parameters(), *model[0].parameters()]
    assert {id(p) for p in order} == {id(p) for p in last_layer_first}
    layer_of = {id(p): i for i, m in enumerate(model) for p in m.parameters()}
    assert [layer_of[id(p)] for p in order] == sorted((layer_of[id(p)] for p in order), reverse=True)
    opt.step()
    # Nothing new arrived: a second step with the same gradients reuses the copies, in list order.
    assert [slot.param for slot in opt._update_order()] == list(model.parameters())
    opt.step()
    assert opt.late_grad_copies == 0
    opt.zero_grad()
    assert opt._update_order() == []


def test_gradient_changed_after_backward_is_copied_again() -> None:
    """Clipping rewrites the gradients in place after the hook copied them: step() copies again."""
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=1.0, lr=1e-2)
    for m, o in ((ref_model, ref), (model, opt)):
        for x, y in batches(3):
            torch.nn.functional.mse_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.01)
            o.step()
            o.zero_grad()
    assert_params_equal(model, ref_model)
    assert opt.late_grad_copies == 3 * len(opt.host_params)


def test_gradient_set_by_hand_and_accumulated() -> None:
    ref_p = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    p = torch.nn.Parameter(ref_p.detach().clone())
    ref = torch.optim.Adam([ref_p], lr=0.1)
    opt = OptimizerOffload([p], torch.optim.Adam, fraction=1.0, lr=0.1)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    ref_p.grad, p.grad = g.clone(), g.clone()  # no hook fires
    ref.step()
    opt.step()
    assert torch.equal(p, ref_p) and opt.late_grad_copies == 1
    # two backward passes accumulate; the hook copies after each, the last copy wins
    for q, o in ((ref_p, ref), (p, opt)):
        o.zero_grad()
        (q * 2).sum().backward()
        (q**2).sum().backward()
        o.step()
    assert torch.equal(p, ref_p) and opt.late_grad_copies == 1


def test_zero_grad_without_set_to_none() -> None:
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    opt = OptimizerOffload(model.parameters(), torch.optim.SGD, fraction=0.5, lr=0.05, momentum=0.9)
    for m, o in ((ref_model, ref), (model, opt)):
        for x, y in batches(3):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    assert_params_equal(model, ref_model)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_parameter_changed_in_place_is_picked_up() -> None:
    """load_state_dict after wrapping: the device holds the newer values, the master follows."""
    ref_model = make_model()
    model = make_model(seed=5)
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=1.0, lr=1e-2)
    model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref, steps=3)
    train(model, opt, steps=3)
    assert_params_equal(model, ref_model)


def test_pinned_pool_does_not_grow() -> None:
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5)
    allocations = opt.pool.allocations
    held = opt.pool.held_bytes
    assert allocations == 2 * len(opt.host_params)  # a master and a gradient buffer each
    assert held == 2 * sum(nbytes(p) for p in opt.host_params)
    train(model, opt, steps=5)
    assert opt.pool.allocations == allocations and opt.pool.held_bytes == held
    with opt:
        pass
    assert opt.pool.held_bytes == 0 and opt.host_optimizers == []
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    # the hooks are gone: a backward after close() does not touch the wrapper
    torch.nn.functional.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 4)).backward()


def test_wrapper_is_not_kept_alive_by_its_hooks() -> None:
    import gc
    import weakref

    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=1.0)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    torch.nn.functional.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 4)).backward()  # dead hooks: no-ops


def assert_same_state(a: dict, b: dict) -> None:
    """Two optimizer state_dicts hold the same groups and bitwise equal states."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        assert state.keys() == b["state"][i].keys(), i
        for key, value in state.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_state_dict_is_the_plain_optimizers(name: str, fraction: float) -> None:
    cls, kwargs = OPTIMIZERS[name]
    ref_model, model = make_model(), make_model()
    ref = cls(ref_model.parameters(), **kwargs)
    opt = OptimizerOffload(model.parameters(), cls, fraction=fraction, **kwargs)
    assert_same_state(opt.state_dict(), ref.state_dict())  # before the first step: no state yet
    train(ref_model, ref, steps=3)
    train(model, opt, steps=3)
    assert_same_state(opt.state_dict(), ref.state_dict())


def test_checkpoints_move_between_fractions_and_the_plain_optimizer() -> None:
    """Save at one fraction, load at another and into the plain optimizer (through torch.save):
    training goes on bitwise equal, and the plain optimizer's checkpoint loads back."""
    import io

    def saved(optimizer) -> dict:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf)

    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.25, lr=1e-2)
    train(model, opt, steps=3)

    ref_model, resumed_model = copy.deepcopy(model), copy.deepcopy(model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1.0)  # the checkpoint's lr replaces these
    resumed = OptimizerOffload(resumed_model.parameters(), torch.optim.Adam, fraction=0.75, lr=1.0)
    ref.load_state_dict(saved(opt))  # one file each: like torch's, loaded states are not copied
    resumed.load_state_dict(saved(opt))
    assert all(group["lr"] == 1e-2 for group in resumed.param_groups)
    train(ref_model, ref, steps=2)
    train(resumed_model, resumed, steps=2)
    assert_params_equal(resumed_model, ref_model)

    back = OptimizerOffload(copy.deepcopy(ref_model).parameters(), torch.optim.Adam, fraction=0.5)
    back.load_state_dict(saved(ref))
    assert_same_state(back.state_dict(), ref.state_dict())


def test_is_an_optimizer_for_schedulers_hooks_and_closures() -> None:
    """A learning-rate schedule, step hooks and a closure work as with the plain optimizer."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5, lr=1e-2)
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.param_groups) == 1
    calls = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
    for optimizer, m in ((ref, ref_model), (opt, model)):
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)
        for x, y in batches(5):
            def closure():
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                return loss
            assert optimizer.step(closure) is not None
            schedule.step()
    assert_params_equal(model, ref_model)
    assert calls == [opt] * 5
    assert all(group["lr"] == ref.param_groups[0]["lr"] for o in opt.host_optimizers for group in o.param_groups)


def test_state_dict_hooks_run_as_on_the_plain_optimizer() -> None:
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5)
    train(model, opt, steps=1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "note": "kept"})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "note"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = opt.state_dict()
    assert saved["note"] == "kept"
    opt.load_state_dict(saved)
    assert calls == ["save pre", "load post"]


def test_state_is_keyed_by_the_callers_parameters() -> None:
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5)
    params = list(model.parameters())
    assert len(opt.state) == 0 and params[0] not in opt.state
    train(model, opt, steps=1)
    assert list(opt.state) == params
    host, kept = opt.host_params[0], params[-1]
    assert opt.state[host] is opt.host_optimizers[0].state[opt._slots[0].master]
    assert opt.state[kept] is opt.gpu_optimizer.state[kept]
    with pytest.raises(KeyError):
        opt.state[torch.zeros(1)]
    with pytest.raises(NotImplementedError, match="one param group"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    opt.close()
    assert len(opt.state) == 0


def scaled_training(model, optimizer, steps: int = 4, unscale_and_clip: bool = False, inf_at: int = 2) -> list[float]:
    """Train with a GradScaler; one step gets an inf gradient, which the scaler must skip."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scales = []
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == inf_at:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        if unscale_and_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("unscale_and_clip", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_grad_scaler_steps_like_the_plain_optimizer(fraction: float, unscale_and_clip: bool) -> None:
    """GradScaler unscales without bumping versions; the wrapper takes the scale from it instead,
    or copies again after scaler.unscale_. An inf gradient skips the step, as for the plain one."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=fraction, lr=1e-2)
    ref_scales = scaled_training(ref_model, ref, unscale_and_clip=unscale_and_clip)
    assert scaled_training(model, opt, unscale_and_clip=unscale_and_clip) == ref_scales
    assert ref_scales[2] < ref_scales[1]  # the inf step was skipped and the scale backed off
    assert_params_equal(model, ref_model)
    assert_same_state(opt.state_dict(), ref.state_dict())


def test_grad_copy_at_step_sees_changes_the_hooks_cannot() -> None:
    """A write through .grad.data (like an in-place all_reduce) bumps no version: with
    grad_copy="step" the wrapper copies at the step and follows the plain optimizer."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = OptimizerOffload(model.parameters(), torch.optim.SGD, fraction=1.0, grad_copy="step", lr=0.1)
    assert not model[0].weight._post_accumulate_grad_hooks
    for m, optimizer in ((ref_model, ref), (model, opt)):
        for x, y in batches(3):
            torch.nn.functional.mse_loss(m(x), y).backward()
            for p in m.parameters():
                p.grad.data.mul_(0.5)  # a reduction's average, behind autograd's back
            optimizer.step()
            optimizer.zero_grad()
    assert_params_equal(model, ref_model)
    with pytest.raises(ValueError, match='grad_copy must be "backward" or "step"'):
        OptimizerOffload(make_model().parameters(), torch.optim.SGD, grad_copy="later")


def test_distributed_runs_are_warned_about_in_place_reductions(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match='gradient_as_bucket_view=True.*grad_copy="step"'):
        OptimizerOffload(make_model().parameters(), torch.optim.SGD, fraction=0.5)


def test_load_state_dict_of_another_shape_is_refused() -> None:
    model = make_model()
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5)
    train(model, opt, steps=1)
    good = opt.state_dict()
    fewer = torch.optim.Adam(list(model.parameters())[:-1]).state_dict()
    with pytest.raises(ValueError, match=r"holds 5 parameters and state for 0; this optimizer has 6 parameters"):
        opt.load_state_dict(fewer)
    two_groups = {"state": {}, "param_groups": [dict(good["param_groups"][0], params=[0, 1, 2]),
                                                dict(good["param_groups"][0], params=[3, 4, 5])]}
    with pytest.raises(ValueError, match="one param group over 6 parameters.*got 2 param groups"):
        opt.load_state_dict(two_groups)
    with pytest.raises(ValueError, match="got list"):
        opt.load_state_dict([])
    after = opt.state_dict()
    assert_same_state(after, good)  # nothing was half-loaded


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "fraction, error, match",
    [
        (-0.1, ValueError, r"fraction must be in \[0, 1\], got -0.1"),
        (1.5, ValueError, r"fraction must be in \[0, 1\], got 1.5"),
        (float("nan"), ValueError, r"got nan"),
        ("0.5", TypeError, r"real number in \[0, 1\], got '0.5' \(str\)"),
        (None, TypeError, r"got None \(NoneType\)"),
        (True, TypeError, r"got True \(bool\)"),
    ],
)
def test_bad_fraction(fraction, error, match) -> None:
    with pytest.raises(error, match=match):
        OptimizerOffload(make_model().parameters(), torch.optim.Adam, fraction=fraction)


def test_integer_fractions_are_accepted() -> None:
    assert OptimizerOffload(make_model().parameters(), fraction=0).gpu_optimizer is not None
    assert OptimizerOffload(make_model().parameters(), fraction=1).gpu_optimizer is None


class _Custom(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        pass


@pytest.mark.parametrize(
    "cls, match",
    [
        (torch.optim.LBFGS, r"optimizer_class LBFGS is not supported.*per parameter and elementwise.*Adam"),
        (_Custom, r"optimizer_class _Custom is not supported.*Supported: SGD, Adam, AdamW"),
        (torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), r"must be an optimizer class .*got an object of type Adam"),
        ("Adam", r"not an instance or a name\), got an object of type str"),
    ],
    ids=["LBFGS", "custom", "instance", "string"],
)
def test_unsupported_optimizer(cls, match) -> None:
    with pytest.raises(TypeError, match=match):
        OptimizerOffload(make_model().parameters(), cls, fraction=0.5)


def test_supported_list() -> None:
    names = {c.__name__ for c in SUPPORTED_OPTIMIZERS}
    assert names == {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam"}


def test_bad_params() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="param groups .* not supported"):
        OptimizerOffload([{"params": list(model.parameters())}], torch.optim.Adam)
    with pytest.raises(ValueError, match="param groups .* not supported"):
        OptimizerOffload({"params": list(model.parameters())}, torch.optim.Adam)
    with pytest.raises(ValueError, match="params is empty"):
        OptimizerOffload([], torch.optim.Adam)
    with pytest.raises(ValueError, match="params is empty"):
        OptimizerOffload(iter(()), torch.optim.Adam)
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(3,\)\) does not require grad"):
        OptimizerOffload([model[0].weight, frozen], torch.optim.Adam)
    with pytest.raises(ValueError, match="not a leaf"):
        OptimizerOffload([model[0].weight * 2], torch.optim.Adam)
    with pytest.raises(ValueError, match="more than once"):
        OptimizerOffload([model[0].weight, model[0].weight], torch.optim.Adam)
    with pytest.raises(TypeError, match="single tensor"):
        OptimizerOffload(model[0].weight, torch.optim.Adam)
    with pytest.raises(TypeError, match=r"params\[0\] is a tuple.*named_parameters"):
        OptimizerOffload(model.named_parameters(), torch.optim.Adam)
    on_meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        OptimizerOffload([model[0].weight, on_meta], torch.optim.Adam)
    # a failed constructor leaves no hook behind
    assert not model[0].weight._post_accumulate_grad_hooks


# ---------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def optimizer_report():
    from offload_examples.scenarios.optimizer_offload import OptimizerConfig, format_report, run

    report = run(OptimizerConfig(layers=4, fractions=[0.0, 0.5, 1.0]), "cuda", progress=print)
    print(format_report(report))
    return report


@pytest.mark.gpu
def test_gpu_offloaded_state_leaves_the_gpu_as_theory_says(optimizer_report):
    for row in optimizer_report["rows"]:
        if row["fraction"] == 0.0:
            assert row["saving_bytes"] == 0 and row["theoretical_saving_bytes"] == 0
            continue
        assert row["theoretical_saving_bytes"] > 0
        assert abs(row["saving_ratio"] - 1) <= 0.05, row


@pytest.mark.gpu
def test_gpu_parameters_follow_the_plain_optimizer(optimizer_report):
    """Fraction 0 is the plain optimizer bit for bit. Otherwise the host updates round differently
    from the GPU's kernels: one step agrees to float rounding; later steps feed those differences
    back through the gradients, and Adam's normalisation turns a sign flip of a near-zero gradient
    into a full-size step, so the bound after several steps is on the relative L2 distance."""
    for row in optimizer_report["rows"]:
        first, last = row["after_first_step"], row["after_last_step"]
        if row["fraction"] == 0.0:
            assert first["bitwise"] and last["bitwise"]
            continue
        assert first["max_abs"] <= 1e-6, first
        assert last["max_rel_l2"] <= 1e-2, last


@pytest.mark.gpu
def test_gpu_checkpoint_loads_into_the_plain_optimizer(cuda):
    """On a GPU the host optimizers run fused CPU kernels; the checkpoint still carries the plain
    optimizer's flags and loads into it, host states moving to the device."""
    model = make_model().to(cuda)
    opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction=0.5, lr=1e-2)
    assert opt.host_optimizers[0].param_groups[0]["fused"] is True
    for x, y in batches(3):
        torch.nn.functional.mse_loss(model(x.to(cuda)), y.to(cuda)).backward()
        opt.step()
        opt.zero_grad()
    checkpoint = opt.state_dict()
    assert checkpoint["param_groups"][0]["fused"] is None
    ref_model = copy.deepcopy(model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1.0)
    ref.load_state_dict(copy.deepcopy(checkpoint))
    assert ref.param_groups[0]["lr"] == 1e-2 and ref.param_groups[0]["fused"] is None
    for i, p in enumerate(ref_model.parameters()):
        for key, value in checkpoint["state"][i].items():
            assert torch.equal(ref.state[p][key].cpu(), value.cpu()), (i, key)
        assert ref.state[p]["exp_avg"].device == p.device
