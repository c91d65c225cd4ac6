"""Session 15 diagnostic (diag30): session 13's diag24 again, with the engine before the leaner pack hook beside it.
Model A (TE layers), N=12, k=2: host time of the forward of layers 0-1 (the offloaded ones), first without a
profiler (30 rounds, taking turns), then under cProfile (15 steps each): own time per function; the functions
whose own time grows most under each variant. Variants: none, engine (this commit), engine_old (dfe2136, imported
as oe_old_core from /tmp/old), te."""
import cProfile, io, os, pstats, sys, time
sys.path.insert(0, '/tmp/old')
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.instruments.bench import MODELS
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
import transformer_engine.pytorch as te
dev = torch.device("cuda"); spec = MODELS["A"]; n = 12; k = 2
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
ec, es = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=dev, retain_pinned_cpu_buffers=True)
tc, ts = te.get_cpu_offload_context(True, k, n, True, False)
from oe_old_core.api import get_cpu_offload_context as old_context
oc, os_ = old_context(enabled=True, num_layers=k, model_layers=n, device=dev, retain_pinned_cpu_buffers=True)
V = {"none": (None, None), "engine": (ec, es), "engine_old": (oc, os_), "te": (tc, ts)}
def fwd(ctx, sync, upto):
    h = x
    for l in layers[:upto]:
        if ctx is None: h = l(h)
        else:
            with ctx: h = l(h)
            h = sync(h)
    return h
def step(name, prof=None, upto=n):
    ctx, sync = V[name]
    x.grad = None
    for p in model.parameters(): p.grad = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof: prof.enable()
    h = fwd(ctx, sync, 2)
    if prof: prof.disable()
    t1 = time.perf_counter()
    for l in layers[2:]:
        if ctx is None: h = l(h)
        else:
            with ctx: h = l(h)
            h = sync(h)
    h.float().square().mean().backward(); torch.cuda.synchronize()
    return (t1 - t0) * 1e3
with te_path.offload_path():
    for name in V:
        for _ in range(4): step(name)
    real = {name: [] for name in V}
    for r in range(30):
        for name in (list(V) if r % 2 == 0 else list(V)[::-1]):
            real[name].append(step(name))
    for name in V:
        s_ = sorted(real[name]); print(f"{name}: unprofiled host time of layers 0-1 forward, median {s_[len(s_)//2]:.3f} ms, min {s_[0]:.3f}")
    profs = {name: cProfile.Profile() for name in V}
    host = {name: [] for name in V}
    for r in range(15):
        for name in V:
            host[name].append(step(name, profs[name]))
    for name in V:
        s = sorted(host[name]); print(f"{name}: host time of layers 0-1 forward, median {s[len(s)//2]:.2f} ms, min {s[0]:.2f}")
    def own(pr):
        st = pstats.Stats(pr)
        return {f"{k[0].split('site-packages/')[-1].split('/tmp/w/')[-1].split('/tmp/old/')[-1]}:{k[1]}({k[2]})": (v[2] * 1e3 / 15, v[3] * 1e3 / 15, v[1] / 15)
                for k, v in st.stats.items()}
    o = {name: own(p) for name, p in profs.items()}
    for name in ("engine", "engine_old", "te"):
        tot = sum(v[0] for v in o[name].values()); base = sum(v[0] for v in o["none"].values())
        print(f"\n=== {name}: own time summed {tot:.2f} ms/step (none {base:.2f}); functions by own time growth over none (ms/step: growth, own, cumulative, calls)")
        diff = sorted(((v[0] - o["none"].get(key, (0,))[0], key) for key, v in o[name].items()), reverse=True)
        for d, key in diff[:40]:
            v = o[name][key]; print(f"  {d:7.3f} {v[0]:7.3f} {v[1]:7.3f} {v[2]:6.0f}  {key}")
    s = io.StringIO(); pstats.Stats(profs["engine"], stream=s).sort_stats("cumulative").print_stats("offload_examples", 30)
    print(s.getvalue()[:8000])
