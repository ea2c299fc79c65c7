"""Pipeline schedules: interleaved 1F1B with N < pp, N = pp, N > pp, micro-batch counts that are
not a multiple of pp or are fewer than pp all train, and their gradients equal the
all-forward-all-backward schedule's bit for bit (every bucket accumulates micro-batches in the same
ascending order in both schedules, so equality is exact, not approximate)."""

from __future__ import annotations

import pytest
import torch

from reference_trainer.compare import diff_states
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many
from reference_trainer.pipeline import Action, ScheduleError, build_schedule
from reference_trainer.train import run_single_process

BASE = TrainConfig(compute_dtype="fp32", pp=4, vstages=2, n_layers=8, dim=64, seq_len=64,
                   steps=1, dump_state=True, timeout_s=300)

CASES = {
    "afab_m8": BASE.replace(schedule="afab", micro_batches=8),
    "n2_m8": BASE.replace(consecutive=2, micro_batches=8),  # N < pp
    "n4_m8": BASE.replace(consecutive=4, micro_batches=8),  # N = pp
    "n8_m8": BASE.replace(consecutive=8, micro_batches=8),  # N > pp
    "afab_m6": BASE.replace(schedule="afab", micro_batches=6),
    "n4_m6": BASE.replace(micro_batches=6),  # not a multiple of pp
    "afab_m3": BASE.replace(schedule="afab", micro_batches=3),
    "n4_m3": BASE.replace(micro_batches=3),  # fewer micro-batches than stages
    "v1_m6": BASE.replace(vstages=1, micro_batches=6),  # plain 1F1B, 2 layers per stage
}
PAIRS = [("n2_m8", "afab_m8"), ("n4_m8", "afab_m8"), ("n8_m8", "afab_m8"), ("n4_m6", "afab_m6"),
         ("n4_m3", "afab_m3")]


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    results = launch_many([(cfg, root / name) for name, cfg in CASES.items()])
    return {name: torch.load(r.out / "state" / "step0.pt") for name, r in zip(CASES, results)}


@pytest.mark.parametrize("name,afab", PAIRS)
def test_interleaved_equals_afab_bitwise(states, name, afab):
    d = diff_states(states[name], states[afab])
    assert d.bit_identical, [t for t in d.tensors if not t.equal][:3]
    assert len(d.tensors) == 2 * (9 * 8 + 3)


@pytest.mark.parametrize("name", ["afab_m8", "afab_m3", "v1_m6"])
def test_pipeline_matches_single_process(states, name):
    ref = run_single_process(CASES[name].single_process())[1][0]
    d = diff_states(states[name], ref)
    assert d.loss_diff <= 1e-6 * d.loss_b
    assert all(t.max_abs <= 5e-6 * t.ref_max for t in d.tensors if t.kind == "grads")


# -- the schedule itself (pure) --------------------------------------------------------------------

def _check_valid(sched: list[list[Action]], pp: int, v: int, m: int) -> None:
    """Every action once; replaying the per-rank orders in lockstep never waits forever."""
    last = pp * v - 1
    for r, acts in enumerate(sched):
        want = {Action(k, c * pp + r, mb) for k in "FB" for c in range(v) for mb in range(m)}
        assert set(acts) == want and len(acts) == len(want)
    done: set[Action] = set()
    ptr = [0] * pp
    while any(p < len(s) for p, s in zip(ptr, sched)):
        progressed = False
        for r in range(pp):
            if ptr[r] == len(sched[r]):
                continue
            a = sched[r][ptr[r]]
            deps = ([Action("F", a.vstage - 1, a.mb)] if a.kind == "F" and a.vstage else []) + (
                [Action("F", a.vstage, a.mb)] + ([Action("B", a.vstage + 1, a.mb)] if a.vstage < last else [])
                if a.kind == "B" else [])
            if all(x in done for x in deps):
                done.add(a)
                ptr[r] += 1
                progressed = True
        assert progressed, "schedule deadlocks"


@pytest.mark.parametrize("pp,v,m,n", [(1, 1, 3, 1), (2, 1, 1, 2), (2, 2, 5, 2), (4, 2, 8, 2),
                                      (4, 2, 3, 4), (4, 3, 7, 5), (3, 2, 10, 1), (4, 1, 9, 4)])
@pytest.mark.parametrize("kind", ["1f1b", "afab"])
def test_schedule_complete_and_deadlock_free(pp, v, m, n, kind):
    _check_valid(build_schedule(pp, v, m, n, kind), pp, v, m)


def test_1f1b_bounds_in_flight_forwards_and_afab_does_not():
    pp, v, m = 4, 1, 8
    one = build_schedule(pp, v, m, pp, "1f1b")
    afab = build_schedule(pp, v, m, pp, "afab")

    def peak(acts: list[Action]) -> int:
        live = best = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            best = max(best, live)
        return best

    assert [peak(s) for s in one] == [4, 3, 2, 1]  # pp - rank, the 1F1B memory bound
    assert all(peak(s) == m for s in afab)
    assert [a.kind for a in afab[0]] == ["F"] * m + ["B"] * m


def test_interleaved_forward_order_follows_groups_of_n():
    sched = build_schedule(2, 2, 4, 1, "1f1b")[0]
    fwd = [(a.vstage, a.mb) for a in sched if a.kind == "F"]
    assert fwd == [(0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2), (0, 3), (2, 3)]


def test_unknown_schedule_rejected():
    with pytest.raises(ScheduleError):
        build_schedule(2, 1, 2, 2, "gpipe")


def _messages(sched: list[list[Action]], pp: int, v: int) -> tuple[dict, dict]:
    """Per (src, dst, direction): the messages in the sender's issue order and the receiver's."""
    last, sends, recvs = pp * v - 1, {}, {}
    for r, acts in enumerate(sched):
        for a in acts:
            if a.kind == "F":
                if a.vstage > 0 and (a.vstage - 1) % pp != r:
                    recvs.setdefault(((a.vstage - 1) % pp, r, "F"), []).append((a.vstage, a.mb))
                if a.vstage < last and (a.vstage + 1) % pp != r:
                    sends.setdefault((r, (a.vstage + 1) % pp, "F"), []).append((a.vstage + 1, a.mb))
            else:
                if a.vstage < last and (a.vstage + 1) % pp != r:
                    recvs.setdefault(((a.vstage + 1) % pp, r, "B"), []).append((a.vstage, a.mb))
                if a.vstage > 0 and (a.vstage - 1) % pp != r:
                    sends.setdefault((r, (a.vstage - 1) % pp, "B"), []).append((a.vstage - 1, a.mb))
    return sends, recvs


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("kind", ["1f1b", "afab"])
def test_p2p_issue_order_matches_per_direction(pp, v, kind):
    """What NCCL (which ignores tags) relies on: per (sender, receiver, direction), messages are
    sent and received in the same order, so forward and backward p2p on separate communicators match."""
    for m in (1, 3, 5, 8):
        for n in (1, 2, pp, 2 * pp):
            sends, recvs = _messages(build_schedule(pp, v, m, n, kind), pp, v)
            assert sends == recvs, (pp, v, m, n, kind)


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (4, 2, 8), (4, 2, 4), (2, 2, 4), (4, 3, 8), (3, 1, 5)])
def test_bubble_matches_interleaved_1f1b_theory(pp, v, m):
    """With N = pp the simulated bubble is the textbook (pp - 1) / (v * m): interleaving divides it by v."""
    from reference_trainer.pipeline import bubble_fraction

    assert bubble_fraction(pp, v, m, pp, "1f1b") == pytest.approx((pp - 1) / (v * m))
