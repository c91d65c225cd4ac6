"""How fast the copies out of per-layer graphs run beside a step, and what slows them.

Model A of the benchmark (20 Transformer Engine layers, hidden 1024, 16 x 2048 tokens, bf16), per-layer graphs
(``make_graphed_layers``, ``backend="te"``) without offloading and with the engine at k = 2 and
``copies_out="between"``, its layers' own copies and waits turned off here. The 2.16 GB those layers copy out
(layers 0 and 1's storages, from the graphs' memory into their host buffers) are copied on a side stream,
timed with CUDA events, beside: a step through either set of graphs (forward, then the backward launched at
once); the same with the host asleep 60 ms between the forward and the backward; a forward through the plain
graphs followed by a queued graph holding a 256 MB host-to-device copy, or by a queued eager one; one and two
forwards alone. Writes copies_beside_a_step.json (ms and GB/s of each, median of 3 after one) to $OUT."""
import json, os, statistics, time
import transformer_engine.pytorch  # noqa: F401  before CUDA
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.features import graphs as G
from offload_examples.features.graphs import make_graphed_layers
from offload_examples.instruments.bench.grid import MODELS
from offload_examples.instruments.models import build_basic_model

N, SEQ = 20, 2048
spec, dev, out = MODELS["A"], torch.device("cuda", 0), {}
say = lambda *a: print(*a, flush=True)
dump = lambda: json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "copies_beside_a_step.json"), "w"),
                         indent=1)
ev = lambda: torch.cuda.Event(enable_timing=True)
G._CopiesBetween.after = lambda self, i: None
G._CopiesBetween.before = lambda self, i: None
with te_path.offload_path():
    model = build_basic_model(N, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                              seed=0, activation=spec.activation, dropout=spec.dropout)
    x = torch.randn(spec.batch, SEQ, spec.hidden, generator=torch.Generator().manual_seed(1),
                    dtype=torch.bfloat16).to(dev).requires_grad_()
    plain_l = make_graphed_layers(list(model), x, *get_cpu_offload_context(enabled=False), backend="te")
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=N, device=dev,
                                        retain_pinned_cpu_buffers=True)
    between_l = make_graphed_layers(list(model), x, ctx, sync, backend="te", copies_out="between")
    items = [it for v in between_l[0].copies.copies.values() for it in v]
    nbytes = sum(d.numel() for d, h in items)
    side = torch.cuda.Stream()
    hsrc = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    ddst = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    g = torch.cuda.CUDAGraph()
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        ddst.copy_(hsrc, non_blocking=True)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        ddst.copy_(hsrc, non_blocking=True)
    torch.cuda.synchronize()
    def fwd(layers):
        x.grad = None
        h = x
        for l in layers:
            h = l(h)
        return h.float().square().mean()
    def beside(work, label, repeats=4):
        ts = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            s, e = ev(), ev()
            with torch.cuda.stream(side):
                s.record()
                for d, h in items:
                    h.copy_(d, non_blocking=True)
                e.record()
            work()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        ms = statistics.median(ts[1:])
        out[label] = {"ms": ms, "gb_s": nbytes / ms / 1e6}
        say(label, out[label])
        dump()
    beside(lambda: fwd(between_l).backward(), "between: forward, backward")
    beside(lambda: fwd(plain_l).backward(), "plain: forward, backward")
    def slept(layers):
        loss = fwd(layers); time.sleep(0.06); loss.backward()
    beside(lambda: slept(between_l), "between: forward, host asleep 60 ms, backward")
    beside(lambda: slept(plain_l), "plain: forward, host asleep 60 ms, backward")
    def fwd_then(after):
        loss = fwd(plain_l); after(); return loss
    beside(lambda: fwd_then(g.replay), "plain forward, then a graph with a 256 MB H2D node queued")
    beside(lambda: fwd_then(lambda: ddst.copy_(hsrc, non_blocking=True)),
           "plain forward, then an eager 256 MB H2D queued")
    def fwd_then_sleep(after):
        loss = fwd(plain_l); time.sleep(0.06); after(); return loss
    beside(lambda: fwd_then_sleep(g.replay), "plain forward, host asleep 60 ms, graph H2D")
    # a forward alone, once and twice (forward with the autograd graph kept until the copies end)
    beside(lambda: fwd(between_l), "between: forward only")
    beside(lambda: [fwd(between_l) for _ in range(2)], "between: 2 forwards")
