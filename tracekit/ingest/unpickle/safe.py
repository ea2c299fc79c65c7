"""Load pickles from untrusted files without running their code.

Flight-recorder dumps and memory snapshots are pickles, and ``pickle.load`` on a pickle executes
whatever callable it names. This unpickler resolves no global at all: a pickle made only of plain
data (dict, list, tuple, str, bytes, int, float, bool, None, set) loads; the few constructors
older protocols use for sets and bytes are mapped to safe equivalents; anything else that names a
class or function (``os.system``, ``torch.Tensor``, ...) is rejected with :class:`UnsafePickleError`
before it can be called. Large memory snapshots are read by ``stream`` (this package) instead, which
walks the opcodes itself under the same rule (and refuses even these constructors).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global (class or function); it was not loaded."""


# The only globals a plain-data pickle needs: older protocols build sets and bytes by calling these.
# Each turns data into data; none can reach the file system, a subprocess or an import.
_DATA_CONSTRUCTORS = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): lambda *a: _bytearray(*a),
    ("_codecs", "encode"): lambda s, enc="utf-8": s.encode(enc) if enc in ("latin1", "latin-1", "utf-8") else _no(enc),
}


def _bytearray(source: object = b"", *rest: object) -> bytearray:
    """bytearray of data only (as large as the data, which is in the file): ``bytearray(1_500_000_000)``,
    36 bytes of pickle, would allocate and zero 1.5 GB before anything could refuse it."""
    if isinstance(source, (int, float)) or not isinstance(source, (bytes, bytearray, str, list, tuple)):
        raise UnsafePickleError(f"pickle calls bytearray({type(source).__name__}); only bytearray of data "
                                "(bytes, str or a list of ints) is accepted")
    return bytearray(source, *rest)  # type: ignore[arg-type]


def _no(enc: str) -> bytes:
    raise UnsafePickleError(f"pickle asks for codec {enc!r}; refused")


class _PlainDataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        key = ("builtins" if module == "__builtin__" else module, name)  # protocol 2 writes py2 names
        if key in _DATA_CONSTRUCTORS:
            return _DATA_CONSTRUCTORS[key]
        raise UnsafePickleError(
            f"{self._source}: pickle refers to {module}.{name}; only plain data "
            "(dict, list, tuple, str, bytes, numbers, bool, None) is accepted"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: pickle uses persistent ids; refused")


def loads(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle plain data from ``data``; ``source`` names it in errors."""
    try:
        return _PlainDataUnpickler(io.BytesIO(data), source).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, TypeError,
            AttributeError, MemoryError, OverflowError, KeyError) as e:
        raise pickle.UnpicklingError(f"{source}: corrupt or truncated pickle ({e})") from None


def load(path: str | Path) -> Any:
    """Unpickle plain data from the file at ``path``."""
    p = Path(path)
    return loads(p.read_bytes(), str(p))
