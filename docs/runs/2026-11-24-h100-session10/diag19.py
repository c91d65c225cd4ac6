"""Session 10 diagnostic (#17): on model A with TE layers, N=12 (the planner bench's model), how much
does recomputing a set of layers cost, by position, measured as paired steps; and each layer phase's host
time and pure GPU time (a sleep kernel before each phase lets the host run ahead, so the events time GPU
work only). Also: the engine's per-entry cost with nothing offloaded."""
import time, statistics, random, json, sys
from offload_examples.instruments.models import import_transformer_engine, Checkpointed
TE = import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
from offload_examples.features.planner import Plan, apply_plan, KEEP, OFFLOAD, RECOMPUTE
print("TE", TE, torch.cuda.get_device_name())
dev = torch.device("cuda"); spec = MODELS["A"]; n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
def zero():
    x.grad = None
    for p in model.parameters(): p.grad = None
def ck(s): return [Checkpointed(l) if i in s else l for i, l in enumerate(layers)]
def bare(s):
    run = ck(s)
    return lambda: _through(run, x)
def planned(choices):
    ctx, sync, run = apply_plan(Plan(tuple(choices), 0, 0.0), layers, dev, retain_pinned_cpu_buffers=True)
    return lambda: _through(run, x, lambda i: ctx, sync)
R = range(n)
variants = {
    "none": bare(set()),
    "ck {0,1}": bare({0, 1}), "ck {n-2,n-1}": bare({n - 2, n - 1}), "ck {n-1}": bare({n - 1}), "ck {0}": bare({0}),
    "ck {0..3}": bare(set(range(4))), "ck {n-4..n-1}": bare(set(range(n - 4, n))),
    "ck {0..7}": bare(set(range(8))), "ck {n-8..n-1}": bare(set(range(n - 8, n))), "ck {0..n-2}": bare(set(range(n - 1))),
    "ck all": bare(set(R)),
    "engine keep all": planned([KEEP] * n),
    "engine ck {0..7}": planned([RECOMPUTE if i < 8 else KEEP for i in R]),
    "engine offload {0}": planned([OFFLOAD] + [KEEP] * (n - 1)),
    "engine offload {0}, ck {4}": planned([OFFLOAD] + [RECOMPUTE if i == 4 else KEEP for i in range(1, n)]),
}
def step(f):
    zero(); torch.cuda.synchronize(); t = time.perf_counter()
    h = f(); h.float().square().mean().backward(); torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3
with te_path.offload_path():
    for name, f in variants.items():
        step(f); step(f)
    res = {k: [] for k in variants}
    names = list(variants)
    rng = random.Random(0)
    for r in range(10):
        rng.shuffle(names)
        for name in names:
            step(variants[name]); res[name].append(step(variants[name]))
    base = statistics.median(res["none"])
    print(f"\n== A: step ms (median of 10 rounds), N={n}")
    for name, v in res.items():
        print(f"{name:30s} {statistics.median(v):7.1f} ms  {statistics.median(v) / base - 1:+7.1%}  q {sorted(v)[len(v)//4]:.1f}..{sorted(v)[3*len(v)//4]:.1f}")
    json.dump(res, open("/tmp/out_diag/diag19_steps.json" if len(sys.argv) < 3 else sys.argv[2], "w"))

    # B: per phase host and GPU time
    SLEEP = int(3e7)
    def phases(run_layers, ctx_sync=None, sleep=True):
        """Host ms and GPU ms of each layer's forward and backward (GPU pure when sleep=True)."""
        zero(); torch.cuda.synchronize()
        ev = lambda: torch.cuda.Event(enable_timing=True)
        fwd_h, fwd_g, bwd_t, bwd_e = [], [], {}, {}
        def bhook(j):
            def hook(g):
                bwd_t[j] = time.perf_counter()
                e_end = ev(); e_end.record(); bwd_e.setdefault(j, [None, None])[1] = e_end  # end of backward j+1... stored as start-side
                if sleep: torch.cuda._sleep(SLEEP)
                e = ev(); e.record(); bwd_e[j][0] = e
            return hook
        h = x
        xh = x.register_hook(bhook(-1))
        for j, layer in enumerate(run_layers):
            if sleep: torch.cuda._sleep(SLEEP)
            a = ev(); a.record(); t0 = time.perf_counter()
            if ctx_sync:
                with ctx_sync[0]: h = layer(h)
                h = ctx_sync[1](h)
            else:
                h = layer(h)
            t1 = time.perf_counter(); b = ev(); b.record()
            fwd_h.append((t1 - t0) * 1e3); fwd_g.append((a, b))
            h.register_hook(bhook(j))
        h.float().square().mean().backward(); torch.cuda.synchronize(); xh.remove()
        fg = [a.elapsed_time(b) for a, b in fwd_g]
        # backward of layer j runs between hook j (its output's grad) and hook j-1 (its input's grad)
        bh = [(bwd_t[j] - bwd_t[j - 1 + 0]) * -1e3 if False else (bwd_t[j - 1] - bwd_t[j]) * 1e3 for j in R]
        bg = [bwd_e[j][0].elapsed_time(bwd_e[j - 1][1]) for j in R]
        return fwd_h, fg, bh, bg
    def med(rows):
        return [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
    configs = {"kept": (layers, None), "ck all": (ck(set(R)), None)}
    ctx, sync, run = apply_plan(Plan(tuple([OFFLOAD] * (n - 1) + [KEEP]), 0, 0.0), layers, dev, retain_pinned_cpu_buffers=True)
    configs["offload 0..n-2"] = (run, (ctx, sync))
    ctx2, sync2, run2 = apply_plan(Plan(tuple([KEEP] * n), 0, 0.0), layers, dev, retain_pinned_cpu_buffers=True)
    configs["engine keep all"] = (run2, (ctx2, sync2))
    out = {}
    for name, (rl, cs) in configs.items():
        for sleep in (True, False):
            phases(rl, cs, sleep)
            rows = [phases(rl, cs, sleep) for _ in range(5)]
            fh, fg, bh, bg = (med([r[i] for r in rows]) for i in range(4))
            out[f"{name} sleep={sleep}"] = dict(fwd_host=fh, fwd_gpu=fg, bwd_host=bh, bwd_gpu=bg)
            print(f"\n== B: {name}, sleep={sleep} (ms per layer, medians of 5)")
            for lab, v in (("fwd host", fh), ("fwd gpu", fg), ("bwd host", bh), ("bwd gpu", bg)):
                print(f"  {lab:9s} sum {sum(v):7.2f}: " + " ".join(f"{t:5.2f}" for t in v))
    json.dump(out, open("/tmp/out_diag/diag19_phases.json", "w"))
print("DIAG19 DONE")
