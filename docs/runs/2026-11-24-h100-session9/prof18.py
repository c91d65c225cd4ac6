"""Session 9: host time of the forward, engine k=2 vs TE k=2 (model A, TE layers, N=20): cProfile of 10 forwards
each, per-layer saved tensor counts, and host-only forward times (ms, medians)."""
import time, statistics, cProfile, pstats, io
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, make_forward, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import engine as E, te_path
from offload_examples import DefaultSchedule
dev = torch.device("cuda"); spec = MODELS["A"]; n = 20
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
def zero():
    x.grad = None
    for p in model.parameters(): p.grad = None
e = E.OffloadEngine(DefaultSchedule(2, n), device=dev, retain_pinned_cpu_buffers=True, count_every_layer=False)
nf = make_forward("no offload", model, 0, dev)[0]
def none(x):
    with te_path.offload_path(): return nf(x)
variants = {"none": none, "engine k=2": lambda x: _through(model, x, lambda i: e, e.sync),
            "TE k=2": make_forward("transformer_engine", model, 2, dev)[0]}
def fwd_host(f, prof=None):
    zero(); torch.cuda.synchronize()
    t = time.perf_counter()
    if prof: prof.enable()
    h = f(x)
    if prof: prof.disable()
    th = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize(); tg = (time.perf_counter() - t) * 1e3
    h.float().square().mean().backward(); torch.cuda.synchronize()
    return th, tg
for name, f in variants.items():
    for _ in range(3): fwd_host(f)
print("stats layer 0:", e.stats[0], "\nlayer 5:", e.stats[5])
res = {name: [] for name in variants}
for r in range(12):
    for name, f in variants.items():
        res[name].append(fwd_host(f))
for name, rows in res.items():
    print(f"{name:12s} host fwd {statistics.median(r[0] for r in rows):6.1f} ms, fwd incl. GPU {statistics.median(r[1] for r in rows):6.1f} ms")
for name in ("engine k=2", "TE k=2"):
    p = cProfile.Profile()
    for _ in range(8): fwd_host(variants[name], p)
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(22); print(f"\n==== {name} (8 forwards)\n" + s.getvalue()[-6000:])
print("PROF18 DONE")
