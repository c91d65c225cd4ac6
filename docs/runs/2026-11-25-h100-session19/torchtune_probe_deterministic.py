"""torchtune's OffloadActivations against no offloading, with controls, on the bench's model A layers
(k = 2 of 4): no offloading twice (is the step deterministic?), torchtune with and without its streams,
and this package's engine. Gradients compared bit for bit, the worst difference and where it is.
python tt_probe2.py te|torch"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
from offload_examples.instruments.models import build_basic_model, import_transformer_engine

kind = sys.argv[1]
import_transformer_engine()
import torch
from torchtune.training import OffloadActivations
from offload_examples import get_cpu_offload_context

dev = torch.device("cuda")
n, k = 4, 2
model = build_basic_model(n, 1024, 8, 4096, device=dev, dtype=torch.bfloat16, kind=kind, seed=0)
names = [name for name, _ in model.named_parameters()] + ["input"]
x = torch.randn(8, 2048, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
engine_ctx, engine_sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=dev)


def step(how: str):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    h = x
    if how == "engine":
        for layer in model:
            with engine_ctx:
                h = layer(h)
            h = engine_sync(h)
    else:
        ctx = {"torchtune": lambda: OffloadActivations(),
               "torchtune, no streams": lambda: OffloadActivations(use_streams=False)}.get(how)
        if ctx:
            with ctx():
                for layer in model[:k]:
                    h = layer(h)
        else:
            for layer in model[:k]:
                h = layer(h)
        for layer in model[k:]:
            h = layer(h)
    h.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


hows = ["none", "none again", "torchtune", "torchtune, no streams", "engine"]
from offload_examples.instruments.measure import deterministic_kernels
dk = deterministic_kernels() if kind == "torch" else __import__("contextlib").nullcontext()
dk.__enter__()
for _ in range(2):
    for how in hows:
        step(how if how != "none again" else "none")
results = {how: step(how if how != "none again" else "none") for how in hows}
p0, g0 = results["none"]
for how in hows[1:]:
    p1, g1 = results[how]
    diffs = [(float((a.float() - b.float()).abs().max()), name) for a, b, name in zip(g0, g1, names)]
    bad = [name for d, name in diffs if d > 0]
    worst = max(diffs)
    print(f"{kind} | {how:22s} | bitwise equal: {not bad} | differing grads: {len(bad)} of {len(names)} "
          f"(first: {bad[:3]}) | worst {worst[0]:.3g} in {worst[1]} | peak {p1 / 2**30:.2f} GiB vs {p0 / 2**30:.2f} GiB, "
          f"saving {(p0 - p1) / 2**30:.2f} GiB")
