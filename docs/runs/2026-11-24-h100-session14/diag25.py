"""Session 14 diagnostic (diag25): why the forward of the layers that are NOT offloaded runs slower under offloading.
Model A (Linear + te.TransformerLayer), N=20 (the bench's), k=2; in diag23 (N=12) a non-offloaded layer's host time was
3.08 ms without offloading, 3.50 with TE's offload and 3.97 with the engine, and the forward is launch bound.
Variants, round robin step by step (order reversed every other round), all on TE's offload path:
  none; te; engine (bench settings); engine_1mib (min_offload_bytes=1 MiB);
  none_dma: no offloading, but at the end of layers 0 and 1 the same bytes as the engine offloads from them are copied
            device-to-host (15 chunks a layer, pinned buffers made beforehand) on a side stream: the copies alone;
  none_dma_late: the same copies queued after the forward (during the backward) instead.
Per step: step/forward/backward ms (CUDA events), host ms of every layer's forward, peak above the step's start,
device allocations (cudaMalloc) made during the step."""
import json, os, statistics, time
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.instruments.bench import MODELS, _free
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
import transformer_engine.pytorch as te
OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", "30"))
N = int(os.environ.get("N", "20")); K = 2
dev = torch.device("cuda"); spec = MODELS["A"]
model = build_basic_model(N, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
side = torch.cuda.Stream()
DMA = {}  # layer -> (device source, pinned host, chunks)
def eng(**kw):
    return get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, device=dev,
                                   retain_pinned_cpu_buffers=True, **kw)
def queue_dma(j):
    src, host, chunks = DMA[j]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for a, b in chunks:
            host[a:b].copy_(src[a:b], non_blocking=True)
def step(ctx, sync, mode):
    x.grad = None
    for p in model.parameters(): p.grad = None
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    allocs0 = torch.cuda.memory_stats().get("num_device_alloc", 0)
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter(); e0.record()
    h = x; host_layers = []
    for j, l in enumerate(layers):
        a = time.perf_counter()
        if ctx is None:
            h = l(h)
            if mode == "dma" and j in DMA:
                queue_dma(j)
        else:
            with ctx:
                h = l(h)
            h = sync(h)
        host_layers.append((time.perf_counter() - a) * 1e3)
    e1.record(); t1 = time.perf_counter()
    if mode == "dma_late":
        for j in DMA: queue_dma(j)
    h.float().square().mean().backward(); e2.record()
    torch.cuda.synchronize()
    return dict(step=e0.elapsed_time(e2), fwd=e0.elapsed_time(e1), bwd=e1.elapsed_time(e2), host_fwd=(t1 - t0) * 1e3,
                host_layers=host_layers, peak=torch.cuda.max_memory_allocated() - base,
                device_allocs=torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs0)
res = {}
with te_path.offload_path():
    vs = {"none": (None, None, None)}
    c, s = te.get_cpu_offload_context(True, K, N, True, False); vs["te"] = (c, s, None)
    vs["engine"] = (*eng(), None)
    vs["engine_1mib"] = (*eng(min_offload_bytes=2 ** 20), None)
    for _ in range(3): step(*vs["engine"])
    per_layer = [vs["engine"][0].stats[j].offloaded_bytes for j in range(K)]
    storages = [vs["engine"][0].stats[j].offloaded_storages for j in range(K)]
    for j, nb in enumerate(per_layer):
        n = storages[j]; size = nb // n
        DMA[j] = (torch.empty(nb, dtype=torch.uint8, device=dev), torch.empty(nb, dtype=torch.uint8, pin_memory=True),
                  [(i * size, nb if i == n - 1 else (i + 1) * size) for i in range(n)])
    vs["none_dma"] = (None, None, "dma"); vs["none_dma_late"] = (None, None, "dma_late")
    for name, v in vs.items():
        for _ in range(3): step(*v)
    rows = {name: [] for name in vs}
    for r in range(ROUNDS):
        order = list(vs) if r % 2 == 0 else list(reversed(list(vs)))
        for name in order:
            rows[name].append(step(*vs[name]))
    summary = {}
    for name, rs in rows.items():
        med = {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "host_layers"}
        med["host_layer_ms"] = [round(statistics.median(r["host_layers"][j] for r in rs), 3) for j in range(N)]
        ctx = vs[name][0]
        med["offloaded_bytes"] = sum(s.offloaded_bytes for s in ctx.stats) if hasattr(ctx, "stats") else None
        med["offloaded_storages"] = [s.offloaded_storages for s in ctx.stats[:K]] if hasattr(ctx, "stats") else None
        if name != "none":
            for ref in ("none", "te"):
                med[f"vs_{ref}"] = statistics.median(a["step"] / b["step"] - 1 for a, b in zip(rs, rows[ref]))
                med[f"fwd_vs_{ref}_ms"] = statistics.median(a["fwd"] - b["fwd"] for a, b in zip(rs, rows[ref]))
                med[f"bwd_vs_{ref}_ms"] = statistics.median(a["bwd"] - b["bwd"] for a, b in zip(rs, rows[ref]))
        summary[name] = med
        print(f"{name:14s} " + " ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                                         for key, val in med.items()), flush=True)
    res = {"summary": summary, "rows": rows, "dma_bytes": per_layer, "dma_chunks": storages}
    _free(*(v[0] for v in vs.values()))
json.dump(res, open(f"{OUT}/diag25.json", "w"))
