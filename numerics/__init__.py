"""numerics: tell accumulation-order noise from bugs in parallel training, and find buffers that need FP32.

- ``reduction_order``: bit-exact models of how collectives add (gloo's ring, a canonical order).
- ``canonical_comm``: real collectives that follow the canonical order on any backend.
- ``gloo_selftest``: checks the models against real gloo collectives.
- ``compare``: bitwise comparison of named tensor collections (mismatches, ULPs, normwise error).
- ``precision``: BF16 vs FP32 gradient-buffer accumulation error and the "needs FP32" verdict.
- ``run_config``: the run's config values from its manifest, every derived size computed here (nothing
  is imported from the trainer); ``corpus``: the step's batches, their hashes, the dump's key formats.
- ``plan``: the accumulation plan (orders, dtypes, shards, buckets) derived from the run's config.
- ``reference_model``: the sequential reference that follows a plan bit for bit.
- ``activations``: forward activations reassembled from rank shards by the plan, and where they differ.
- ``check``: parallel run vs reference (``assert_parallel_matches_reference``), with a diagnosis.
- ``verdict``: bug or rounding order (the reference under alternative orders), rank/shard/stage locations.
- ``precision_experiment``: which of a run's buffers need FP32, measured over real steps and seeds.
- ``model_precision``: the FP32 verdict for a real model's gradient buffers.

See docs/numerics.md.
"""


def __getattr__(name: str):
    # ``numerics.assert_parallel_matches_reference(cfg)`` for tests, without importing torch on ``import numerics``
    if name in ("assert_parallel_matches_reference", "run_check", "check_run"):
        from numerics import check

        return getattr(check, name)
    raise AttributeError(f"module 'numerics' has no attribute {name!r}")
