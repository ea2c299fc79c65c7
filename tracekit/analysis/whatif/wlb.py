"""WLB-LLM data what-ifs for trainer runs whose documents are known: per-document CP sharding and
variable-length packing, with the imbalance degree of every step before and after.

The documents are the trainer's own seeded corpus, regenerated from the run's manifest config (the
reference trainer's data never depends on the layout; ``reference_trainer`` must be importable).
Work, after WLB-LLM (ALGORITHMS.md): attention ~ the unmasked causal (query, key) pairs of a
document, everything else ~ its tokens; per transformer layer, 4*dim FLOPs per pair and
2*(parameters of the layer) FLOPs per token. The imbalance degree is the slowest unit's work over
the mean (CP: the ranks of each CP group, a step's micro-batches summed, for attention alone and for
all the work; packing: the micro-batches of a global batch).

The time what-if of per-document sharding scales each CP rank's forward/backward compute by how
its attention load changes. A rank's compute is taken to rise with the pairs it holds above its CP
group's mean (the balanced load) and not to fall below it: ``1 + w * (pairs / mean - 1)`` when that
exceeds 1, with ``w`` fitted on the run (the loaded ranks' compute over the group's least-loaded one
against their pair ratio). A kernel whose cost also falls for light ranks is what ``--balance cp``
(the group's mean) predicts instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif.graph import StepGraph, WhatIfError
from tracekit.analysis.whatif.replay import Params


@dataclass
class DataWhatIf:
    # step; cp_attention_degree / cp_work_degree _before/_after (sequence -> per-document sharding:
    # attention pairs alone, and all the work); pack_degree _before/_after (fixed -> variable-length packing)
    per_step: pl.DataFrame
    attention_weight: float  # w of the compute model (0: compute does not follow the pairs)
    scale: pl.DataFrame  # step, rank, factor: each CP rank's fwd/bwd compute under per-document sharding


def trainer_config(tables: RunTables):
    cfg = tables.manifest.get("config")
    if tables.runs["source"][0] != "trainer" or not isinstance(cfg, dict):
        raise WhatIfError("data what-ifs need a trainer run whose manifest holds its config (the documents)")
    try:
        from reference_trainer.config import TrainConfig
    except ImportError:
        raise WhatIfError("data what-ifs regenerate the documents with reference_trainer, which is not importable") from None
    try:
        return TrainConfig.from_dict(cfg)
    except Exception as e:  # noqa: BLE001 - a manifest not written by this trainer version
        raise WhatIfError(f"the run's manifest config is not a reference-trainer config: {e}") from None


def _corpus(cfg):
    from reference_trainer.faults import ImbalancedCorpus, parse_faults
    from reference_trainer.data import Corpus

    imb = [f for f in parse_faults(cfg.faults) if f.kind == "cp_imbalance"]
    return ImbalancedCorpus(cfg, imb[0].params["ranks"], imb[0].params.get("short", 4)) if imb else Corpus(cfg)


def _flops(cfg) -> tuple[float, float]:
    """FLOPs per causal pair and per token of one layer."""
    head = cfg.dim // cfg.n_heads
    params = cfg.dim * cfg.dim * 2 + 2 * cfg.dim * head * cfg.n_kv_heads + 3 * cfg.dim * cfg.ffn_dim
    return 4.0 * cfg.dim, 2.0 * params


def _segments(row, eos: int) -> list[int]:
    """Lengths of the documents (pieces cut at the row's ends) of one input row."""
    from reference_trainer.data import document_ids

    doc = document_ids(row.unsqueeze(0), eos)[0].numpy()
    return np.bincount(doc - doc.min()).tolist()


def _pack_degrees(cfg, batch, per_pair: float, per_token: float) -> tuple[float, float]:
    """Micro-batch work max/mean: as packed, and re-packed with variable lengths (documents dealt,
    longest first, to the micro-batch with the least work; at most twice the fixed length each)."""
    rows = batch[:, :-1]
    mb = cfg.micro_batch_size
    docs, now = [], []
    for i in range(0, rows.shape[0], mb):
        segs = [n for r in rows[i:i + mb] for n in _segments(r, cfg.eos_id)]
        docs += segs
        now.append(sum(n * (n + 1) / 2 * per_pair + n * per_token for n in segs))
    k = len(now)
    cap = 2 * mb * rows.shape[1]
    work, tokens = np.zeros(k), np.zeros(k)
    for n in sorted(docs, reverse=True):
        order = np.argsort(work)
        j = next((int(j) for j in order if tokens[j] + n <= cap), int(order[0]))
        work[j] += n * (n + 1) / 2 * per_pair + n * per_token
        tokens[j] += n
    return max(now) / np.mean(now), float(work.max() / work.mean())


def data_whatif(tables: RunTables, gs: list[StepGraph], rec: list[Params]) -> DataWhatIf:
    from reference_trainer.faults import cp_pair_counts

    cfg = trainer_config(tables)
    corpus = _corpus(cfg)
    doc_cfg = dataclasses.replace(cfg, cp_sharding="document")
    per_pair, per_token = _flops(cfg)
    lay = tables.layout
    tokens_per_rank = cfg.micro_batch_size * cfg.seq_len / cfg.cp * cfg.micro_batches
    rows, pairs = [], []
    for step in sorted({s for g in gs for s in g.steps}):
        batch = corpus.global_batch(step)
        now = np.zeros((cfg.dp, cfg.cp))
        doc = np.zeros((cfg.dp, cfg.cp))
        for d in range(cfg.dp):
            for m in corpus.micro_batches(step, d):
                now[d] += cp_pair_counts(cfg, m)
                doc[d] += cp_pair_counts(doc_cfg, m)
        work_now = now * per_pair + tokens_per_rank * per_token
        work_doc = doc * per_pair + tokens_per_rank * per_token
        pack_now, pack_var = _pack_degrees(cfg, batch, per_pair, per_token)
        rows.append((step, _degree(now), _degree(doc), _degree(work_now), _degree(work_doc), pack_now, pack_var))
        for r in range(lay.world_size):
            c = lay.coords(r)
            pairs.append((step, r, now[c.dp, c.cp] / now[c.dp].mean(), doc[c.dp, c.cp] / doc[c.dp].mean()))
    per_step = pl.DataFrame(rows, schema=["step", "cp_attention_degree_before", "cp_attention_degree_after",
                                          "cp_work_degree_before", "cp_work_degree_after", "pack_degree_before",
                                          "pack_degree_after"], orient="row")
    ratio = pl.DataFrame(pairs, schema={"step": pl.Int64, "rank": pl.Int64, "ratio": pl.Float64, "ratio_doc": pl.Float64},
                         orient="row")
    w = _fit_weight(gs, rec, tables, ratio)
    stretch = lambda x: pl.max_horizontal(pl.lit(1.0), 1.0 + w * (x - 1.0))  # noqa: E731
    scale = ratio.with_columns((stretch(pl.col("ratio_doc")) / stretch(pl.col("ratio"))).alias("factor"))
    return DataWhatIf(per_step, w, scale.select("step", "rank", "factor"))


def _degree(work: np.ndarray) -> float:
    """[dp, cp] work -> the worst CP group's max over mean."""
    return float((work.max(axis=1) / work.mean(axis=1)).max())


def _compute_per_rank(gs: list[StepGraph], rec: list[Params]) -> pl.DataFrame:
    out = []
    for g, p in zip(gs, rec):
        sel = (g.nodes["label"].is_in(["fwd", "bwd"]) & (g.nodes["kind"] == "work")).to_numpy()
        ranks = g.column("rank")[sel]
        for si, step in enumerate(g.steps):
            tot = pl.DataFrame({"rank": ranks, "dur": p.dur[sel, si]}).group_by("rank").agg(pl.col("dur").sum())
            out.append(tot.with_columns(pl.lit(step).alias("step")))
    return pl.concat(out).with_columns(pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64))


def _fit_weight(gs, rec, tables: RunTables, ratio: pl.DataFrame) -> float:
    comp = _compute_per_rank(gs, rec).join(ratio, on=["step", "rank"])
    coords = tables.coords().select(pl.col("rank").cast(pl.Int64), "dp", "pp", "tp")
    comp = comp.join(coords, on="rank").with_columns(pl.col("dur").min().over("step", "dp", "pp", "tp").alias("floor"))
    loaded = comp.filter(pl.col("ratio") > 1.05)
    if not loaded.height:
        return 0.0
    w = ((loaded["dur"] / loaded["floor"] - 1.0) / (loaded["ratio"] - 1.0)).to_numpy()
    return float(max(np.median(w), 0.0))


def cp_document_params(gs: list[StepGraph], rec: list[Params], data: DataWhatIf) -> list[Params]:
    """Recorded params with each CP rank's fwd/bwd compute scaled as per-document sharding would."""
    lut = {(s, r): f for s, r, f in data.scale.iter_rows()}
    out = []
    for g, p in zip(gs, rec):
        q = p.copy()
        sel = np.flatnonzero((g.nodes["label"].is_in(["fwd", "bwd"]) & (g.nodes["kind"] == "work")).to_numpy())
        ranks = g.column("rank")
        for si, step in enumerate(g.steps):
            f = np.array([lut.get((step, int(ranks[i])), 1.0) for i in sel])
            q.dur[sel, si] *= f
        out.append(q)
    return out
