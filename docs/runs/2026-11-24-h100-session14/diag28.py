"""Session 14 diagnostic (diag28): Python's garbage collector under offloading. Model A (Linear + te.TransformerLayer),
N = 20, k = 2, on TE's offload path. Variants in blocks of steps (not in turns: a collection depends on what the
steps before it allocated): none, engine, te; then engine again after gc.freeze(). Per variant: collections per
generation and their total time (gc.callbacks), the slowest collection, steps run."""
import gc, json, os, statistics, time
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.instruments.bench import MODELS
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
import transformer_engine.pytorch as te
OUT = os.environ.get("OUT", "/tmp"); STEPS = int(os.environ.get("STEPS", "150")); N, K = 20, 2
spec = MODELS["A"]; dev = torch.device("cuda")
model = build_basic_model(N, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind, seed=0,
                          activation=spec.activation, dropout=spec.dropout)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
stats = {}; start = {}
def cb(phase, info):
    g = info["generation"]
    if phase == "start":
        start[g] = time.perf_counter()
    else:
        d = stats.setdefault(g, [])
        d.append((time.perf_counter() - start[g]) * 1e3)
gc.callbacks.append(cb)
def step(ctx, sync):
    x.grad = None
    for p in model.parameters(): p.grad = None
    h = x
    for l in model:
        if ctx is None:
            h = l(h)
        else:
            with ctx:
                h = l(h)
            h = sync(h)
    h.float().square().mean().backward()
    torch.cuda.synchronize()
res = {}
with te_path.offload_path():
    variants = [("none", (None, None)),
                ("engine", get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True)),
                ("te", te.get_cpu_offload_context(True, K, N, True, False)),
                ("engine_after_freeze", None)]
    engine_ctx = variants[1][1]
    for name, v in variants:
        if name == "engine_after_freeze":
            gc.collect(); gc.freeze(); v = engine_ctx
        for _ in range(5): step(*v)
        stats.clear()
        t0 = time.perf_counter()
        for _ in range(STEPS): step(*v)
        wall = time.perf_counter() - t0
        res[name] = {"steps": STEPS, "wall_s": wall, "objects": len(gc.get_objects()),
                     "collections": {g: len(d) for g, d in sorted(stats.items())},
                     "ms_total": {g: round(sum(d), 3) for g, d in sorted(stats.items())},
                     "ms_max": {g: round(max(d), 3) for g, d in sorted(stats.items())}}
        print(name, res[name], flush=True)
json.dump(res, open(f"{OUT}/diag28.json", "w"))
