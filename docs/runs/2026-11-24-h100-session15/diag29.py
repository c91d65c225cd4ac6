"""Session 15 diagnostic (diag29): the engine before and after the leaner pack hook (56f4006), against
Transformer Engine's offload, in one process. Model A (Linear + te.TransformerLayer), N = 20, k = 2 and 4, all on
TE's offload path. Variants take turns step by step in balanced orders (each follows every other equally often):
  none; te (get_cpu_offload_context(True, k, N, True, False)); engine (this commit, bench settings:
  retain_pinned_cpu_buffers=True); engine_old (the engine of dfe2136, imported as oe_old_core, same settings).
Per step: step / forward / backward ms (CUDA events), host ms of each layer's forward, peak above the step's start.
Medians over rounds of the paired differences (step ratio, forward and backward ms) against te and none."""
import json, os, statistics, sys, time
sys.path.insert(0, "/tmp/old")  # oe_old_core: offload_examples/core of dfe2136
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.instruments.bench import MODELS, _free
from offload_examples.instruments.measure import balanced_orders
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
from oe_old_core.api import get_cpu_offload_context as old_context
import transformer_engine.pytorch as te
OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", "32"))
N = int(os.environ.get("N", "20"))
dev = torch.device("cuda"); spec = MODELS["A"]
model = build_basic_model(N, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)

def step(ctx, sync):
    x.grad = None
    for p in model.parameters(): p.grad = None
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
    return dict(step=e0.elapsed_time(e2), fwd=e0.elapsed_time(e1), bwd=e1.elapsed_time(e2), host_fwd=(t1 - t0) * 1e3,
                host_layers=host_layers, peak=torch.cuda.max_memory_allocated() - base)

res = {}
with te_path.offload_path():
    for K in (2, 4):
        vs = {"none": (None, None)}
        vs["te"] = te.get_cpu_offload_context(True, K, N, True, False)
        vs["engine"] = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, device=dev,
                                               retain_pinned_cpu_buffers=True)
        vs["engine_old"] = old_context(enabled=True, num_layers=K, model_layers=N, device=dev,
                                       retain_pinned_cpu_buffers=True)
        names = list(vs)
        for name in names:
            for _ in range(3): step(*vs[name])
        rows = {name: [] for name in names}
        orders = balanced_orders(len(names))
        for r in range(ROUNDS):
            for i in orders[r % len(orders)]:
                rows[names[i]].append(step(*vs[names[i]]))
        summary = {}
        for name, rs in rows.items():
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "host_layers"}
            med["host_offloaded_layers_ms"] = statistics.median(sum(r["host_layers"][:K]) for r in rs)
            med["host_middle_layers_ms"] = statistics.median(sum(r["host_layers"][K:N - K]) for r in rs)
            med["host_last_layers_ms"] = statistics.median(sum(r["host_layers"][N - K:]) for r in rs)
            ctx = vs[name][0]
            med["offloaded_bytes"] = sum(s.offloaded_bytes for s in ctx.stats) if hasattr(ctx, "stats") else None
            if name != "none":
                for ref in ("none", "te", "engine_old"):
                    if ref == name:
                        continue
                    pairs = list(zip(rs, rows[ref]))
                    ratios = sorted(a["step"] / b["step"] - 1 for a, b in pairs)
                    med[f"vs_{ref}"] = statistics.median(ratios)
                    med[f"vs_{ref}_quartiles"] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
                    med[f"fwd_vs_{ref}_ms"] = statistics.median(a["fwd"] - b["fwd"] for a, b in pairs)
                    med[f"bwd_vs_{ref}_ms"] = statistics.median(a["bwd"] - b["bwd"] for a, b in pairs)
                    parts = {"offloaded": range(K), "middle": range(K, N - K), "last": range(N - K, N)}
                    for part, idx in parts.items():
                        med[f"host_{part}_layers_vs_{ref}_ms"] = statistics.median(
                            sum(a["host_layers"][i] for i in idx) - sum(b["host_layers"][i] for i in idx) for a, b in pairs)
            summary[name] = med
            print(f"k={K} {name:11s} " + " ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                                                  for key, val in med.items()), flush=True)
        res[f"k{K}"] = {"summary": summary, "rows": rows, "orders": orders}
        _free(*(v[0] for v in vs.values()))
        del vs
        torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/diag29.json", "w"))
