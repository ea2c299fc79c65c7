"""Read ByteDance what-if-analysis op tables (FORMATS.md section 4) into the store's tables.

An op table is a parquet file with one row per op (``dp_rank, stage, rank, step, optype, start_ts,
duration, seq_id, mc, gmc, mb_id``) and a ``meta-*.yaml`` beside it with the job's sizes.

Rank numbering. The table has one row stream per *worker*, a (dp_rank, stage) pair: tensor-parallel
(and context-parallel, ``dsp_size``) ranks inside a worker are not traced separately, so they are
folded into it. The store's layout is therefore ``Layout(tp=1, cp=1, pp=pp_size, dp=dp_size)`` and
a worker's store rank is ``stage + pp_size * dp_rank`` (tracekit's [TP, CP, PP, DP] order). The
trace's own global rank, the true tp/cp sizes and the yaml are kept in ``runs.manifest``
(``{"wia_meta": ..., "folded": {"tp": .., "cp": ..}, "trace_rank": {store_rank: trace_rank}}``).

Time. ``start_ts``/``duration`` are seconds relative to the start of each sampled step, on a clock
shared by all workers. Sampled steps are not contiguous, so they are laid end to end on one
synthetic timeline, in step order: step k begins where step k-1's latest op ended, plus a 1 ms gap.
Times are stored as integer nanoseconds; ``ranks.clock_offset_ns`` is 0.

Collectives get a synthesized group name per instance family:
- ``wia:dp:stage<s>``: the data-parallel group of stage s (all dp ranks), for
  ``grads-reduce-scatter`` (reduce_scatter) and ``params-all-gather`` (all_gather);
- ``wia:embed:dp<d>``: first and last stage of replica d, for ``embedding-grads-all-reduce``;
- ``wia:tp:w<rank>``: the folded TP group inside worker ``rank`` (one store rank), for
  ``layernorm-grads-all-reduce``; analyses skip single-member groups.
``seq`` numbers a group's instances in time order on each rank, from 0. p2p ops pair with the
neighbouring stage of the same replica (``wia:pp:dp<d>``): forward-send/backward-recv with s+1,
forward-recv/backward-send with s-1 (modulo pp when vpp > 1); ``microbatch`` is the table's
``seq_id`` (which restarts every step), ``seq`` counts each (rank, peer, direction) stream over the
run in time order, from 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import yaml

from tracekit.analysis.tables import conform
from tracekit.ingest.common import IngestError
from tracekit.topology import Layout

REQUIRED_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id",
                    "mc", "mb_id", "gmc")
COMPUTE_PHASE = {
    "forward-compute": "fwd",
    "backward-compute": "bwd",
    "optimizer": "opt",
    "optimizer-clip-main-grad": "opt",
    "gc": None,
}
P2P_OPS = {  # optype -> (direction, stage offset of the peer)
    "forward-send": ("send", 1),
    "forward-recv": ("recv", -1),
    "backward-send": ("send", -1),
    "backward-recv": ("recv", 1),
}
COLLECTIVE_OPS = {
    "grads-reduce-scatter": "reduce_scatter",
    "params-all-gather": "all_gather",
    "embedding-grads-all-reduce": "all_reduce",
    "layernorm-grads-all-reduce": "all_reduce",
}
STEP_GAP_NS = 1_000_000


class OpTableError(IngestError, ValueError):
    """An op table or its meta yaml that cannot be read as the what-if-analysis format: bad input,
    reported like any other (a file whose content merely starts like parquet lands here too)."""


def _find_meta(parquet_path: Path) -> Path:
    metas = sorted(parquet_path.parent.glob("meta*.yaml")) + sorted(parquet_path.parent.glob("meta*.yml"))
    if not metas:
        raise OpTableError(f"{parquet_path}: no meta*.yaml beside the op table (it gives dp/pp/tp sizes)")
    stem = parquet_path.stem.removeprefix("trace")
    for m in metas:  # prefer meta-AR.yaml for trace-AR.parquet
        if stem and m.stem.endswith(stem):
            return m
    return metas[0]


def _read_meta(path: Path) -> dict:
    try:
        meta = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise OpTableError(f"{path}: not valid yaml: {e}") from None
    if not isinstance(meta, dict):
        raise OpTableError(f"{path}: expected a mapping, got {type(meta).__name__}")
    for key in ("dp_size", "pp_size"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise OpTableError(f"{path}: missing or invalid {key!r}")
    return meta


def read_optable(parquet_path: str | Path, run_id: str = "wia") -> dict[str, pl.DataFrame]:
    """Read one op-table trace; returns ``{table: DataFrame}`` for runs, ranks, groups, events,
    collectives, p2p and steps, columns exactly as in ``tracekit.schema``. ``parquet_path`` may also
    be the trial's folder holding exactly one ``*.parquet`` op table."""
    path = Path(parquet_path)
    if path.is_dir():
        found = sorted(path.glob("*.parquet"))
        if len(found) != 1:
            raise OpTableError(f"{path}: expected one *.parquet op table in the folder, found {len(found)}")
        path = found[0]
    if not path.is_file():
        raise OpTableError(f"{path}: no such file")
    meta_path = _find_meta(path)
    meta = _read_meta(meta_path)
    try:
        raw = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - pyarrow/polars raise several types for bad files
        raise OpTableError(f"{path}: not a readable parquet file: {e}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in raw.columns]
    if missing:
        raise OpTableError(f"{path}: not a what-if-analysis op table, missing columns {missing}")
    dp, pp = meta["dp_size"], meta["pp_size"]
    layout = Layout(tp=1, cp=1, pp=pp, dp=dp)
    bad = raw.filter((pl.col("dp_rank") < 0) | (pl.col("dp_rank") >= dp) | (pl.col("stage") < 0)
                     | (pl.col("stage") >= pp))
    if bad.height:
        raise OpTableError(f"{path}: {bad.height} rows have dp_rank/stage outside dp={dp}, pp={pp} "
                           f"from {meta_path.name}")
    known = set(COMPUTE_PHASE) | set(P2P_OPS) | set(COLLECTIVE_OPS)
    optypes = set(raw["optype"].cast(pl.Utf8).unique().to_list())
    if optypes - known:
        raise OpTableError(f"{path}: unknown optypes {sorted(optypes - known)}")

    # store rank of each (dp_rank, stage) worker, from the one rank-layout helper
    workers = pl.DataFrame([(d, s, layout.rank_of(dp=d, pp=s)) for d in range(dp) for s in range(pp)],
                           schema={"dp_rank": pl.Int32, "stage": pl.Int32, "srank": pl.Int32}, orient="row")
    ops = raw.with_columns(
        pl.col("optype").cast(pl.Utf8),
        pl.col("dp_rank").cast(pl.Int32),
        pl.col("stage").cast(pl.Int32),
        pl.col("step").cast(pl.Int32),
        pl.col("start_ts").cast(pl.Float64),
        pl.col("duration").cast(pl.Float64),
    ).join(workers, on=["dp_rank", "stage"])
    # Lay sampled steps end to end (see module docstring).
    spans = (ops.group_by("step").agg((pl.col("start_ts") + pl.col("duration")).max().alias("span"))
             .sort("step")
             .with_columns(((pl.col("span") * 1e9).round().cast(pl.Int64) + STEP_GAP_NS).alias("len_ns"))
             .with_columns((pl.col("len_ns").cum_sum() - pl.col("len_ns")).alias("base_ns")))
    ops = ops.join(spans.select("step", "base_ns"), on="step").with_columns(
        (pl.col("base_ns") + (pl.col("start_ts") * 1e9).round().cast(pl.Int64)).alias("ts_ns"),
        (pl.col("duration") * 1e9).round().cast(pl.Int64).alias("dur_ns"),
    ).with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"))
    rank_map = ops.select("srank", pl.col("rank").cast(pl.Int32).alias("trace_rank")).unique().sort("srank")
    if rank_map["srank"].n_unique() != rank_map.height:
        raise OpTableError(f"{path}: one (dp_rank, stage) worker carries several trace ranks")
    ops = ops.with_columns(pl.lit(run_id).alias("run_id"), pl.col("srank").alias("rank"))

    manifest = {"wia_meta": meta, "folded": {"tp": int(meta.get("tp_size", 1)),
                                             "cp": int(meta.get("dsp_size", 1))},
                "trace_rank": {str(a): b for a, b in rank_map.iter_rows()},
                "step_base_ns": {str(s): b for s, b in spans.select("step", "base_ns").iter_rows()}}
    runs = pl.DataFrame({
        "run_id": [run_id], "source": ["wia"], "root": [str(path.parent)],
        "world_size": [layout.world_size], "tp": [1], "cp": [1], "pp": [pp], "dp": [dp],
        "layout_source": ["wia-meta"], "backend": [None], "manifest": [json.dumps(manifest)],
        "ingested_at": [None],
    })
    ranks = workers.select(pl.col("srank").alias("rank"), pl.col("dp_rank").alias("dp"), pl.col("stage").alias("pp"),
                           pl.lit(0).alias("cp"), pl.lit(0).alias("tp"), pl.lit(run_id).alias("run_id"),
                           pl.lit(0).alias("clock_offset_ns")).sort("rank")

    # events: every op, compute and communication alike, so a rank's timeline is complete.
    events = ops.with_columns(
        pl.when(pl.col("optype").is_in(list(COMPUTE_PHASE))).then(pl.lit("compute"))
        .otherwise(pl.lit("comm")).alias("kind"),
        pl.col("optype").alias("name"),
        pl.lit("0").alias("tid"),
        pl.col("optype").replace_strict(COMPUTE_PHASE, default=None).alias("phase"),
        pl.when(pl.col("gmc") >= 0).then(pl.col("gmc")).alias("vstage"),
        pl.when(pl.col("optype").is_in(list(P2P_OPS))).then(pl.col("seq_id"))
        .when(pl.col("mb_id") >= 0).then(pl.col("mb_id")).alias("microbatch"),
        ~pl.col("optype").is_in(list(COMPUTE_PHASE)).alias("is_comm"),
    ).sort("rank", "ts_ns")

    p2p_rows = ops.filter(pl.col("optype").is_in(list(P2P_OPS))).with_columns(
        pl.col("optype").replace_strict({k: v[0] for k, v in P2P_OPS.items()}).alias("direction"),
        pl.col("optype").replace_strict({k: v[1] for k, v in P2P_OPS.items()}, return_dtype=pl.Int32).alias("_off"),
        pl.format("wia:pp:dp{}", pl.col("dp_rank")).alias("pg_name"),
        pl.col("ts_ns").alias("start_ns"),
        pl.col("seq_id").alias("microbatch"),
        pl.lit("wia").alias("source"),
    )
    vpp = int(meta.get("vpp_size", 1) or 1)
    peer_stage = pl.col("stage") + pl.col("_off")
    if vpp > 1:  # interleaved: the last stage feeds the first stage's next model chunk
        peer_stage = peer_stage % pp
    else:
        stray = p2p_rows.filter((peer_stage < 0) | (peer_stage >= pp))
        if stray.height:
            raise OpTableError(f"{path}: {stray.height} p2p ops point past the first or last stage")
    p2p_rows = p2p_rows.with_columns(peer_stage.alias("peer_stage")).join(
        workers.rename({"stage": "peer_stage", "srank": "peer"}), on=["dp_rank", "peer_stage"], how="left"
    ).drop("_off", "peer_stage")
    # seq_id restarts every step; the store's seq counts a (rank, peer, direction) stream over the run.
    p2p_rows = p2p_rows.sort("rank", "peer", "direction", "start_ns").with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over("rank", "peer", "direction").alias("seq")
    ).sort("rank", "start_ns")

    coll = ops.filter(pl.col("optype").is_in(list(COLLECTIVE_OPS))).with_columns(
        pl.col("optype").replace_strict(COLLECTIVE_OPS).alias("op"),
        pl.when(pl.col("optype") == "embedding-grads-all-reduce")
        .then(pl.format("wia:embed:dp{}", pl.col("dp_rank")))
        .when(pl.col("optype") == "layernorm-grads-all-reduce")
        .then(pl.format("wia:tp:w{}", pl.col("srank")))
        .otherwise(pl.format("wia:dp:stage{}", pl.col("stage"))).alias("pg_name"),
        pl.col("ts_ns").alias("start_ns"),
        pl.lit("wia").alias("source"),
    ).sort("rank", "pg_name", "start_ns").with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over("rank", "pg_name").alias("seq"))

    groups = _groups(layout, coll, run_id)
    steps = ops.group_by("rank", "step").agg(pl.col("ts_ns").min().alias("start_ns"),
                                             pl.col("end_ns").max().alias("end_ns"))
    steps = steps.with_columns(pl.lit(run_id).alias("run_id")).sort("rank", "step")
    return {
        "runs": conform(runs, "runs"),
        "ranks": conform(ranks, "ranks"),
        "groups": groups,
        "events": conform(events, "events"),
        "collectives": conform(coll.with_columns(pl.lit(run_id).alias("run_id")), "collectives"),
        "p2p": conform(p2p_rows, "p2p"),
        "steps": conform(steps, "steps"),
    }


def _groups(layout: Layout, coll: pl.DataFrame, run_id: str) -> pl.DataFrame:
    """One row per synthesized group, ranks in group-local order (the dp index, or stage order)."""
    rows = []
    for s in range(layout.pp):
        ranks = list(layout.group(layout.rank_of(pp=s), "dp"))
        rows.append((f"wia:dp:stage{s}", "data-parallel group of one stage", "dp" if layout.dp > 1 else "other", ranks))
    for d in range(layout.dp):
        ranks = sorted({layout.rank_of(dp=d, pp=0), layout.rank_of(dp=d, pp=layout.pp - 1)})
        rows.append((f"wia:embed:dp{d}", "embedding group: first and last stage",
                     layout.dim_of(ranks) or "other", ranks))
        ranks_pp = list(layout.group(layout.rank_of(dp=d), "pp"))
        rows.append((f"wia:pp:dp{d}", "pipeline of one replica (p2p)", "pp" if layout.pp > 1 else "other",
                     ranks_pp))
    for r in range(layout.world_size):
        rows.append((f"wia:tp:w{r}", "tensor-parallel group folded into the worker", "tp", [r]))
    used = set(coll["pg_name"].unique().to_list()) | {n for n, *_ in rows if n.startswith("wia:pp:")}
    rows = [r for r in rows if r[0] in used]
    return conform(pl.DataFrame(
        {"run_id": [run_id] * len(rows), "pg_name": [r[0] for r in rows], "pg_desc": [r[1] for r in rows],
         "dim": [r[2] for r in rows], "ranks": [r[3] for r in rows], "size": [len(r[3]) for r in rows]},
        schema={"run_id": pl.Utf8, "pg_name": pl.Utf8, "pg_desc": pl.Utf8, "dim": pl.Utf8,
                "ranks": pl.List(pl.Int32), "size": pl.Int32},
    ), "groups")
