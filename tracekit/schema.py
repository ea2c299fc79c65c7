"""The store's tables, as data: one place that names every table, column and type.

Ingest writes these tables, analyses read them, users query them with plain SQL. Times are integer
nanoseconds on the rank's own clock (epoch ns where the source gives it); ``ranks.clock_offset_ns``
is what to subtract to put a rank on the common clock. Columns that a source cannot fill are NULL.
"""

from __future__ import annotations

TABLES: dict[str, list[tuple[str, str]]] = {
    "runs": [
        ("run_id", "VARCHAR"),
        ("source", "VARCHAR"),  # trainer | kineto | wia | fr | snapshot | mixed
        ("root", "VARCHAR"),  # path the run was ingested from
        ("world_size", "INTEGER"),
        ("tp", "INTEGER"),
        ("cp", "INTEGER"),
        ("pp", "INTEGER"),
        ("dp", "INTEGER"),
        ("layout_source", "VARCHAR"),  # manifest | group-names | group-structure | wia-meta | unknown
        ("backend", "VARCHAR"),
        ("manifest", "JSON"),  # the trainer's manifest (config, ground truth), verbatim
        ("ingested_at", "TIMESTAMP"),
    ],
    "ranks": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("dp", "INTEGER"),
        ("pp", "INTEGER"),
        ("cp", "INTEGER"),
        ("tp", "INTEGER"),
        ("host", "VARCHAR"),
        ("pid", "BIGINT"),
        ("clock_offset_ns", "BIGINT"),
    ],
    "groups": [
        ("run_id", "VARCHAR"),
        ("pg_name", "VARCHAR"),
        ("pg_desc", "VARCHAR"),
        ("dim", "VARCHAR"),  # tp | cp | pp | dp | dp_cp | ... | world | other
        ("ranks", "INTEGER[]"),  # global ranks in group-local order
        ("size", "INTEGER"),
    ],
    "events": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("ts_ns", "BIGINT"),
        ("dur_ns", "BIGINT"),
        ("kind", "VARCHAR"),  # cpu_op | user_annotation | kernel | runtime | memcpy | memset | compute | comm
        ("name", "VARCHAR"),
        ("tid", "VARCHAR"),  # thread id, or GPU stream
        ("step", "INTEGER"),
        ("phase", "VARCHAR"),  # fwd | bwd | opt | NULL
        ("vstage", "INTEGER"),  # virtual pipeline stage (trainer, op tables)
        ("microbatch", "INTEGER"),
        ("correlation", "BIGINT"),
        ("is_comm", "BOOLEAN"),
    ],
    "collectives": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("pg_name", "VARCHAR"),
        ("seq", "BIGINT"),  # per-group sequence number; matches an instance across ranks
        ("op", "VARCHAR"),  # all_reduce | all_gather | reduce_scatter | broadcast | barrier | ...
        ("start_ns", "BIGINT"),
        ("end_ns", "BIGINT"),
        ("nbytes", "BIGINT"),
        ("dtype", "VARCHAR"),
        ("step", "INTEGER"),
        ("source", "VARCHAR"),  # kernel | gloo | annotation | fr | wia
    ],
    "p2p": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("peer", "INTEGER"),
        ("direction", "VARCHAR"),  # send | recv
        ("pg_name", "VARCHAR"),
        ("seq", "BIGINT"),
        ("start_ns", "BIGINT"),
        ("end_ns", "BIGINT"),
        ("nbytes", "BIGINT"),
        ("step", "INTEGER"),
        ("microbatch", "INTEGER"),
        ("source", "VARCHAR"),
    ],
    "steps": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("step", "INTEGER"),
        ("start_ns", "BIGINT"),
        ("end_ns", "BIGINT"),
    ],
    "memory_events": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("seq", "BIGINT"),  # order within the rank's trace
        ("ts_ns", "BIGINT"),
        ("action", "VARCHAR"),  # alloc | free_requested | free_completed | segment_alloc | ...
        ("addr", "BIGINT"),
        ("size", "BIGINT"),
        ("stream", "BIGINT"),
        ("category", "VARCHAR"),  # parameter | gradient | optimizer_state | activation | ... | NULL
        ("frame", "VARCHAR"),  # top user frame, 'file:line:function'
        # the allocation's Python stack, innermost first, one 'file:line:function' a line (bounded:
        # memory_frames.STACK_FRAMES frames); NULL where the recorder kept no stack
        ("frames", "VARCHAR"),
    ],
    "memory_segments": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("address", "BIGINT"),
        ("total_size", "BIGINT"),
        ("allocated_size", "BIGINT"),
        ("active_size", "BIGINT"),
        ("requested_size", "BIGINT"),
        ("stream", "BIGINT"),
        ("segment_type", "VARCHAR"),
        ("blocks", "INTEGER"),
    ],
    "memory_blocks": [  # the allocator's blocks when the snapshot was taken (the end of the trace)
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("segment_address", "BIGINT"),
        ("address", "BIGINT"),
        ("size", "BIGINT"),
        ("requested_size", "BIGINT"),
        ("state", "VARCHAR"),  # active_allocated | active_pending_free | inactive
        ("category", "VARCHAR"),  # set by CPU-derived snapshots (parameter, gradient, ...); NULL from CUDA
        ("frame", "VARCHAR"),  # top user frame of the allocation
        ("frames", "VARCHAR"),  # its stack, as memory_events.frames
    ],
    "fr_entries": [
        ("run_id", "VARCHAR"),
        ("rank", "INTEGER"),
        ("record_id", "BIGINT"),
        ("pg_name", "VARCHAR"),
        ("pg_desc", "VARCHAR"),
        ("collective_seq_id", "BIGINT"),
        ("p2p_seq_id", "BIGINT"),
        ("op_id", "BIGINT"),
        ("is_p2p", "BOOLEAN"),
        ("profiling_name", "VARCHAR"),
        ("input_sizes", "JSON"),
        ("input_dtypes", "JSON"),
        ("output_sizes", "JSON"),
        ("output_dtypes", "JSON"),
        ("time_created_ns", "BIGINT"),
        ("time_started_ns", "BIGINT"),
        ("time_completed_ns", "BIGINT"),
        ("duration_ms", "DOUBLE"),
        ("state", "VARCHAR"),
        ("retired", "BOOLEAN"),
        ("timeout_ms", "BIGINT"),
        ("frames", "JSON"),
    ],
    # What each ingested file says about its run's topology, kept so that the run's runs, ranks and
    # groups rows are recomputed from the store alone: a re-run after a crash, which skips the files
    # already in, then gives what a clean ingest gives (tests/test_ingest_crash.py).
    "file_meta": [
        ("run_id", "VARCHAR"),
        ("path", "VARCHAR"),
        ("rank", "INTEGER"),
        ("world_size", "INTEGER"),
        ("backend", "VARCHAR"),
        ("pid", "BIGINT"),
        ("groups", "JSON"),  # [{pg_name, pg_desc, ranks}]
    ],
    "ingest_log": [
        ("run_id", "VARCHAR"),
        ("path", "VARCHAR"),
        ("format", "VARCHAR"),
        ("rank", "INTEGER"),
        ("content_hash", "VARCHAR"),
        ("status", "VARCHAR"),  # ok | failed | skipped (already ingested) | warning (e.g. ranks missing)
        ("error", "VARCHAR"),
        ("rows", "BIGINT"),
        ("seconds", "DOUBLE"),
        ("ingested_at", "TIMESTAMP"),
    ],
}


def create_sql(table: str) -> str:
    cols = ", ".join(f"{name} {typ}" for name, typ in TABLES[table])
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols})"


def columns(table: str) -> list[str]:
    return [name for name, _ in TABLES[table]]


# The Parquet dataset (tracekit/dataset.py) holds the same tables, one directory each, hive-partitioned
# so that a run, or a range of ranks of a run, is read alone: ``<table>/run_id=<id>/rank_block=<rank //
# RANK_BLOCK>/<part>.parquet``. The per-rank data tables carry rank_block; the small per-run tables
# (and the per-file records, whose rank may be NULL) only run_id.
RANK_BLOCK = 256
PARTITION_BY: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "ranks": ("run_id", "rank_block"),
    "groups": ("run_id",),
    "events": ("run_id", "rank_block"),
    "collectives": ("run_id", "rank_block"),
    "p2p": ("run_id", "rank_block"),
    "steps": ("run_id", "rank_block"),
    "memory_events": ("run_id", "rank_block"),
    "memory_segments": ("run_id", "rank_block"),
    "memory_blocks": ("run_id", "rank_block"),
    "fr_entries": ("run_id", "rank_block"),
    "file_meta": ("run_id",),
    "ingest_log": ("run_id",),
}
# Row order within a part file, so that row groups' min/max statistics prune the usual filters
# (a group's collectives, a kind of event, a rank).
SORT_BY: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "ranks": ("rank",),
    "groups": ("pg_name",),
    "events": ("kind", "rank", "ts_ns"),
    "collectives": ("pg_name", "rank", "seq"),
    "p2p": ("pg_name", "rank", "seq"),
    "steps": ("rank", "step"),
    "memory_events": ("rank", "seq"),
    "memory_segments": ("rank", "address"),
    "memory_blocks": ("rank", "segment_address", "address"),
    "fr_entries": ("pg_name", "rank", "record_id"),
    "file_meta": ("path",),
    "ingest_log": ("path",),
}
