"""Session 13 diagnostic: where does the engine's step lose to Transformer Engine's offload on model A (TE layers)?
Model A (Linear + te.TransformerLayer), N=12, k=2 and 4. Variants run round robin, step by step:
no offload, TE, engine, engine with early_first_reload, engine keeping non-contiguous tensors (what TE skips),
engine keeping non-contiguous tensors and tensors under 256K elements (TE's two rules).
Per step: step ms, forward ms and backward ms (CUDA events on the compute stream), host forward ms, peak bytes
above the step's start; per variant the offloaded bytes; what the engine offloads that TE's rules skip."""
import json, os, statistics, sys, time
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.instruments.bench import MODELS, _free
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
import offload_examples.core.engine as E
import transformer_engine.pytorch as te
OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", "25"))
dev = torch.device("cuda"); spec = MODELS["A"]; n = 12
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
RULES = {"mode": None}
skipped = {}
_orig_keep = E.keep_reason
def keep(t, device, min_bytes):
    r = _orig_keep(t, device, min_bytes)
    mode = RULES["mode"]
    if r is None and mode:
        if not t.is_contiguous():
            skipped.setdefault(mode, {}).setdefault(("noncontig", tuple(t.shape), tuple(t.stride()), str(t.dtype),
                                                     t.untyped_storage().nbytes()), 0)
            return "TE skips non-contiguous"
        if mode == "te_rules" and t.numel() < 256 * 1024:
            skipped.setdefault(mode, {}).setdefault(("small", tuple(t.shape), str(t.dtype)), 0)
            return "TE skips < 256K elements"
    return r
E.keep_reason = keep
def engine(k, **kw):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=dev,
                                        retain_pinned_cpu_buffers=True, **kw)
    return ctx, sync
def variants(k):
    v = {"none": (None, None, None)}
    c, s = te.get_cpu_offload_context(True, k, n, True, False); v["te"] = (c, s, None)
    c, s = engine(k); v["engine"] = (c, s, None)
    c, s = engine(k, early_first_reload=True); v["engine_early"] = (c, s, None)
    c, s = engine(k); v["engine_noncontig"] = (c, s, "noncontig")
    c, s = engine(k); v["engine_te_rules"] = (c, s, "te_rules")
    return v
def step(ctx, sync, mode):
    x.grad = None
    for p in model.parameters(): p.grad = None
    RULES["mode"] = mode
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter(); e0.record()
    h = x; host_layers = []
    for l in layers:
        a = time.perf_counter()
        if ctx is None:
            h = l(h)
        else:
            with ctx:
                h = l(h)
            h = sync(h)
        host_layers.append((time.perf_counter() - a) * 1e3)
    e1.record(); t1 = time.perf_counter()
    h.float().square().mean().backward(); e2.record()
    torch.cuda.synchronize()
    RULES["mode"] = None
    return dict(step=e0.elapsed_time(e2), fwd=e0.elapsed_time(e1), bwd=e1.elapsed_time(e2), host_fwd=(t1 - t0) * 1e3,
                host_l0=host_layers[0], host_l1=host_layers[1], host_l5=host_layers[5],
                peak=torch.cuda.max_memory_allocated() - base)
res = {}
with te_path.offload_path():
    for k in (2, 4):
        vs = variants(k)
        for name, v in vs.items():
            for _ in range(3): step(*v)
        rows = {name: [] for name in vs}
        for r in range(ROUNDS):
            order = list(vs) if r % 2 == 0 else list(reversed(list(vs)))
            for name in order:
                rows[name].append(step(*vs[name]))
        summary = {}
        for name, rs in rows.items():
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            ctx = vs[name][0]
            off = None
            if ctx is not None and hasattr(ctx, "stats"):
                off = sum(s.offloaded_bytes for s in ctx.stats)
            med["offloaded_bytes"] = off
            if name != "none":
                med["vs_none"] = statistics.median(a["step"] / b["step"] - 1 for a, b in zip(rs, rows["none"]))
                med["vs_te"] = statistics.median(a["step"] / b["step"] - 1 for a, b in zip(rs, rows["te"]))
                med["fwd_vs_te_ms"] = statistics.median(a["fwd"] - b["fwd"] for a, b in zip(rs, rows["te"]))
                med["bwd_vs_te_ms"] = statistics.median(a["bwd"] - b["bwd"] for a, b in zip(rs, rows["te"]))
            summary[name] = med
            print(f"k={k} {name:17s} " + " ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                                                  for key, val in med.items()), flush=True)
        res[k] = {"summary": summary, "rows": rows}
        _free(*(v[0] for v in vs.values()))
print("skipped by TE's rules (engine would offload):")
for mode, d in skipped.items():
    for key in d: print(" ", mode, key)
json.dump({"results": {str(k): v for k, v in res.items()}, "skipped": {m: [list(map(str, key)) for key in d] for m, d in skipped.items()}},
          open(f"{OUT}/diag22.json", "w"))
