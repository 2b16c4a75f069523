"""Hopper (sm90) kernels: TMA + WGMMA, warp-specialized. ``fwd``: the FA3 forward and its role modules."""
