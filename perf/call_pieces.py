"""Host time of one flash_attn_func call on a tiny problem, split by piece (needs a GPU).

    python perf/call_pieces.py

The kernel itself is microseconds here, so the wall time per call is the Python/launch path.
"""
import cProfile
import io
import pstats
import time

import torch
from flashattn_hopper import flash_attn_func, validate, dispatch
from flashattn_hopper.backends import common
from flashattn_hopper.jit import target_arch, compile_cache

q, k, v = (torch.randn(2, 16, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
for _ in range(20):
    flash_attn_func(q, k, v)
torch.cuda.synchronize()

def per_call(fn, n=500):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6

p = validate.validate_dense(q, k, v, None, False, (-1, -1), 0.0)
fam = dispatch.fwd_kernel_for(q.device, None, p)
key = fam.key(p, target_arch(), None) if fam.backend == "sm90" else fam.key(p, target_arch())
compiled = compile_cache.get(key, fam.compile)
out = torch.empty_like(q); lse = torch.empty(2, 2, 16, device="cuda")
cts = [common.to_cute(t) for t in (q, k, v, out, lse)]
stream = common.current_stream(q.device)
# window_left, window_right, softcap, the family's own arguments (sm90: CTA count, tile counter, gate), varlen
extra = (0, 0, 1.0, *fam.extra_args(key, q.device), None, None, None, None)
print("backend", fam.backend)
print(f"full flash_attn_func          {per_call(lambda: flash_attn_func(q, k, v)):8.1f} us")
print(f"  causal                      {per_call(lambda: flash_attn_func(q, k, v, causal=True)):8.1f} us")
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
dout = torch.randn_like(q)
print(f"  forward + backward          {per_call(lambda: flash_attn_func(qg, kg, vg).backward(dout), n=200):8.1f} us")
print(f"validate_dense                {per_call(lambda: validate.validate_dense(q, k, v, None, False, (-1, -1), 0.0)):8.1f} us")
print(f"fwd_kernel_for (dispatch)     {per_call(lambda: dispatch.fwd_kernel_for(q.device, None, p)):8.1f} us")
print(f"target_arch                   {per_call(target_arch):8.1f} us")
print(f"compile_cache.get             {per_call(lambda: compile_cache.get(key, fam.compile)):8.1f} us")
print(f"to_cute x5                    {per_call(lambda: [common.to_cute(t) for t in (q, k, v, out, lse)]):8.1f} us")
print(f"current_stream                {per_call(lambda: common.current_stream(q.device)):8.1f} us")
print(f"compiled(pre-converted)       {per_call(lambda: compiled(*cts, 0.1, *extra, stream)):8.1f} us")
# the launch path's ready-made arguments (kernel_arg), through the DSL's call and through common.launch
ready = (*cts, *(common.kernel_arg(x) for x in (0.1, *extra[:-4])), *(common.kernel_arg(None) for _ in range(4)), stream)
print(f"compiled(ready args)          {per_call(lambda: compiled(*ready)):8.1f} us")
print(f"launch(compiled, ready args)  {per_call(lambda: common.launch(compiled, *ready)):8.1f} us")
print(f"family.key                    {per_call(lambda: fam.key(p, target_arch(), None)):8.1f} us")
print(f"family.extra_args             {per_call(lambda: fam.extra_args(key, q.device)):8.1f} us")
print(f"torch.empty x2 (out, lse)     {per_call(lambda: (torch.empty_like(q), torch.empty(2, 2, 16, device=q.device))):8.1f} us")
print(f"launch_forward (keyed)        {per_call(lambda: common.launch_forward(compiled, key, q, k, v, p, None, None, None, fam.extra_args(key, q.device))):8.1f} us")
print(f"family.forward                {per_call(lambda: fam.forward(q, k, v, p, None)):8.1f} us")
print(f"torch.cuda.device ctx         {per_call(lambda: torch.cuda.device(q.device).__enter__()):8.1f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(300):
    flash_attn_func(q, k, v)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-6000:])
