import warnings, torch
from torch import nn
from offload_examples import get_cpu_offload_context
CPU = torch.device("cpu"); warnings.simplefilter("ignore")
def run(layer0, n=2):
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True); w = nn.Parameter(torch.randn(16, 16))
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=n, device=CPU, min_offload_bytes=0)
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            with ctx: h = layer0(x, w)
            h = sync(h)
            with ctx: h = h * 3
            sync(h).sum().backward()
    except Exception as e:
        return f"RAISES {type(e).__name__}: {str(e)[:50]}"
    s = ctx.stats[0]
    return f"kept={s.kept_tensors} offloaded={s.offloaded_tensors} bytes={s.offloaded_bytes} held={s.held_bytes} warn={[str(m.message)[:40] for m in ws]}"
# F1: a frozen Parameter a module keeps, written in place from an activation (e.g. a cache registered as a Parameter)
class Cache(nn.Module):
    def __init__(s): super().__init__(); s.buf = nn.Parameter(torch.zeros(8, 16), requires_grad=False)
cache = Cache()
def f1(x, w):
    cache.buf.copy_(torch.tanh(x @ w))      # buf: a Parameter with grad_fn CopyBackwards
    return cache.buf * x                    # saves buf
print("F1 frozen Parameter written in place :", run(f1))
class MyP(nn.Parameter): pass
sub = MyP(torch.zeros(8, 16), requires_grad=False)
def f1b(x, w):
    sub.copy_(torch.tanh(x @ w)); return sub * x
print("F1b same, Parameter subclass          :", run(f1b))
# F2: a custom Function whose ctx has an attribute named `variable`
class Var(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a): ctx.variable = a.detach(); return a * 2
    @staticmethod
    def backward(ctx, g): return g * 2
def f2(x, w):
    return Var.apply(x @ w).double().sin().float()   # sin saves the float64 cast of Var's output
print("F2 ctx.variable                      :", run(f2))
# F3: a sparse activation saved for backward
def f3(x, w):
    return torch.sparse.mm(torch.relu(x @ w).to_sparse(), w)
print("F3 sparse activation                 :", run(f3))
