"""Triton kernels (imported only where used: Triton is not needed to import the package)."""
