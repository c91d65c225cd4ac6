"""Launch pipeline-dist (nccl) as notebook 03 does, from a parent that holds GPU 0 like the kernel."""
import os, subprocess, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
from offload_examples.instruments.models import import_transformer_engine
import_transformer_engine()
import torch
mode, out = sys.argv[1], sys.argv[2]
keep = []
if mode != "none":
    keep.append(torch.zeros(1, device="cuda"))
if mode == "memory":
    keep.append(torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda"))
    keep.append(torch.empty(2 * 2**30, dtype=torch.uint8, pin_memory=True))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item()
torch.cuda.synchronize()
args = [sys.executable, "-m", "offload_examples", "pipeline-dist", "--backend", "nccl", "--json", out]
p = subprocess.run(args, capture_output=True, text=True, timeout=300)
print(p.returncode, p.stdout[-1500:], p.stderr[-800:] if p.returncode else "")
