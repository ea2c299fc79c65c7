"""Reading untrusted pickles as plain data: the one room that does, and its one entry point.

- :func:`load` / :func:`loads`: a small pickle (a flight-recorder dump, a small snapshot) through
  the standard unpickler with a ``find_class`` that resolves no global (``safe``).
- :func:`read`: a large memory snapshot streamed opcode by opcode, the items of watched lists
  handed to callbacks in batches instead of kept (``stream``: pass 1, the scan; ``build``: pass 2
  in Python; ``_pickle_machine.c``: both passes in C, used when built).

Both refuse anything but plain data with :class:`UnsafePickleError` naming the file. Code outside
this package imports only from here.
"""

from __future__ import annotations

from tracekit.ingest.unpickle.safe import UnsafePickleError, load, loads
from tracekit.ingest.unpickle.stream import AVAILABLE, READER_ENV, OnItems, machine, read

__all__ = ["AVAILABLE", "READER_ENV", "OnItems", "UnsafePickleError", "load", "loads", "machine", "read"]
