"""tracekit: find the slow rank, the hang and the memory hog in 4D-parallel training jobs."""

from tracekit.topology import Coords, Layout, LayoutError

__version__ = "0.1.0"

__all__ = ["Coords", "Layout", "LayoutError", "__version__"]
