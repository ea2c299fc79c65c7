"""Per-rank flight-recorder dumps ``fr/rank<R>`` (pickle, FORMATS.md section 2), as
ProcessGroupNCCL writes them with ``TORCH_NCCL_ENABLE_TIMING=1``.

Per process group and rank: ``collective_seq_id`` counts its collectives, ``p2p_seq_id`` its p2p
ops (a p2p entry keeps the group's current collective count), ``op_id`` both. p2p entries name
group-local ranks (``nccl:send 0->1``, ``nccl:recv 1<-0``). Start and completion are when the
watchdog (a poll every 100 ms) saw them; ``duration_ms`` is the op's own, from CUDA events. Only
the last ``BUFFER`` entries are kept (torch's default buffer). In a hang the ops issued and never
completed are ``started`` (the first one of the rank) or ``scheduled`` (queued behind it), and the
rank that never arrived has no entry for that collective.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from tracekit.simulate.clock import Clocks
from tracekit.simulate.kineto import NCCL_VERSION, PROFILING_NAME, new_nccl
from tracekit.simulate.ranks import RankOps, Views

VERSION = "2.10"
BUFFER = 2000
POLL_MS = 100.0
TIMEOUT_MS = 600_000


def dump(views: Views, clocks: Clocks, view: RankOps, seed: int) -> dict:
    r = view.rank
    rng = np.random.default_rng([seed, 4, r])
    phase = rng.uniform(0.0, POLL_MS)
    polled = lambda t: phase + np.ceil((t - phase) / POLL_MS) * POLL_MS  # noqa: E731 (the next poll after t)
    groups = views.groups.member_of(r)
    pg_id = {g.name: i for i, g in enumerate(groups)}
    coll_seq = {g.name: 0 for g in groups}
    p2p_seq = dict(coll_seq)
    op_ids = dict(coll_seq)
    status = {str(i): {"last_enqueued_collective": -1, "last_started_collective": -1,
                       "last_completed_collective": -1} for i in range(len(groups))}
    entries, open_seen = [], False
    lead = rng.uniform(0.015, 0.08, len(view.ops))
    for i, op in enumerate(view.ops):
        if op.kind == "compute" or not np.isfinite(view.start[i]):
            continue
        g = views.group(op, r)
        op_ids[g.name] += 1
        p2p = op.kind in ("send", "recv")
        if p2p:
            p2p_seq[g.name] += 1
            me, other = g.ranks.index(r), g.ranks.index(views.peer(op, r))
            profiling = f"nccl:send {me}->{other}" if op.kind == "send" else f"nccl:recv {me}<-{other}"
        else:
            coll_seq[g.name] = op.seq
            profiling = PROFILING_NAME[op.name]
        done = bool(np.isfinite(view.end[i]))
        state = "completed" if done else ("scheduled" if open_seen else "started")
        open_seen = open_seen or not done
        started = clocks.epoch_ns(r, polled(view.start[i])) if state != "scheduled" else None
        dt = op.dtype
        entries.append({
            "record_id": len(entries), "pg_id": pg_id[g.name], "process_group": (g.name, g.desc),
            "collective_seq_id": coll_seq[g.name], "p2p_seq_id": p2p_seq[g.name], "op_id": op_ids[g.name],
            "profiling_name": profiling, "is_p2p": p2p,
            "input_sizes": [[op.in_nelems]], "input_dtypes": [dt], "output_sizes": [[op.out_nelems]],
            "output_dtypes": [dt], "time_created_ns": clocks.epoch_ns(r, view.start[i] - lead[i]),
            "time_discovered_started_ns": started,
            "time_discovered_completed_ns": clocks.epoch_ns(r, max(polled(view.end[i]), polled(view.start[i])))
            if done else None,
            "duration_ms": float(view.end[i] - view.start[i]) if done else None,
            "state": state, "retired": done, "timeout_ms": TIMEOUT_MS,
            "frames": [{"name": "train_step", "filename": "train.py", "line": 412}],
            "thread_id": str(140_000_000_000 + r), "thread_name": "pt_main_thread",
        })
        st = status[str(pg_id[g.name])]
        if not p2p:
            st["last_enqueued_collective"] = op.seq
            if state != "scheduled":
                st["last_started_collective"] = op.seq
            if done:
                st["last_completed_collective"] = op.seq
    pg_config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))} for g in groups}
    return {"version": VERSION, "pg_config": pg_config, "pg_status": status,
            "comm_lib_version": NCCL_VERSION[new_nccl(seed)], "entries": entries[-BUFFER:], "nccl_comm_state": {}}


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(data, f)
