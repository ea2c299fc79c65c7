"""numerics: tell accumulation-order noise from bugs in parallel training, and find buffers that need FP32.

- ``reduction_order``: bit-exact models of how collectives add (gloo's ring, a canonical order).
- ``canonical_comm``: real collectives that follow the canonical order on any backend.
- ``gloo_selftest``: checks the models against real gloo collectives.
- ``compare``: bitwise comparison of named tensor collections (mismatches, ULPs, normwise error).
- ``precision``: BF16 vs FP32 gradient-buffer accumulation error and the "needs FP32" verdict.
"""
