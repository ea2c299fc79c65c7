"""Document-masked CP attention equals full attention with the same mask (forward and backward),
for both shardings; and the comm layer numbers, annotates and reports every op through its hooks.

One spawned world of 4 gloo ranks (cp = 4) runs ``_worker``; each rank writes its findings to JSON
and the tests assert on them. fp32 tolerance: the CP result differs from full attention only by the
key order inside the softmax sums and by the dK/dV reduce-scatter order (a few ulps), so 1e-5
relative to the largest element.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from reference_trainer.comm import Comm
from reference_trainer.context_parallel import (attention, batch_shard_positions, document_causal_mask,
                                                gather_kv, shard_positions)
from reference_trainer.data import document_ids
from reference_trainer.launch import free_port, run_world, start_method
from reference_trainer.parallel_state import build_context
from tracekit.conventions import parse_comm
from tracekit.topology import Layout

CP = 4
B, S, HQ, HKV, D = 2, 64, 4, 2, 8


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 50, (B, S), generator=g)
    tokens[0, [5, 20, 21, 40]] = 0  # eos: several documents, one of length 1
    tokens[1, [30]] = 0
    return {"q": torch.randn(B, S, HQ, D, generator=g), "k": torch.randn(B, S, HKV, D, generator=g),
            "v": torch.randn(B, S, HKV, D, generator=g), "w": torch.randn(B, S, HQ, D, generator=g),
            "doc": document_ids(tokens, 0)}


def _full(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q, k, v = (x[n].clone().requires_grad_(True) for n in "qkv")
    pos = torch.arange(S).expand(B, S)
    out = attention(q, k, v, document_causal_mask(pos, pos, x["doc"]))
    (out * x["w"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


class _Recorder:
    def __init__(self):
        self.events: list[tuple[str, str, str, int, int | None]] = []

    def before(self, rec):
        self.events.append(("before", rec.op, rec.group.dim, rec.seq, rec.annotation.peer))

    def after(self, rec):
        self.events.append(("after", rec.op, rec.group.dim, rec.seq, rec.annotation.peer))


def _worker(rank: int, world: int, out_dir: str, init_method: str) -> None:
    torch.set_num_threads(1)
    comm = Comm.init_world("gloo", rank, world, init_method, 300, "native", torch.device("cpu"))
    ctx = build_context(Layout(cp=CP), comm)
    rec = _Recorder()
    comm.add_hook(rec)
    x, full = _inputs(), None
    full = _full(x)
    report: dict = {"rank": rank, "modes": {}}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for mode in ("sequence", "document"):
            pos = batch_shard_positions(x["doc"], CP, mode)
            q_pos, k_pos = pos[:, ctx.cp.local_rank], pos.reshape(B, S)
            take = lambda t, p=q_pos: torch.stack([t[b, p[b]] for b in range(B)])  # noqa: E731
            q, k, v = (take(x[n]).requires_grad_(True) for n in "qkv")
            out = attention(q, gather_kv(k, comm, ctx.cp), gather_kv(v, comm, ctx.cp),
                            document_causal_mask(q_pos, k_pos, x["doc"]))
            (out * take(x["w"])).sum().backward()
            err = {}
            for name, got, want in (("out", out, full["out"]), ("dq", q.grad, full["dq"]),
                                    ("dk", k.grad, full["dk"]), ("dv", v.grad, full["dv"])):
                want_local = take(want)
                err[name] = float((got - want_local).abs().max() / want_local.abs().max())
            report["modes"][mode] = err
        # p2p and the async-send hook path: a ring over the CP group
        nxt, prv = ctx.cp.ranks[(ctx.cp.local_rank + 1) % CP], ctx.cp.ranks[(ctx.cp.local_rank - 1) % CP]
        comm.send(torch.full((3,), float(rank)), nxt, ctx.cp)
        got = comm.recv((3,), torch.float32, prv, ctx.cp)
        comm.wait_sends()
        report["ring_received"] = got.tolist()
        report["canonical_allreduce"] = None
        comm.reduce_order = "canonical"
        report["canonical_allreduce"] = comm.all_reduce(torch.tensor([0.1 * (rank + 1)]), ctx.cp).item()
    report["events"] = rec.events
    report["spans"] = [e.name for e in prof.events() if e.name.startswith("tk.comm ")]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    comm.shutdown()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    run_world(_worker, CP, (str(out), f"tcp://127.0.0.1:{free_port()}"), timeout_s=600, method=start_method("gloo"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(CP)]


@pytest.mark.parametrize("mode", ["sequence", "document"])
def test_cp_attention_equals_full_attention(reports, mode):
    for rep in reports:
        for name, err in rep["modes"][mode].items():
            assert err <= 1e-5, (rep["rank"], mode, name, err)


def test_document_mask_is_not_plain_causal():
    doc = _inputs()["doc"]
    pos = torch.arange(S).expand(B, S)
    m = document_causal_mask(pos, pos, doc)
    assert m.sum() < torch.ones(S, S).tril().sum() * B
    assert bool(m[0, 22, 21]) is False and bool(m[0, 22, 22]) is True  # a new document at 22


def test_shardings_partition_the_sequence_and_document_sharding_balances_attention():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 9, (1, 256), generator=g)
    tokens[0, torch.tensor([10, 11, 150, 151, 152, 200])] = 0  # one long document, short ones
    doc = document_ids(tokens, 0)[0]
    work = {}
    for mode in ("sequence", "document"):
        pos = shard_positions(doc, CP, mode)
        assert sorted(pos.flatten().tolist()) == list(range(256))
        full = torch.arange(256)
        mask = document_causal_mask(full[None], full[None], doc[None])[0]
        work[mode] = [int(mask[p].sum()) for p in pos]  # attention pairs per CP rank
    seq = shard_positions(doc, CP, "sequence")
    assert seq[0].tolist() == list(range(0, 32)) + list(range(224, 256))  # chunks 0 and 7
    spread = {m: max(w) / min(w) for m, w in work.items()}
    assert spread["document"] < spread["sequence"] and spread["document"] < 1.1


def test_hooks_see_every_op_with_per_group_sequence_numbers(reports):
    for rep in reports:
        ev = rep["events"]
        befores = [e[1:] for e in ev if e[0] == "before"]
        afters = [e[1:] for e in ev if e[0] == "after"]
        assert sorted(map(tuple, befores)) == sorted(map(tuple, afters))
        coll = [e for e in befores if e[3] is None]
        # 2 modes x (2 gathers fwd + 2 reduce-scatters bwd) + 1 canonical all-reduce (an all-gather)
        assert [e[2] for e in coll] == list(range(len(coll))) and len(coll) == 9
        assert {e[1] for e in coll} == {"cp"}
        assert sorted(e[0] for e in coll) == ["all_gather"] * 5 + ["reduce_scatter"] * 4
        p2p = [e for e in befores if e[3] is not None]
        assert sorted(e[0] for e in p2p) == ["recv", "send"] and all(e[2] == 0 for e in p2p)


def test_profiler_spans_carry_the_annotation(reports):
    for rep in reports:
        anns = [parse_comm(s) for s in rep["spans"]]
        assert len(anns) == 11  # every dispatched op has exactly one span
        send = next(a for a in anns if a.op == "send")
        assert send.peer == (rep["rank"] + 1) % CP and send.nbytes == 12 and send.dtype == "float32"
        assert all(a.ranks == (0, 1, 2, 3) and a.dim == "cp" for a in anns)


def test_ring_and_canonical_reduction(reports):
    for rep in reports:
        assert rep["ring_received"] == [float((rep["rank"] - 1) % CP)] * 3
    # canonical: ((0.1 + 0.2) + 0.3) + 0.4 in fp32 on every rank, bit-identical
    want = torch.tensor([0.1], dtype=torch.float32)
    for x in (0.2, 0.3, 0.4):
        want = want + torch.tensor([x], dtype=torch.float32)
    assert {rep["canonical_allreduce"] for rep in reports} == {want.item()}
