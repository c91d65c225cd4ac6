"""Session 11 diagnostic (#17): where does the step-to-step spread of model A with TE layers come from?
Runs 60 no-offload steps of the planner bench's model (N=12, TE layers, the offload path) and prints the
spread of the step time and of the host time of the forward, in one configuration given on the command
line: plain, with the garbage collector off, or (run under ``taskset``) on fewer cores."""
import gc, json, statistics, sys, time
from offload_examples.instruments.models import import_transformer_engine
TE = import_transformer_engine()
import torch
from offload_examples.instruments.bench import MODELS, _through
from offload_examples.instruments.models import build_basic_model
from offload_examples.core import te_path
label = sys.argv[1]
dev = torch.device("cuda"); spec = MODELS["A"]; n = 12
model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                          seed=0, activation=spec.activation, dropout=spec.dropout)
layers = list(model)
x = torch.randn(spec.batch, 2048, spec.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
if "nogc" in label:
    gc.collect(); gc.disable()
def step():
    x.grad = None
    for p in model.parameters(): p.grad = None
    torch.cuda.synchronize(); t0 = time.perf_counter()
    h = _through(layers, x); t1 = time.perf_counter()
    h.float().square().mean().backward(); t2 = time.perf_counter(); torch.cuda.synchronize(); t3 = time.perf_counter()
    return (t3 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3
with te_path.offload_path():
    for _ in range(5): step()
    res = [step() for _ in range(60)]
def q(v):
    v = sorted(v); return f"median {statistics.median(v):6.1f}  q1 {v[15]:6.1f}  q3 {v[45]:6.1f}  min {v[0]:6.1f}  max {v[-1]:6.1f}"
import os
print(f"{label:12s} cores {len(os.sched_getaffinity(0)):2d} step     {q([r[0] for r in res])}")
print(f"{label:12s} cores {len(os.sched_getaffinity(0)):2d} host fwd {q([r[1] for r in res])}")
print(f"{label:12s} cores {len(os.sched_getaffinity(0)):2d} host bwd {q([r[2] for r in res])}")
json.dump(res, open(f"{os.environ.get('OUT', '/tmp')}/diag20_{label}.json", "w"))
