"""Session 12 diagnostic: what makes some steps of model A with TE layers 20-70 % slower?
Model A (Linear + te.TransformerLayer, N=12), no offloading, TE's offload path, one process.
Part 1: 40 steps; per step wall time of forward/backward, the main thread's CPU time (time.thread_time),
the process's CPU time, the thread's voluntary/involuntary context switches, garbage-collection time,
and the load average. Part 2: 30 steps, each under its own cProfile; for the slowest and fastest steps
the functions by own time, and the functions whose own time grows most in slow steps."""
import cProfile, gc, io, json, os, pstats, resource, statistics, sys, time
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
OUT = os.environ.get("OUT", "/tmp")
name = sys.argv[1] if len(sys.argv) > 1 else "A"; PROFILE = name == "A"
dev = torch.device("cuda"); spec = MODELS[name]; n = 12
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
print("TE", TE, "spec", spec, "NVTE env", {k: v for k, v in os.environ.items() if k.startswith("NVTE")}, flush=True)
gc_ms = [0.0]; _gc_t = [0.0]
def _gc_cb(phase, info):
    if phase == "start": _gc_t[0] = time.perf_counter()
    else: gc_ms[0] += (time.perf_counter() - _gc_t[0]) * 1e3
gc.callbacks.append(_gc_cb)
def ru():
    r = resource.getrusage(resource.RUSAGE_THREAD); return r.ru_nvcsw, r.ru_nivcsw
def step():
    x.grad = None
    for p in model.parameters(): p.grad = None
    torch.cuda.synchronize(); gc_ms[0] = 0.0
    c0 = ru(); th0 = time.thread_time(); pr0 = time.process_time(); t0 = time.perf_counter()
    h = _through(layers, x); t1 = time.perf_counter(); th1 = time.thread_time()
    h.float().square().mean().backward(); t2 = time.perf_counter(); th2 = time.thread_time()
    torch.cuda.synchronize(); t3 = time.perf_counter(); c1 = ru(); pr1 = time.process_time()
    return dict(step=(t3 - t0) * 1e3, fwd=(t1 - t0) * 1e3, bwd=(t2 - t1) * 1e3, fwd_cpu=(th1 - th0) * 1e3,
                bwd_cpu=(th2 - th1) * 1e3, proc_cpu=(pr1 - pr0) * 1e3, vcsw=c1[0] - c0[0], ivcsw=c1[1] - c0[1],
                gc=gc_ms[0], load=os.getloadavg()[0])
with te_path.offload_path():
    for _ in range(5): step()
    res = [step() for _ in range(40)]
    print("part 1: step fwd bwd fwd_cpu bwd_cpu proc_cpu vcsw ivcsw gc load")
    for r in res:
        print(" ".join(f"{r[k]:7.1f}" for k in ("step", "fwd", "bwd", "fwd_cpu", "bwd_cpu", "proc_cpu", "vcsw", "ivcsw", "gc", "load")))
    json.dump(res, open(f"{OUT}/diag21_part1_{name}.json", "w"))
    if not PROFILE:
        sys.exit(0)
    steps, profs = [], []
    for _ in range(30):
        pr = cProfile.Profile()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        pr.enable(); step(); pr.disable()
        steps.append((time.perf_counter() - t0) * 1e3); profs.append(pr)
order = sorted(range(len(steps)), key=steps.__getitem__)
print("part 2 (cProfile) steps ms:", " ".join(f"{s:.0f}" for s in steps))
def own(pr):
    st = pstats.Stats(pr); return {f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})": v[2] * 1e3 for k, v in st.stats.items()}, st
fast, slow = order[:5], order[-5:]
def avg(ids):
    acc = {}
    for i in ids:
        for k, v in own(profs[i])[0].items(): acc[k] = acc.get(k, 0) + v / len(ids)
    return acc
af, as_ = avg(fast), avg(slow)
print(f"fast steps {[round(steps[i]) for i in fast]}  slow steps {[round(steps[i]) for i in slow]}")
print(f"own time summed: fast {sum(af.values()):.1f} ms, slow {sum(as_.values()):.1f} ms")
diff = sorted(((as_.get(k, 0) - af.get(k, 0), k) for k in set(af) | set(as_)), reverse=True)
print("functions whose own time grows most in the slow steps (ms: slow - fast, slow, fast):")
for d, k in diff[:30]:
    print(f"  {d:8.2f} {as_.get(k, 0):8.2f} {af.get(k, 0):8.2f}  {k}")
for label, i in (("slowest", order[-1]), ("fastest", order[0])):
    s = io.StringIO(); pstats.Stats(profs[i], stream=s).sort_stats("tottime").print_stats(25)
    print(f"--- {label} step {steps[i]:.1f} ms ---"); print(s.getvalue()[:6000])
