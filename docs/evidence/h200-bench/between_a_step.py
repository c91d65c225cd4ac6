"""Where the per-layer graphed step's time goes, plain against the engine (copies between the replays):
GPU timelines of whole steps taken in turns (the step's lead before layer 0, each forward, the loss and each
backward, the copies out's start/end and speed); and the host's wait at every release against at the last only
against none, each timed against the plain graphs in turns. Writes between_a_step.json to $OUT."""
import json, os, statistics
import transformer_engine.pytorch  # noqa: F401  before CUDA
import torch
from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.features import graphs as G
from offload_examples.features.graphs import make_graphed_layers
from offload_examples.instruments.bandwidth import link_bandwidth
from offload_examples.instruments.bench.grid import MODELS
from offload_examples.instruments.bench.protocol import _paired
from offload_examples.instruments.bench.strategies import _step, _through
from offload_examples.instruments.measure import measure_paired, _zero_grads
from offload_examples.instruments.models import build_basic_model

N, SEQ, K = 20, 2048, 2
spec, dev, out = MODELS["A"], torch.device("cuda", 0), {}
say = lambda *a: print(*a, flush=True)
dump = lambda: json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "between_a_step.json"), "w"), indent=1)
ev = lambda: torch.cuda.Event(enable_timing=True)
med = lambda xs: statistics.median(xs)
mode, copy_marks = {"m": "every"}, {}


def after(self, i):
    if i in self.copies:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            s = self.stream.record_event(ev())
            for device, host in self.copies[i]:
                host.copy_(device, non_blocking=True)
            self.ends[i] = self.stream.record_event(ev())
        copy_marks[i] = (s, self.ends[i], sum(d.numel() for d, _ in self.copies[i]))
    last = i == max(self.waits) if self.waits else True
    if mode["m"] == "every" or (mode["m"] == "last" and last):
        for end in self.releasing:
            end.synchronize()
    self.releasing = []


G._CopiesBetween.after = after


def timeline(model, layers, x):
    """One step as _timed takes it, with events between the replays and in the backward."""
    _zero_grads(model, x)
    torch.cuda.synchronize()
    copy_marks.clear()
    begin, marks, back = ev(), [], {}
    begin.record()
    h = x
    for i, layer in enumerate(layers):
        marks.append(ev()); marks[-1].record()
        h = layer(h)
        if i < N - 1:
            h.register_hook(lambda g, i=i: back.setdefault(i, ev()).record())
    marks.append(ev()); marks[-1].record()
    h.float().square().mean().backward()
    end = ev(); end.record(); end.synchronize()
    t = lambda e: begin.elapsed_time(e)
    r = {"step": t(end), "lead": t(marks[0]), "fwd": [marks[i].elapsed_time(marks[i + 1]) for i in range(N)]}
    bounds = [marks[N]] + [back[i] for i in range(N - 2, -1, -1)] + [end]  # backward of N-1 (with loss) .. 0
    r["bwd"] = [bounds[j].elapsed_time(bounds[j + 1]) for j in range(N)][::-1]
    r["fwd_start"] = [t(m) for m in marks]
    r["copies"] = {i: {"start": t(s), "end": t(e), "gbps": nb / s.elapsed_time(e) / 1e6}
                   for i, (s, e, nb) in copy_marks.items()}
    return r


with te_path.offload_path():
    out["link"] = link_bandwidth()
    say("link", out["link"])
    model = build_basic_model(N, spec.hidden, spec.heads, spec.ffn, device=dev, dtype=torch.bfloat16, kind=spec.kind,
                              seed=0, activation=spec.activation, dropout=spec.dropout)
    x = torch.randn(spec.batch, SEQ, spec.hidden, generator=torch.Generator().manual_seed(1),
                    dtype=torch.bfloat16).to(dev).requires_grad_()
    plain_l = make_graphed_layers(list(model), x, *get_cpu_offload_context(enabled=False), backend="te")
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=N, device=dev,
                                        retain_pinned_cpu_buffers=True)
    eng_l = make_graphed_layers(list(model), x, ctx, sync, backend="te")
    for _ in range(3):
        timeline(model, plain_l, x), timeline(model, eng_l, x)
    tl = {"plain": [], "engine": []}
    for r in range(20):
        for name in (("plain", "engine") if r % 2 == 0 else ("engine", "plain")):
            tl[name].append(timeline(model, plain_l if name == "plain" else eng_l, x))
    for name, rs in tl.items():
        s = {"step": med([r["step"] for r in rs]), "lead": med([r["lead"] for r in rs]),
             "fwd": [med([r["fwd"][i] for r in rs]) for i in range(N)],
             "bwd": [med([r["bwd"][i] for r in rs]) for i in range(N)],
             "fwd_start": [med([r["fwd_start"][i] for r in rs]) for i in range(N + 1)]}
        if name == "engine":
            s["copies"] = {i: {k: med([r["copies"][i][k] for r in rs]) for k in ("start", "end", "gbps")}
                           for i in rs[0]["copies"]}
        s["sum_fwd"], s["sum_bwd"] = sum(s["fwd"]), sum(s["bwd"])
        out["timeline_" + name] = s
        say(f"{name}: step {s['step']:.2f} lead {s['lead']:.2f} fwd {s['sum_fwd']:.2f} bwd {s['sum_bwd']:.2f} "
            f"rest {s['step'] - s['lead'] - s['sum_fwd'] - s['sum_bwd']:.2f}; fwd spans "
            + " ".join(f"{v:.2f}" for v in s["fwd"]) + "; bwd spans " + " ".join(f"{v:.2f}" for v in s["bwd"]))
        if "copies" in s:
            say("  copies", s["copies"], "fwd18 start", s["fwd_start"][18], "fwd19 start", s["fwd_start"][19])
    dump()
    fp, fe = (lambda h: _through(plain_l, h)), (lambda h: _through(eng_l, h))
    for m in ("every", "last", "none", "every"):
        mode["m"] = m
        meas, ref = measure_paired(model, x, _step(fp, x), _step(fe, x), label=m, steps=24, warmup=4)
        p = _paired(meas, ref)
        out.setdefault("sync_" + m, []).append(p)
        say(f"host sync {m}: {p['ratio']:+.2%} q {p['quartiles'][0]:+.2%}..{p['quartiles'][1]:+.2%} "
            f"{p['reference_ms']:.1f} -> {p['candidate_ms']:.1f} ms")
        dump()
