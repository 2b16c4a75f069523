"""torch.compile through our API: the custom ops (flashattn_hopper/ops.py), fullgraph, no graph breaks.

CPU tier: Dynamo traces ``flash_attn_func`` / ``flash_attn_varlen_func`` into one graph holding one
``flashattn_hopper.fwd`` node (the backend records the graph and stops before anything runs), and
the fake implementations give the eager path's shapes. GPU tier: ``torch.library.opcheck`` of both
ops, and a compiled block (``fullgraph=True``) whose outputs and gradients equal eager bit for bit
(the same kernels run in both).
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func, ops


class _Stop(Exception):
    pass


def _traced_ops(fn, *args) -> list[str]:
    """The call_function targets of the one graph Dynamo makes of ``fn(*args)`` (fullgraph: a graph
    break raises instead)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        raise _Stop

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert isinstance(info.value, _Stop) or isinstance(info.value.__cause__, _Stop) or "_Stop" in repr(info.value), (
        f"Dynamo failed before the backend: {info.value!r}"
    )
    assert len(graphs) == 1
    return graphs[0]


def _dense(batch=2, s_q=17, s_k=33, h=4, h_k=2, d=64, d_v=64):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, s_q, h, d, generator=gen, dtype=torch.bfloat16),
            torch.randn(batch, s_k, h_k, d, generator=gen, dtype=torch.bfloat16),
            torch.randn(batch, s_k, h_k, d_v, generator=gen, dtype=torch.bfloat16))


def test_compile_traces_dense_call_as_one_op():
    def block(q, k, v):
        return flash_attn_func(q * 2, k, v, causal=True, window_size=(64, 0), softcap=5.0).float().sum()

    targets = _traced_ops(block, *_dense())
    assert targets.count("flashattn_hopper.fwd") == 1, targets


def test_compile_traces_varlen_call_as_one_op():
    q, k, v = (t.flatten(0, 1) for t in _dense(s_q=33))
    cu = torch.tensor([0, 10, 33, 66], dtype=torch.int32)

    def block(q, k, v, cu):
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True, return_lse=True)
        return out.float().sum() + lse.sum()

    targets = _traced_ops(block, q, k, v, cu)
    assert targets.count("flashattn_hopper.fwd") == 1, targets


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_traces_chunked_call_as_one_op(varlen):
    """attention_chunk: the chunk segments are built with tensor ops inside the graph (no host sync,
    no graph break) around the one varlen op."""
    q, k, v = _dense(s_q=33)
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 10, 33, 66], dtype=torch.int32)

        def block(q, k, v, cu):
            return flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True, attention_chunk=16).float().sum()

        targets = _traced_ops(block, q, k, v, cu)
    else:
        def block(q, k, v):
            out, lse = flash_attn_func(q, k, v, causal=True, attention_chunk=16, return_lse=True)
            return out.float().sum() + lse.sum()

        targets = _traced_ops(block, q, k, v)
    assert targets.count("flashattn_hopper.fwd") == 1, targets


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fake_shapes_follow_v_and_the_lse_layout(varlen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = _dense(d_v=128)
        cu = None
        if varlen:
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            cu = torch.zeros(3, dtype=torch.int32)
        out, lse = torch.ops.flashattn_hopper.fwd(q, k, v, cu, cu, None, None, None, True, -1, 0, 0.0, False, None)
        dq, dk, dv = torch.ops.flashattn_hopper.bwd(
            out, q, k, v, out, lse, cu, cu, None, None, None, True, -1, 0, 0.0, False, None
        )
    assert out.shape == (*q.shape[:-1], 128) and out.dtype == q.dtype
    assert lse.dtype == torch.float32
    assert lse.shape == ((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_registered_autograd_under_fake_tensors():
    """The op's autograd (setup_context, backward through the bwd op) runs on fake tensors: the
    gradients have q, k, v's shapes and the LSE is not differentiable, as in eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (t.requires_grad_() for t in _dense())
        out, lse = torch.ops.flashattn_hopper.fwd(q, k, v, None, None, None, None, None, True, -1, 0, 0.0, False, None)
        assert out.requires_grad and not lse.requires_grad
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---------------------------------------------------------------- GPU tier


def _cuda(*tensors, grad=False):
    return tuple(t.cuda().requires_grad_(grad) for t in tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_ops_pass_opcheck(varlen):
    q, k, v = _cuda(*_dense(), grad=True)
    cu = None
    if varlen:
        q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 17, 34], dtype=torch.int32, device="cuda")
        k, v = (t[:34].detach().requires_grad_() for t in (k, v))
    args = (q, k, v, cu, cu, None, None, None, True, -1, 0, 0.0, False, None)
    torch.library.opcheck(torch.ops.flashattn_hopper.fwd.default, args)
    out, lse = torch.ops.flashattn_hopper.fwd(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), cu, cu, None, None,
                None, True, -1, 0, 0.0, False, None)
    torch.library.opcheck(torch.ops.flashattn_hopper.bwd.default, bwd_args)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compiled_attention_matches_eager_bitwise(varlen):
    """Attention over a fused qkv projection's head split (strided q, k, v; GQA; causal) compiled with
    fullgraph=True: out and the gradient of qkv equal eager's bit for bit (the same kernels run;
    ``deterministic=True``, else the backward's dQ atomics differ from run to run)."""
    batch, seqlen, h, h_k, d = 2, 257, 8, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(batch, seqlen, h + 2 * h_k, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(batch, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, 100, 257, 400, 514], dtype=torch.int32, device="cuda")

    def attention(qkv):
        q, k, v = qkv.split([h, h_k, h_k], dim=2)
        if varlen:
            q, k, v = (t.reshape(batch * seqlen, -1, d) for t in (q, k, v))
            return flash_attn_varlen_func(q, k, v, cu, cu, 157, 157, causal=True, deterministic=True).view(
                batch, seqlen, h, d
            )
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    results = []
    torch._dynamo.reset()
    for fn in (attention, torch.compile(attention, fullgraph=True)):
        x = qkv.clone().requires_grad_()
        out = fn(x)
        (dx,) = torch.autograd.grad(out, (x,), dout)
        results.append((out.detach(), dx))
    (out_eager, dx_eager), (out_compiled, dx_compiled) = results
    assert not torch.isnan(out_eager).any() and not torch.isnan(dx_eager).any()
    assert torch.equal(out_compiled, out_eager), "out: compiled differs from eager"
    assert torch.equal(dx_compiled, dx_eager), "dqkv: compiled differs from eager"


def test_compile_traces_fp8_calls_as_one_op():
    """e4m3 inputs (the FP8 forward, fp8.py) trace to one ``flashattn_hopper.fwd_fp8`` node, dense and varlen,
    and its fake gives bf16 out and the fp32 LSE in the API's layouts."""
    e4m3 = torch.float8_e4m3fn
    q, k, v = (t.to(e4m3) for t in _dense())
    scale = torch.ones(2, 2)

    def dense(q, k, v, scale):
        return flash_attn_func(q, k, v, causal=True, q_descale=scale, k_descale=scale, v_descale=scale).float().sum()

    assert _traced_ops(dense, q, k, v, scale).count("flashattn_hopper.fwd_fp8") == 1
    qv, kv, vv = (t.flatten(0, 1) for t in (q, k, v))
    cu_q = torch.tensor([0, 10, 34], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 66], dtype=torch.int32)

    def packed(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 24, 36).float().sum()

    assert _traced_ops(packed, qv, kv, vv, cu_q, cu_k).count("flashattn_hopper.fwd_fp8") == 1
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fq, fk, fv = (torch.empty(t.shape, dtype=e4m3) for t in (q, k, v))
        out, lse = torch.ops.flashattn_hopper.fwd_fp8(fq, fk, fv, None, None, None, None, None, None, None, None,
                                                      None, None, False, -1, -1, None)
        assert out.dtype == torch.bfloat16 and out.shape == (*q.shape[:-1], v.shape[-1])
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
