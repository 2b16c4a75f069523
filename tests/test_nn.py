"""flashattn_hopper.nn.MultiheadAttention, autocast, and training a small GPT against PyTorch's SDPA.

GPU tier (default backend, and ``backend="sm80"`` through ``FLASHATTN_HOPPER_BACKEND``): the module
against the same weights run through an fp32 reference by the parity rule (dense and packed);
fp32 inputs under autocast; a 6-layer GPT (hidden 512, 8 query / 4 kv heads of 64, seqlen 1024)
trained 200 steps on a fixed synthetic corpus with our attention and with
``F.scaled_dot_product_attention`` from the same seed, losses within 1 % at every 20th step, dense
and packed (varlen vs padded SDPA with a block-diagonal mask), eager and compiled (fullgraph).
CPU tier: constructor checks and the rotary helpers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func
from flashattn_hopper.nn import MultiheadAttention, apply_rotary, packed_positions, rotary_cos_sin
from flashattn_hopper.testing import assert_close_to_ref, capture_cuda_graph


def test_constructor_checks_name_the_argument():
    with pytest.raises(ValueError, match="num_heads"):
        MultiheadAttention(512, 6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadAttention(512, 8, 3)


def test_packed_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert packed_positions(cu, 7).tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_rotary_preserves_norm_and_relative_angle():
    """Rotation by position: norms unchanged, and q_i . k_j depends only on i - j."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 64, generator=gen)
    cos, sin = rotary_cos_sin(torch.arange(16), 64, 10000.0)
    qs, ks = apply_rotary(q.expand(16, 1, 64), cos, sin), apply_rotary(k.expand(16, 1, 64), cos, sin)
    assert torch.allclose(qs.norm(dim=-1), q.norm(dim=-1).expand(16, 1), rtol=1e-5)
    dots = (qs[:, 0] @ ks[:, 0].T)
    assert torch.allclose(dots[5, 2], dots[13, 10], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- GPU tier


def _sdpa_attention(q, k, v, causal, mask=None):
    """(batch, seqlen, heads, d) attention by PyTorch's SDPA (GQA by repeating K/V heads)."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)


def _module_reference(module: MultiheadAttention, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    """The module's computation with SDPA in place of our kernel (fp32 throughout when ``upcast``)."""
    dtype = torch.float32 if upcast else x.dtype
    w_qkv, w_out = module.qkv.weight.to(dtype), module.out.weight.to(dtype)
    b, s, _ = x.shape
    qkv = (x.to(dtype) @ w_qkv.T).view(b, s, -1, module.head_dim)
    q, k, v = qkv.split([module.num_heads, module.num_kv_heads, module.num_kv_heads], dim=2)
    cos, sin = rotary_cos_sin(torch.arange(s, device=x.device), module.head_dim, module.rotary_base)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = _sdpa_attention(q, k, v, causal=True)
    return out.reshape(b, s, -1) @ w_out.T


@pytest.mark.gpu
def test_module_matches_reference_dense_and_packed():
    torch.manual_seed(0)
    module = MultiheadAttention(512, 8, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        ref, ref_pt = _module_reference(module, x, True), _module_reference(module, x, False)
        assert_close_to_ref("module out", module(x), ref, ref_pt)
        # Packed: the same two sequences back to back (positions restart at the second).
        assert_close_to_ref("packed module out", module(x.reshape(600, 512), cu, 300).view(2, 300, 512), ref, ref_pt)


@pytest.mark.gpu
def test_fp32_inputs_under_autocast_run_in_the_autocast_dtype():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 129, 4, 64, device="cuda", generator=gen) for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True))
    with pytest.raises(TypeError, match="float32"):
        flash_attn_func(q, k, v)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, deterministic: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = MultiheadAttention(width, heads, kv_heads, deterministic=deterministic)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attention(self, x, use_sdpa, cu_seqlens, max_seqlen):
        a = self.attn
        if not use_sdpa:
            return a(x, cu_seqlens, max_seqlen)
        # SDPA with the module's own weights and rotary: padded batch with a block-diagonal mask
        # for packed input (one row of sequences), else plain causal.
        packed = cu_seqlens is not None
        xb = x[None] if packed else x
        b, s, _ = xb.shape
        qkv = a.qkv(xb).view(b, s, -1, a.head_dim)
        q, k, v = qkv.split([a.num_heads, a.num_kv_heads, a.num_kv_heads], dim=2)
        positions = packed_positions(cu_seqlens, s) if packed else torch.arange(s, device=x.device)
        cos, sin = rotary_cos_sin(positions, a.head_dim, a.rotary_base)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = None
        if packed:
            seq = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(s, device=x.device), right=True)
            mask = (seq[:, None] == seq[None, :]) & torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = _sdpa_attention(q, k, v, causal=True, mask=mask)
        out = a.out(out.reshape(b, s, -1))
        return out[0] if packed else out

    def forward(self, x, use_sdpa=False, cu_seqlens=None, max_seqlen=None):
        x = x + self.attention(self.ln1(x), use_sdpa, cu_seqlens, max_seqlen)
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self, vocab=256, width=512, layers=6, heads=8, kv_heads=4, deterministic=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, heads, kv_heads, deterministic) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, use_sdpa=False, cu_seqlens=None, max_seqlen=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, use_sdpa, cu_seqlens, max_seqlen)
        return self.head(x)


def _corpus(batch: int, seqlen: int) -> torch.Tensor:
    """A fixed synthetic corpus a small model can learn only in part: repeats of 64 random motifs
    with half the tokens replaced by noise, so the loss settles well above zero (near zero, 1 % of
    the loss would be below the run-to-run noise of any two implementations)."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    motifs = torch.randint(0, 256, (64, 32), device="cuda", generator=gen)
    picks = torch.randint(0, 64, (batch, -(-seqlen // 32)), device="cuda", generator=gen)
    tokens = motifs[picks].reshape(batch, -1)[:, :seqlen]
    noise = torch.rand(batch, seqlen, device="cuda", generator=gen) < 0.5
    return torch.where(noise, torch.randint(0, 256, (batch, seqlen), device="cuda", generator=gen), tokens)


def _train(use_sdpa: bool, packed: bool, steps: int, compiled: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = _GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seqlen = 4, 1024
    data = _corpus(batch * 50, seqlen + 1)  # 50 batches, walked in order: no batch is memorized
    cu, max_len = None, None
    if packed:  # each row of 1024 tokens cut into sequences of 300, 500 and 224, packed into one row
        lens = [300, 500, 224] * batch
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        max_len = 500
    forward = torch.compile(model, fullgraph=True) if compiled else model
    losses = []
    for step in range(steps):
        rows = data[(step % 50) * batch:(step % 50 + 1) * batch]
        inputs, targets = rows[:, :-1], rows[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if packed:
                logits = forward(inputs.reshape(-1), use_sdpa, cu, max_len)
            else:
                logits = forward(inputs, use_sdpa)
            loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_gpt_trains_like_sdpa(packed):
    ours, sdpa = _train(False, packed, 200), _train(True, packed, 200)
    assert ours[-1] < 0.75 * ours[0], f"the model did not learn: {ours}"
    for i, (a, b) in enumerate(zip(ours, sdpa)):
        assert abs(a - b) <= 0.01 * b, f"loss at step {20 * i}: ours {a:.4f}, SDPA {b:.4f}\n{ours}\n{sdpa}"


@pytest.mark.gpu
def test_gpt_compiled_fullgraph_trains_like_eager():
    eager, compiled = _train(False, False, 41), _train(False, False, 41, compiled=True)
    for i, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a - b) <= 0.01 * b, f"loss at step {20 * i}: compiled {a:.4f}, eager {b:.4f}"


@pytest.mark.gpu
def test_training_step_replays_from_a_cuda_graph():
    """One whole training step (forward, backward, capturable AdamW) captured once after 3 warm-up
    steps and replayed 50 times gives the eager run's losses bit for bit (``deterministic=True``:
    else the backward's dQ atomics round differently from run to run, and a model that memorizes its
    one batch amplifies that); no host sync or foreign allocation breaks the capture."""
    data = _corpus(4, 1025)
    inputs, targets = data[:, :-1], data[:, 1:]

    def make():
        torch.manual_seed(0)
        model = _GPT(layers=2, deterministic=True).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def train_step(model, opt):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = F.cross_entropy(model(inputs).float().reshape(-1, 256), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    model, opt = make()
    eager = [train_step(model, opt).item() for _ in range(53)][3:]

    model, opt = make()
    graph, static_loss = capture_cuda_graph(lambda: train_step(model, opt), warmups=3)
    replayed = []
    for _ in range(50):
        graph.replay()
        replayed.append(static_loss.item())
    assert replayed == eager, f"replayed:\n{replayed}\neager:\n{eager}"
