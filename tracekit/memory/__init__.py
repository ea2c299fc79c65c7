"""Memory: the 4D memory estimator (``estimate``, ``llama_dims``), its application to a reference
trainer run (``trainer``), and the ``tracekit estimate`` / ``tracekit memory`` commands. The
analysis of measured snapshots is tracekit.analysis.memory."""
