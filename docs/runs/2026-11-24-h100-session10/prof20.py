"""Session 10 (#16): the engine's extra forward host time against TE's offload, function by function (cProfile
differences), time spent in the garbage collector per forward, and step-time spread with gc.freeze()."""
import time, statistics, cProfile, pstats, gc, sys
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, make_forward, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
from offload_examples.features.planner import Plan, apply_plan, KEEP
dev = torch.device("cuda"); spec = MODELS["A"]; n = 20
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
def zero():
    x.grad = None
    for p in model.parameters(): p.grad = None
nf = make_forward("no offload", model, 0, dev)[0]
def on_path(f):
    def g(x):
        with te_path.offload_path(): return f(x)
    return g
ctx, sync, run = apply_plan(Plan((KEEP,) * n, 0, 0.0), list(model), dev)
variants = {"none": on_path(nf), "engine k=2": make_forward("engine", model, 2, dev)[0],
            "TE k=2": make_forward("transformer_engine", model, 2, dev)[0],
            "engine keep all": on_path(lambda x: _through(run, x, lambda i: ctx, sync))}
gc_ms = [0.0]; gc_n = [0]; _t = [0.0]
def cb(phase, info):
    if phase == "start": _t[0] = time.perf_counter()
    else: gc_ms[0] += (time.perf_counter() - _t[0]) * 1e3; gc_n[0] += 1
gc.callbacks.append(cb)
def fwd(f, prof=None):
    zero(); torch.cuda.synchronize(); t = time.perf_counter()
    g0, n0 = gc_ms[0], gc_n[0]
    if prof: prof.enable()
    h = f(x)
    if prof: prof.disable()
    th = (time.perf_counter() - t) * 1e3
    gf = gc_ms[0] - g0
    h.float().square().mean().backward(); torch.cuda.synchronize()
    return th, (time.perf_counter() - t) * 1e3, gf, gc_n[0] - n0
print("objects tracked by gc:", len(gc.get_objects()))
for f in variants.values():
    for _ in range(3): fwd(f)
res = {k: [] for k in variants}
for r in range(12):
    for k, f in variants.items(): res[k].append(fwd(f))
for k, v in res.items():
    print(f"{k:16s} host fwd {statistics.median(a[0] for a in v):6.1f} ms  step {statistics.median(a[1] for a in v):6.1f} ms"
          f"  gc in fwd {statistics.mean(a[2] for a in v):5.2f} ms/fwd, collections/step {statistics.mean(a[3] for a in v):.1f}")
stats = {}
for name in variants:
    p = cProfile.Profile()
    for _ in range(8): fwd(variants[name], p)
    st = pstats.Stats(p); stats[name] = {f"{k[0].split('/')[-1]}:{k[1]}({k[2]})": (v[1], v[2]) for k, v in st.stats.items()}
    print(f"{name}: total profiled {st.total_tt:.3f} s / 8 forwards")
def diff(a, b, top=40):
    keys = set(stats[a]) | set(stats[b])
    rows = sorted(((stats[a].get(k, (0, 0))[1] - stats[b].get(k, (0, 0))[1], k) for k in keys), reverse=True)
    print(f"\n==== tottime {a} minus {b} (s over 8 forwards), top {top}")
    for d, k in rows[:top]:
        print(f"  {d*1e3:+8.2f} ms  calls {stats[a].get(k, (0,0))[0]:6d} vs {stats[b].get(k, (0,0))[0]:6d}  {k}")
diff("engine k=2", "TE k=2"); diff("engine keep all", "none", 25); diff("TE k=2", "none", 25)
# spread of step times with and without gc.freeze (none, 30 steps each, alternating blocks)
f = variants["none"]
for label in ("gc default", "gc.freeze", "gc default", "gc.freeze"):
    if label == "gc.freeze": gc.collect(); gc.freeze()
    v = sorted(fwd(f)[1] for _ in range(30))
    if label == "gc.freeze": gc.unfreeze()
    print(f"{label:11s} step ms: min {v[0]:.1f} q1 {v[7]:.1f} median {v[15]:.1f} q3 {v[22]:.1f} max {v[-1]:.1f}")
print("PROF20 DONE")
