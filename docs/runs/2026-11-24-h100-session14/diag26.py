"""Session 14 diagnostic (diag26): notebook 02's comparison model (TE's tutorial shape: 8 layers of Linear +
te.TransformerLayer, hidden 1024, sequence 1024, batch 8, bf16), k = 2, where the engine's step measured
longer than with TE's offload. Variants in turns (order reversed every other round), 30 rounds after 3 warm-ups:
none, te, engine (notebook 02's settings), engine with early_first_reload. Per step: step, forward and backward
ms (CUDA events), host ms of each layer's forward, peak above the step's start."""
import json, os, statistics, time
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.instruments.te_compare import TeModel, te_tutorial_model
import transformer_engine.pytorch as te
OUT = os.environ.get("OUT", "/tmp"); ROUNDS = 30; K = 2
size = TeModel(); N = size.layers; dev = torch.device("cuda")
model = te_tutorial_model(size, dev)
gen = torch.Generator(device="cpu").manual_seed(1)
x = torch.randn(size.batch, size.seq, size.hidden, generator=gen, dtype=torch.bfloat16).cuda().requires_grad_()
def step(ctx, sync):
    x.grad = None
    for p in model.parameters(): p.grad = None
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter(); e0.record(); h = x; hl = []
    for l in model:
        a = time.perf_counter()
        if ctx is None:
            h = l(h)
        else:
            with ctx:
                h = l(h)
            h = sync(h)
        hl.append((time.perf_counter() - a) * 1e3)
    e1.record(); t1 = time.perf_counter()
    h.float().square().mean().backward(); e2.record(); t2 = time.perf_counter()
    torch.cuda.synchronize()
    return dict(step=e0.elapsed_time(e2), fwd=e0.elapsed_time(e1), bwd=e1.elapsed_time(e2), host_fwd=(t1 - t0) * 1e3,
                host_bwd=(t2 - t1) * 1e3, host_layers=hl, peak=torch.cuda.max_memory_allocated() - base)
with te_path.offload_path():
    vs = {"none": (None, None)}
    vs["te"] = te.get_cpu_offload_context(True, K, N, True, False)
    vs["engine"] = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True)
    vs["engine_early"] = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True,
                                                 early_first_reload=True)
    for v in vs.values():
        for _ in range(3): step(*v)
    rows = {n: [] for n in vs}
    for r in range(ROUNDS):
        for n in (list(vs) if r % 2 == 0 else list(reversed(list(vs)))):
            rows[n].append(step(*vs[n]))
summary = {}
for n, rs in rows.items():
    med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "host_layers"}
    med["host_layer_ms_vs_none"] = [round(statistics.median(a["host_layers"][j] - b["host_layers"][j]
                                                             for a, b in zip(rs, rows["none"])), 3) for j in range(N)]
    for k in ("step", "fwd", "bwd", "host_fwd", "host_bwd"):
        med[f"{k}_vs_none_ms"] = statistics.median(a[k] - b[k] for a, b in zip(rs, rows["none"]))
    med["vs_none"] = statistics.median(a["step"] / b["step"] - 1 for a, b in zip(rs, rows["none"]))
    med["vs_te"] = statistics.median(a["step"] / b["step"] - 1 for a, b in zip(rs, rows["te"]))
    summary[n] = med
    print(f"{n:13s} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in med.items()), flush=True)
json.dump({"summary": summary, "rows": rows}, open(f"{OUT}/diag26.json", "w"))
