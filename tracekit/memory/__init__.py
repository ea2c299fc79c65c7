"""Memory: the 4D memory estimator (``estimate``, ``llama_dims``), its application to a reference
trainer run (``trainer``) and its comparison with a measured run (``compare``); the ``tracekit estimate``
/ ``tracekit memory`` commands are in tracekit.cli. The analysis of measured snapshots is
tracekit.analysis.memory."""
