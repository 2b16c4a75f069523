"""Device kernels of flashattn-hopper, written in the CuTe DSL.

Installed as ``flashattn_hopper.kernels`` (never import a top-level ``kernels``). Importing this
package is cheap on purpose: it pulls in no DSL module, so the Python API can import the package
without paying for a DSL start-up. Import the kernel modules themselves where they are needed:

- ``sm90``: the Hopper kernels (``sm90.fwd``: ``FlashFwdSm90``, the FA3 forward, with its role
  modules ``fwd_load``, ``fwd_epilogue``, ``fwd_scores``, ``fwd_steps``, ``fwd_tiles``, ``fwd_smem``,
  ``fwd_parts``, ``fwd_budget``; ``sm90.fwd_fp8``: ``FlashFwdSm90Fp8``, its e4m3 variant (V transposed in
  shared memory, per-tensor or per-block descales); ``sm90.bwd``: ``FlashBwdSm90``, the FA3 backward's main kernel for head dims up to
  128, and ``sm90.bwd_wide``: ``FlashBwdSm90Wide``, its variant for 192 and 256).
- ``sm80``: the Ampere kernels (``sm80.fwd``: ``FlashFwdSm80``, the FA2 forward; ``sm80.bwd``:
  ``FlashBwdSm80``, the FA2 backward's main kernel, with ``bwd_epilogue``). They run on Hopper too.
- ``triton``: the one Triton kernel (``fp8_quantize``: e4m3 quantization of q, k, v with the optional
  Hadamard transform, for ``flashattn_hopper.fp8.quantize_qkv`` on CUDA 16-bit inputs).
- ``common``: what both arches use: device helpers (online softmax, masks, block ranges, tile
  schedulers, seqlen info, layouts) and the backward's preprocess and postprocess kernels
  (``bwd_pre``, ``bwd_post``).
"""
