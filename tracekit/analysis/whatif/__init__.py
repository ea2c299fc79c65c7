"""What-if analysis: replay each step's dependency graph, with the slow parts made healthy.

``analyze(tables, heal=..., balance=...)`` returns a :class:`WhatIf`; ``saving(tables, ranks)``
is what healing some ranks would save per step (the stragglers headline quotes it).
"""

from tracekit.analysis.whatif.analysis import Scenario, WhatIf, analyze, parse_heal, saving
from tracekit.analysis.whatif.graph import StepGraph, WhatIfError

__all__ = ["Scenario", "StepGraph", "WhatIf", "WhatIfError", "analyze", "parse_heal", "saving"]
