"""One module per kernel family: how to key, compile and launch it (the kernels live in kernels/).

Interface every family implements (see ``common.FwdFamily`` / ``common.BwdFamily``):
``can_implement(problem) -> reason | None``, ``all_keys(arch)``, ``compile(key, options=None)``
(fake tensors: no GPU needed) and ``forward(...)`` / ``backward(...)`` that launch on the inputs'
device and current stream.
"""
