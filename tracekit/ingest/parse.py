"""Parse one file of any format: hash, sniff, dispatch. Runs in worker threads; prints nothing."""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import duckdb
import pyarrow as pa
import xxhash

from tracekit.ingest import unpickle
from tracekit.ingest import limits
from tracekit.ingest import sniff as sn
from tracekit.ingest.common import IngestError, Parsed, arrow_schema

if TYPE_CHECKING:
    import polars as pl

OptableReader = Callable[[Path], "dict[str, pl.DataFrame]"]


@dataclass
class Outcome:
    path: Path
    status: str  # ok | failed | skipped | ignored
    format: str | None
    content_hash: str | None
    parsed: Parsed | None = None
    error: str | None = None
    seconds: float = 0.0


# ingest_log.content_hash: XXH3-128 of the file's raw bytes, written "xxh3_128:<hex>". It tells a
# file already ingested from a new one. It runs at about 10 GB/s where SHA-256 (hardware-assisted)
# took 40 ms of a 61 MB trace's 0.4 CPU-s; it is no defence against a collision crafted on purpose,
# which could at worst make ingest skip that file as already ingested.
HASH_PREFIX = "xxh3_128:"


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def hex_digest(hasher: "xxhash.xxh3_128") -> str:
    return HASH_PREFIX + hasher.hexdigest()


def content_hash(path: Path) -> str:
    h = new_hasher()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return hex_digest(h)


def _default_optable_reader(path: Path) -> "dict[str, pl.DataFrame]":
    try:
        from tracekit.ingest.optable import read_optable
    except ImportError:
        raise IngestError(f"{path}: op-table (parquet) reader tracekit.ingest.optable is not installed") from None
    return read_optable(path)


def _optable(path: Path, reader: OptableReader) -> Parsed:
    frames = reader(path)
    tables: dict[str, pa.Table] = {}
    for name, df in frames.items():
        sch = arrow_schema(name, without=("run_id",))
        try:
            t = df.drop("run_id", strict=False).to_arrow()
            tables[name] = pa.table([t.column(n).cast(sch.field(n).type) if n in t.column_names
                                     else pa.nulls(t.num_rows, sch.field(n).type) for n in sch.names],
                                    schema=sch)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as e:
            raise IngestError(f"{path}: op-table reader returned a bad {name!r} frame ({e})") from None
    return Parsed(format="optable", tables=tables, multi_rank=True)


def read_whole(path: Path) -> bytes:
    """A file that is parsed whole, within the limit max_loaded_bytes (about 60x in objects)."""
    limits.check(path, "max_loaded_bytes", path.stat().st_size, f"{path.stat().st_size:,} bytes to load whole")
    return path.read_bytes()


def parse_path(path: Path, format: str) -> Parsed:
    """Dispatch a sniffed file (other than Kineto and op tables) to its parser."""
    from tracekit.ingest import flight_recorder, memory_snapshot

    if format == sn.FR:
        return flight_recorder.parse(path)
    if format == sn.PICKLE:
        # Snapshots reach hundreds of MB: streamed, in bounded memory. A small pickle is loaded whole
        # by the C unpickler instead, 4-5x faster, into about 60x its size of Python objects.
        if path.stat().st_size > memory_snapshot.STREAM_ABOVE and memory_snapshot.looks_like_snapshot(path):
            return memory_snapshot.parse(path)
        obj = unpickle.loads(read_whole(path), str(path))
        if isinstance(obj, dict) and isinstance(obj.get("entries"), list):
            return flight_recorder.parse_dump(path, obj)
        if isinstance(obj, dict) and ("segments" in obj or "device_traces" in obj):
            return memory_snapshot.parse_snapshot(path, obj)
        raise IngestError(f"{path}: pickle is neither a flight-recorder dump nor a memory snapshot")
    raise IngestError(f"{path}: no parser for format {format!r}")


def run(path: Path, explicit: bool, known_hashes: frozenset[str], con: duckdb.DuckDBPyConnection,
        optable_reader: OptableReader | None = None) -> Outcome:
    """Everything a worker does for one file (``con``: its own cursor). Never raises for bad input:
    the Outcome says why."""
    t0 = time.perf_counter()
    fmt = digest = None
    try:
        if not path.is_file():
            raise IngestError(f"{path}: no such file")
        if known_hashes:  # content already in this run is skipped unread; else hash while parsing
            digest = content_hash(path)
            if digest in known_hashes:
                return Outcome(path, "skipped", None, digest, error="already ingested (same content)",
                               seconds=time.perf_counter() - t0)
        try:
            fmt = sn.sniff(path)
        except IngestError:
            if not explicit and not sn.looks_like_trace(path):
                return Outcome(path, "ignored", None, digest)
            raise
        if fmt in (sn.JSON, sn.UNKNOWN):
            if explicit or (fmt == sn.UNKNOWN and sn.looks_like_trace(path)):
                raise IngestError(f"{path}: not a recognized trace format (Kineto JSON, flight-recorder "
                                  "dump, memory snapshot or op-table parquet)")
            return Outcome(path, "ignored", fmt, digest)
        if fmt == sn.KINETO:
            from tracekit.ingest import kineto

            hasher = new_hasher()
            parsed = kineto.parse(path, con, hasher)
            digest = digest or hex_digest(hasher)
        else:
            digest = digest or content_hash(path)
            if fmt == sn.OPTABLE:
                parsed = _optable(path, optable_reader or _default_optable_reader)
            else:
                parsed = parse_path(path, fmt)
        return Outcome(path, "ok", parsed.format, digest, parsed, seconds=time.perf_counter() - t0)
    except (IngestError, pickle.UnpicklingError) as e:  # includes UnsafePickleError
        err = str(e)
    except MemoryError:
        err = f"{path}: out of memory while parsing"
    except Exception as e:  # noqa: BLE001 - a parser bug must not take the other files down
        err = f"{path}: unexpected {type(e).__name__} while parsing: {e}"
    return failed(path, fmt, digest, err, time.perf_counter() - t0)


def failed(path: Path, fmt: str | None, digest: str | None, error: str, seconds: float) -> Outcome:
    """A failed file's Outcome, with its content hash for ingest_log where the file can be read."""
    if digest is None and path.is_file():
        try:
            digest = content_hash(path)
        except OSError:
            pass
    return Outcome(path, "failed", fmt, digest, error=error, seconds=seconds)
