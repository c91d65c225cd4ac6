"""Session 10 (#16): why the engine's forward host time at k=2 is ~10 ms longer than TE's (prof20): ablations of
engine parts by monkeypatching (timing only) and the CUDA runtime calls' host time per forward (torch.profiler)."""
import time, statistics, sys, gc
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
from torch.profiler import profile, ProfilerActivity
from offload_examples.instruments.bench import MODELS, make_forward, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path, engine as E
from offload_examples.core.streams import Streams
from offload_examples import get_cpu_offload_context
dev = torch.device("cuda"); spec = MODELS["A"]; n = 20
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
def zero():
    x.grad = None
    for p in model.parameters(): p.grad = None
nf = make_forward("no offload", model, 0, dev)[0]
def none(x):
    with te_path.offload_path(): return nf(x)
def engine(**kw):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=n, device=dev, retain_pinned_cpu_buffers=True, **kw)
    return lambda x: _through(model, x, lambda i: ctx, sync)
orig_drop = E._StorageRecord.drop_device
def drop_no_query(self, capturing, views_left=True):  # no Event.query / record_stream (timing only)
    if self.device is None: return
    Streams.fence(self.home, self.offloaded, self.reloaded)
    self.device = None
    if self.original is not None and views_left: self.witness = E.version_witness(self.original)
    self.original = None
patches = {
    "engine": {},
    "engine, drop w/o query": {"drop": drop_no_query},
    "engine, no te switch": {"te": True},
    "engine, nothing copied (hooks only)": {"kw": {"min_offload_bytes": 2**40}},
}
def build(p):
    return engine(**p.get("kw", {}))
variants = {"none": none, "TE k=2": make_forward("transformer_engine", model, 2, dev)[0]}
for name, p in patches.items(): variants[name] = build(p)
def apply(name):
    p = patches.get(name, {})
    E._StorageRecord.drop_device = p.get("drop", orig_drop)
    te_path_on, te_path_off = te_path.switch_on, te_path.switch_off
    if p.get("te"):
        E.te_path.switch_on = E.te_path.switch_off = lambda: None
    return lambda: (setattr(E.te_path, "switch_on", te_path_on), setattr(E.te_path, "switch_off", te_path_off))
def fwd(name):
    undo = apply(name); f = variants[name]
    try:
        zero(); torch.cuda.synchronize(); t = time.perf_counter()
        h = (lambda: f(x))() if "no te switch" not in name else _on(f)
        th = (time.perf_counter() - t) * 1e3
        h.float().square().mean().backward(); torch.cuda.synchronize()
        return th, (time.perf_counter() - t) * 1e3
    finally:
        undo()
def _on(f):
    with te_path.offload_path(): return f(x)
for name in variants:
    for _ in range(3): fwd(name)
res = {k: [] for k in variants}
for r in range(12):
    for k in variants: res[k].append(fwd(k))
for k, v in res.items():
    print(f"{k:38s} host fwd {statistics.median(a for a, _ in v):6.1f} ms (q {sorted(a for a,_ in v)[3]:.1f}..{sorted(a for a,_ in v)[8]:.1f})  step {statistics.median(b for _, b in v):6.1f} ms")
# CUDA runtime calls on the host, per forward
for name in ("none", "engine", "TE k=2"):
    f = variants[name]
    zero(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            zero(); torch.cuda.synchronize()
            with torch.profiler.record_function("FWD"):
                h = f(x)
            h.float().square().mean().backward(); torch.cuda.synchronize()
    ka = prof.key_averages()
    rows = sorted((e for e in ka if e.key.startswith("cuda") or e.key.startswith("cu") or e.key in
                   ("aten::copy_", "aten::empty", "aten::record_stream", "aten::set_", "FWD", "aten::empty_strided")),
                  key=lambda e: -e.cpu_time_total)
    print(f"\n==== {name}: host time of runtime calls (3 steps, forward+backward)")
    for e in rows[:22]:
        print(f"  {e.key:42s} calls {e.count:6d}  cpu total {e.cpu_time_total/1e3:8.2f} ms  self {e.self_cpu_time_total/1e3:8.2f} ms")
print("PROF21 DONE")
