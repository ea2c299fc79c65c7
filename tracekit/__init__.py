"""tracekit: find the slow rank, the hang and the memory hog in 4D-parallel training jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracekit.topology import Coords, Layout, LayoutError

if TYPE_CHECKING:
    from pathlib import Path

    from tracekit.store import Store

__version__ = "0.1.0"

__all__ = ["Coords", "Layout", "LayoutError", "Store", "__version__", "open"]


def open(path: str | Path) -> Store:  # noqa: A001 - mirrors builtins.open on purpose
    """Open a tracekit store, a DuckDB file or a Parquet dataset directory; tables as polars DataFrames,
    ``.sql()`` for queries."""
    from tracekit.store import open as _open  # lazy: keeps `import tracekit` and the CLI light

    return _open(path)


def __getattr__(name: str) -> Any:
    if name == "Store":
        from tracekit.store import Store

        return Store
    raise AttributeError(name)
