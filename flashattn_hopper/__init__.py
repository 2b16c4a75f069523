"""flashattn_hopper: FlashAttention-3-class exact attention for NVIDIA Hopper, with an FA2 path for Ampere.

Kernels are written in the CuTe DSL, JIT-compiled at first use and cached in memory and on disk.
"""

from .api import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
__version__ = "0.1.0"
