"""Training step of a GPT block stack with each attention implementation, same run (not a test).

    python perf/train_step.py [--layers 4] [--hidden 2048] [--heads 16] [--kv-heads 4] [--seqlen 8192]
                              [--batch 2] [--steps 20] [--rounds 3] [--compile] [--impls ours ours_sm90 cudnn fa4]

Issues 22 and 23: a step of a 4-layer stack (hidden 2048, 16 query / 4 kv heads of 128, seqlen 8192,
batch 2, causal, AdamW) with our attention against cuDNN SDPA and FA4. Each implementation gets its
own copy of the same model (same seed): pre-norm blocks of rotary GQA attention (fused qkv, output
projection) and a 4x GELU MLP, bf16 weights, fused AdamW, loss = mean square of the stack's output
(no embedding or LM head: the step is the blocks). Only the attention core differs:

- ``ours``: ``flash_attn_func`` with no backend (what a user gets: on Hopper the sm90 forward and,
  the sm90 backward where it takes the problem, else the sm80 one);
- ``ours_sm90``: ``backend="sm90"`` (forward and backward on the Hopper kernels);
- ``cudnn``: ``scaled_dot_product_attention`` pinned to CUDNN_ATTENTION on (b, h, s, d) views, GQA by
  ``enable_gqa`` (or k/v repeated where the backend refuses it: said in the output);
- ``fa4``: FA4's ``flash_attn.cute.flash_attn_func`` when its benchmark-only wheels are installed.

Timing: CUDA events around ``--steps`` steps after 3 warm-up steps, ms per step; ``--rounds``
rounds interleave the implementations (round r starts at implementation r) and the table shows
each one's median round. ``--compile``: ``torch.compile`` of the model (fullgraph for ours).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn

from flashattn_hopper.nn import apply_rotary, rotary_cos_sin


def attention_impls(names: list[str]) -> dict:
    """name -> attention core ``(q, k, v) -> out`` on ``(batch, seqlen, heads, head_dim)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn_hopper import flash_attn_func

    def cudnn(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            try:
                out = sdpa(qt, kt, vt, is_causal=True, enable_gqa=True)
            except RuntimeError:
                group = q.shape[2] // k.shape[2]
                print("note: cuDNN refused enable_gqa; k/v repeated", file=sys.stderr)
                out = sdpa(qt, kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1), is_causal=True)
        return out.transpose(1, 2)

    impls = {
        "ours": lambda q, k, v: flash_attn_func(q, k, v, causal=True),
        "ours_sm90": lambda q, k, v: flash_attn_func(q, k, v, causal=True, backend="sm90"),
        "cudnn": cudnn,
    }
    if "fa4" in names:
        try:
            from flash_attn.cute import flash_attn_func as fa4  # type: ignore[import-not-found]

            def fa4_core(q, k, v):
                out = fa4(q, k, v, causal=True)
                return out[0] if isinstance(out, tuple) else out

            impls["fa4"] = fa4_core
        except Exception as e:  # benchmark-only peer: absent is fine
            print(f"note: FA4 not available ({type(e).__name__}: {e})", file=sys.stderr)
    return {name: impls[name] for name in names if name in impls}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, core) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.core = heads, kv_heads, hidden // heads, core
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = x + self.proj(self.core(q, k, v).reshape(b, s, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, core) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, core) for _ in range(layers))
        self.head_dim = hidden // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_cos_sin(torch.arange(x.shape[1], device=x.device), self.head_dim, 10000.0)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--impls", nargs="+", default=["ours", "ours_sm90", "cudnn", "fa4"])
    args = ap.parse_args(argv)

    impls = attention_impls(args.impls)
    x = torch.randn(args.batch, args.seqlen, args.hidden, dtype=torch.bfloat16, device="cuda")
    runs = {}
    for name, core in impls.items():
        torch.manual_seed(0)
        model = Stack(args.layers, args.hidden, args.heads, args.kv_heads, core).to("cuda", torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fwd = torch.compile(model, fullgraph=name.startswith("ours")) if args.compile else model

        def step(fwd=fwd, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = fwd(x).float().square().mean()
            loss.backward()
            opt.step()
            return loss

        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            runs[name] = step
        except Exception as e:  # one broken implementation must not hide the others
            print(f"note: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)

    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                runs[name]()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / args.steps)

    print(f"# training step, {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, "
          f"seqlen {args.seqlen}, batch {args.batch}, causal, bf16, AdamW, compile={args.compile}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    best_peer = min((statistics.median(times[n]) for n in names if n in ("cudnn", "fa4")), default=None)
    print("| attention | ms/step (median of rounds) | rounds | vs the faster peer |")
    print("|---|---|---|---|")
    for name in names:
        ms = statistics.median(times[name])
        ratio = f"{best_peer / ms:.2f}x" if best_peer is not None else "-"
        print(f"| {name} | {ms:.1f} | {' / '.join(f'{t:.1f}' for t in times[name])} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
