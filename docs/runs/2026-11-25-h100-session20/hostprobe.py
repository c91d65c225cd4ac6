"""#16 probe: where the engine's host time goes in the offloaded layers of model A (TE layers), k = 2.

Per layer host time of the forward (perf_counter around each layer, no sync), for the plain step (TE's
offload path), the engine and TE's offload, in turns; inside the engine, time in each entry point.
"""
import json, os, statistics, sys, time, gc
from offload_examples.instruments.models import import_transformer_engine, build_basic_model
import_transformer_engine()
import torch
import transformer_engine.pytorch as te
from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.core.engine import OffloadEngine

N, K, STEPS = 20, 2, 15
model = build_basic_model(N, 1024, 8, 4096, device="cuda", dtype=torch.bfloat16, kind="te")
x = torch.randn(16, 2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
acc = {}
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            d = time.perf_counter() - t
            s = acc.setdefault(name, [0.0, 0]); s[0] += d; s[1] += 1
    return wrapper

eng, eng_sync = get_cpu_offload_context(True, K, N, retain_pinned_cpu_buffers=True)
eng._pack = timed("pack", eng._pack)
for name in ("_start_offload", "_release", "_run_actions", "_new_iteration", "_copy_out", "_record_for"):
    setattr(eng, name, timed(name, getattr(eng, name)))
tctx, tsync = te.get_cpu_offload_context(True, K, N, True, False)

def step(kind, layer_ms):
    model.zero_grad(set_to_none=True); x.grad = None
    h = x
    for i, layer in enumerate(model):
        t = time.perf_counter()
        if kind == "none":
            with te_path.offload_path():
                h = layer(h)
        elif kind == "engine":
            with eng:
                h = layer(h)
            h = eng_sync(h)
        else:
            with tctx:
                h = layer(h)
            h = tsync(h)
        layer_ms[i] += (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    h.float().sum().backward()
    bwd_host = time.perf_counter() - t
    torch.cuda.synchronize()
    return bwd_host

kinds = ["none", "engine", "te"]
for k in kinds:
    for _ in range(3): step(k, [0.0] * N)
gc.collect(); gc.freeze()
per = {k: [0.0] * N for k in kinds}
steps_ms = {k: [] for k in kinds}
for r in range(STEPS):
    for k in (kinds if r % 2 == 0 else kinds[::-1]):
        if k == "engine": acc.clear() if r == 0 else None
        t = time.perf_counter(); step(k, per[k]); steps_ms[k].append((time.perf_counter() - t) * 1e3)
out = {"layer_host_ms": {k: [v / STEPS for v in per[k]] for k in kinds},
       "step_ms_median": {k: statistics.median(v) for k, v in steps_ms.items()},
       "engine_calls": {k: {"total_ms_per_step": v[0] / (STEPS - 0) * 1e3, "calls_per_step": v[1] / STEPS} for k, v in acc.items()},
       "saved_tensors": [s.saved_tensors for s in eng.stats], "kept": [s.kept_tensors for s in eng.stats],
       "offloaded_storages": [len(r) for r in eng._records]}
for k in kinds:
    L = out["layer_host_ms"][k]
    print(f"{k:7s} step {out['step_ms_median'][k]:.1f} ms  host fwd layers0-1 {L[0]+L[1]:.2f}  2-17 {sum(L[2:18]):.2f}  18-19 {L[18]+L[19]:.2f}  total {sum(L):.2f}")
print(json.dumps(out["engine_calls"], indent=1))
print("saved tensors per layer", out["saved_tensors"][:3], "kept", out["kept"][:3], "storages", out["offloaded_storages"][:3])
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/hostprobe.json", "w"), indent=1)
