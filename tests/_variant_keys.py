"""The kernel keys the compile-only tier builds (tests/_compile_variants.py, tests/test_compile_only.py)."""

import dataclasses


def variant_keys(spec, arch: str) -> list:
    """The keys users hit (``all_keys``) plus sm90 variants measured but not shipped that must keep
    compiling: clusters of 2 with K/V multicast on the other head dims' table tiles (hdim 64: 3 MMA
    warpgroups; 96/128: own sO; 192: sO in sQ's buffer; the hdim 256 row ships them, in all_keys), the
    in-kernel sink and (sm90) the in-kernel gate (and its skips of decayed work), the sm90 backward's trace key,
    one representative each."""
    keys = list(spec.all_keys(arch))
    if spec.kind == "fwd_sm90" and keys:
        clustered = [
            dataclasses.replace(spec._key(arch, "bf16", hdim, causal=False), cluster_m=2)
            for hdim in (64, 96, 128, 192, 256)
        ]
        keys += [key for key in clustered if key not in keys]
    if spec.kind in ("fwd_sm90", "fwd_sm80") and keys:
        # The learnable sink in the finalize (sinks.IN_KERNEL): one representative per arch's kernel.
        keys.append(dataclasses.replace(keys[0], sink=True, **spec.sink_key_overrides))
    if spec.kind == "fwd_sm90" and keys:
        # The gated log-decay bias in the scores (gate.IN_KERNEL, ``forward_with_gate``).
        # (dense causal hdim 128 and varlen causal: the bias's two views of its tensor, each as the
        # QK^T GEMM's extra k16 slice (long keys) and as fp32 rows added per score)
        # (launched after the gate's scan as its programmatic dependent where calls are: configs.fwd_gate_pdl)
        from flashattn_hopper import configs

        for varlen in (False, True):
            causal = next(key for key in keys if key.causal and key.head_dim == 128 and key.varlen == varlen)
            keys += [dataclasses.replace(causal, gate=True, gate_slice=in_gemm, pack_gqa=1, span_heads=False,
                                         gate_pdl=configs.fwd_gate_pdl(arch))
                     for in_gemm in (True, False)]
        # (the skips of decayed work, configs.FWD_SM90_GATE_SKIP_ZERO_PV (opt-in) and _DECAYED (on from 4k keys): the
        # dense slice key with both)
        dense_slice = next(key for key in keys if key.gate and key.gate_slice and not key.varlen)
        keys.append(dataclasses.replace(dense_slice, gate_skip_pv=True, gate_skip_decayed=True))
    if spec.kind == "bwd_sm90" and keys:
        # The opt-in debug trace (per-block clocks, every CTA's span) on the dense hdim-128 MHA table tile.
        dense = next(key for key in keys if key.kernel == "bwd_sm90" and key.head_dim == 128 and not key.gqa
                     and not key.varlen and not key.causal and not key.local and not key.softcap
                     and not key.deterministic and not key.gate and not key.dq_transposed)
        keys.append(dataclasses.replace(dense, trace=True))
    if spec.kind == "bwd_sm80" and keys:
        # The preprocess with a learnable sink's gradient parts (sinks.py's eager backward), dense and varlen.
        for varlen in (False, True):
            pre = next(key for key in keys if key.kernel == "bwd_pre_sm80" and key.head_dim == 128 and key.varlen == varlen)
            keys.append(dataclasses.replace(pre, sink=True))
    return keys
