"""Device kernels of flashattn-hopper, written in the CuTe DSL.

Installed as ``flashattn_hopper.kernels`` (never import a top-level ``kernels``). Importing this
package is cheap on purpose: it pulls in no DSL module, so the Python API can import the package
without paying for a DSL start-up. Import the kernel modules themselves where they are needed:

- ``fwd_sm80``: ``FlashFwdSm80``, the Ampere (sm80) FlashAttention-2 forward kernel.
- ``common``: device helpers shared by the kernels (online softmax, masks, block ranges, layouts).
"""
