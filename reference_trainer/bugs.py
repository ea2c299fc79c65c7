"""Known bugs the trainer can plant on purpose (``--plant-bug``), so a numerics check can prove it
tells a real bug from accumulation-order noise. Each is a small, localized edit guarded by ``active``:

- ``cp-chunk``: CP rank i takes sequence chunk 2cp-2-i instead of 2cp-1-i (one chunk twice, one never).
- ``tp-bwd-reduce``: the TP gather before the MLP skips the reduce-scatter of its gradient in backward
  (each TP rank keeps only its own partial input gradient).
- ``dp-double-scale``: the DP x CP-reduced gradient is divided by dp*cp although the loss is already
  normalized by the tokens of the whole step (a doubly averaged gradient).
- ``doc-mask-off-by-one``: the document mask looks up a key's document one position to the right, so
  the eos closing a document is attended by the next document's tokens.
"""

from __future__ import annotations

BUGS = ("cp-chunk", "tp-bwd-reduce", "dp-double-scale", "doc-mask-off-by-one")

_active = ""  # one process = one rank; set from the config when the model is built


def set_active(name: str) -> None:
    global _active
    if name and name not in BUGS:
        raise ValueError(f"unknown planted bug {name!r}; expected one of {BUGS}")
    _active = name


def active(name: str) -> bool:
    return _active == name
