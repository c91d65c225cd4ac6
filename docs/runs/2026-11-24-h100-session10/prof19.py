"""Session 10 (#16): where the engine's forward host time goes on TE layers (N=20, k=2), cProfile by
cumulative time restricted to the engine's and TE's offload code, against TE's offload."""
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
variants = {"engine k=2": make_forward("engine", model, 2, dev)[0], "engine k=0": make_forward("engine", model, 0, dev)[0],
            "TE k=2": make_forward("transformer_engine", model, 2, dev)[0]}
nf = make_forward("no offload", model, 0, dev)[0]
def none(x):
    with te_path.offload_path(): return nf(x)
variants["none"] = none
def fwd(f, prof=None):
    zero(); torch.cuda.synchronize(); t = time.perf_counter()
    if prof: prof.enable()
    h = f(x)
    if prof: prof.disable()
    th = (time.perf_counter() - t) * 1e3
    h.float().square().mean().backward(); torch.cuda.synchronize()
    tb = (time.perf_counter() - t) * 1e3
    return th, tb
for f in variants.values():
    for _ in range(3): fwd(f)
res = {k: [] for k in variants}
for r in range(10):
    for k, f in variants.items(): res[k].append(fwd(f))
for k, v in res.items():
    print(f"{k:12s} host fwd {statistics.median(a for a, _ in v):6.1f} ms  step {statistics.median(b for _, b in v):6.1f} ms")
for name in ("engine k=2", "TE k=2", "engine k=0"):
    p = cProfile.Profile()
    for _ in range(8): fwd(variants[name], p)
    s = io.StringIO(); st = pstats.Stats(p, stream=s); st.sort_stats("cumulative").print_stats(r"offload_examples|cpu_offload|te_path", 30)
    print(f"\n==== {name} (8 forwards)\n" + s.getvalue()[-7000:])
print("PROF19 DONE")
