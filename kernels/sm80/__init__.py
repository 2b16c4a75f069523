"""Ampere (sm80) kernels: cp.async + mma.sync (FA2). ``fwd``, ``bwd``: the forward and the backward main kernel
(they also run on Hopper)."""
