"""Named shape lists for the tests, each with its reason."""

# (seqlen_q, seqlen_k)
SEQLENS_FAST = [
    (1, 1),  # smallest problem: one query, one key
    (17, 17),  # odd, smaller than any tile
    (113, 203),  # seqlen_q != seqlen_k, both partial tiles
    (239, 1),  # causal: most rows see no key (out 0, lse -inf)
    (1, 239),  # one query against many keys
    (128, 128),  # exactly one tile
    (1023, 1024),  # long, partial last tile, bottom-right causal offset of 1
]
SEQLENS_SLOW = SEQLENS_FAST + [
    (256, 512),
    (2048, 2048),  # many n_blocks
    (1024, 1023),  # seqlen_q > seqlen_k by one: first row sees no key under causal
    (3131, 2),
]

# (nheads, nheads_k)
HEADS = [
    (4, 4),  # MHA
    (8, 2),  # GQA 4:1
    (6, 1),  # MQA
]

# Head dims: 64 and 128, the common ones, in the fast tier; the slow tier adds 96 (its own tile row on
# every kernel) and 8, 32, 80 (zero-padded in Python up to a row). 192 and 256 have their own tests.
HEAD_DIMS_FAST = [64, 128]
HEAD_DIMS_SLOW = [8, 32, 64, 80, 96, 128]
