"""Model A-torch's step without offloading in a fresh process, with Transformer Engine imported first or not.

``python attention_with_te.py plain|te``: prints the median of 10 steps, which attention backends PyTorch
may use and the cuDNN it finds, and the twelve kernels that took the most time in one profiled step.
"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1]
if mode == "te":  # Transformer Engine loads its own CUDA libraries, cuDNN among them, when imported
    from offload_examples.instruments.models import import_transformer_engine
    print("te imported:", import_transformer_engine())
import torch
from torch.profiler import ProfilerActivity, profile

from offload_examples.instruments.bench import strategies
from offload_examples.instruments.measure import measure_steps
from offload_examples.instruments.models import build_basic_model

dev = torch.device("cuda")
model = build_basic_model(20, 1024, 8, 4096, device=dev, dtype=torch.bfloat16, kind="torch", seed=0)
gen = torch.Generator(device="cpu").manual_seed(1)
x = torch.randn(16, 2048, 1024, generator=gen, dtype=torch.bfloat16).to(dev).requires_grad_()
forward, _ = strategies.make_forward("no offload", model, 0, dev)
step = strategies._step(forward, x)
m = measure_steps(model, x, step=step, steps=10, warmup=2)
print(mode, "median ms", round(m.median_ms, 2), "all", [round(t, 1) for t in m.step_ms])
try:
    cudnn = torch.backends.cudnn.version()
except RuntimeError as err:  # a cuDNN other than the one PyTorch was built with
    cudnn = str(err)[:120]
print("cudnn", cudnn, "flash", torch.backends.cuda.flash_sdp_enabled(),
      "mem_eff", torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn_sdp", torch.backends.cuda.cudnn_sdp_enabled(),
      "math", torch.backends.cuda.math_sdp_enabled())
with profile(activities=[ProfilerActivity.CUDA]) as p:
    step()
    torch.cuda.synchronize()
rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in p.key_averages()), key=lambda r: -r[1])[:12]
for key, ms, count in rows:
    print(f"  {ms:8.2f} ms  x{count:4d}  {key[:110]}")
m2 = measure_steps(model, x, step=step, steps=10, warmup=1)
print(mode, "again median ms", round(m2.median_ms, 2))
