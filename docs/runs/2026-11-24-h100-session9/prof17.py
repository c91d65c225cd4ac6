"""Session 9: model A (TE layers), N=20, k=2 and 4: the engine's reload timing, step by step against TE.
Variants in shuffled round-robin: the new default (first reload at bwd N-2), the old default (every reload at
bwd i+N-2-k), TE 2.20's timing (every reload at bwd N-1-k+i), TE's offload; peaks; bitwise gradients."""
import sys, time, statistics, collections, random
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, make_forward, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import engine as E, te_path
from offload_examples import DefaultSchedule
from offload_examples.core.schedule import SyncDictSchedule

dev = torch.device("cuda"); spec = MODELS["A"]; n = 20
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
def zero():
    x.grad = None
    for p in model.parameters(): p.grad = None
def eng(sched):
    return E.OffloadEngine(sched, device=dev, retain_pinned_cpu_buffers=True, count_every_layer=False)
def sd(k, lead):  # release at fwd N-k+i, reload at bwd i+lead
    return SyncDictSchedule({i: (True, n - k + i, False, i + lead) for i in range(k)}, n)
def through(e):
    return lambda x: _through(model, x, lambda i: e, e.sync)
none_fwd = make_forward("no offload", model, 0, dev)[0]
def none(x):
    with te_path.offload_path():
        return none_fwd(x)
variants = {"none (offload path)": none}
for k in (2, 4):
    d = DefaultSchedule(k, n)
    print(f"k={k}: new default reload triggers", [d.reload_trigger(j) for j in range(k)])
    variants[f"engine k={k} (new default)"] = through(eng(d))
    variants[f"engine k={k} old default"] = through(eng(sd(k, max(1, n - 2 - k))))
    variants[f"engine k={k} TE timing"] = through(eng(sd(k, n - 1 - k)))
    variants[f"TE k={k}"] = make_forward("transformer_engine", model, k, dev)[0]
def one(f):
    zero(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    e0, em, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    e0.record(); h = f(x); em.record()
    h.float().square().mean().backward(); e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1), e0.elapsed_time(em), em.elapsed_time(e1), torch.cuda.max_memory_allocated() / 2**30
def grads(f):
    zero(); h = f(x); h.float().square().mean().backward(); torch.cuda.synchronize()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
ref = grads(none)
for name, f in variants.items():
    g = grads(f)
    print(f"grads {name:28s} bitwise == none (offload path): {all(torch.equal(a, b) for a, b in zip(g, ref))}")
del ref, g
for name, f in variants.items():
    for _ in range(2): one(f)
res = collections.defaultdict(list)
R = int(sys.argv[1]) if len(sys.argv) > 1 else 12
names = list(variants)
for r in range(R):
    random.Random(r).shuffle(names)
    for name in names:
        for _ in range(2): res[name].append(one(variants[name]))
def q(v):
    v = sorted(v); return f"{statistics.median(v):6.1f} (q1 {v[len(v)//4]:6.1f} q3 {v[3*len(v)//4]:6.1f})"
print(f"\nrounds {R}x2 shuffled, N={n}: step | GPU fwd | GPU bwd (ms, medians) | peak")
for name in variants:
    rows = res[name]
    print(f"{name:28s} step {q([r[0] for r in rows])} fwd {statistics.median(r[1] for r in rows):6.1f} "
          f"bwd {statistics.median(r[2] for r in rows):6.1f} peak GiB {max(r[3] for r in rows):6.3f}")
print("\nstep ratio medians (pairs from the same round):")
for k in (2, 4):
    for a, b in [(f"engine k={k} (new default)", f"TE k={k}"), (f"engine k={k} old default", f"TE k={k}"),
                 (f"engine k={k} TE timing", f"TE k={k}"), (f"engine k={k} (new default)", f"engine k={k} old default"),
                 (f"engine k={k} (new default)", f"engine k={k} TE timing"), (f"engine k={k} (new default)", "none (offload path)"),
                 (f"TE k={k}", "none (offload path)")]:
        rr = sorted(ra[0] / rb[0] - 1 for ra, rb in zip(res[a], res[b]))
        print(f"  {a:28s} / {b:26s} - 1: {100*statistics.median(rr):+5.1f}% (q1 {100*rr[len(rr)//4]:+5.1f} q3 {100*rr[3*len(rr)//4]:+5.1f})")
print("PROF17 DONE", flush=True)
