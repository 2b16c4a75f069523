"""What both arches use: device helpers and the backward's pre/post kernels.

- ``utils``: layout and fragment helpers (swizzled smem atoms, accumulator views, paired
  fp32 -> 16-bit conversion, copy predicates, stride alignment assumptions).
- ``gemm_sm80``: warp-level ``mma.sync`` GEMMs fed by ``ldmatrix``.
- ``softmax``: the online softmax (running row max / row sum, exp2 with the scale folded in).
- ``mask``: element masks for the key-length bound and causal (window-ready) masking.
- ``block_info``: which key blocks an m_block visits and which of them need masking.

- ``bwd_pre`` / ``bwd_post``: the backward's preprocess (dPsum, LSE in log2 units, zeroed dQ
  accumulator) and postprocess (dQ and GQA dK/dV out of fp32 accumulators) kernels.

Every module imports the DSL, so import them where needed, not from here.
"""
