"""Bug or rounding order? Each mismatching buffer is judged against what reordering alone can do.

On a mismatch the reference is re-run under the other plausible orders of the suspect reductions,
one reduction site at a time (``plan.SITES``: TP collectives, the CP K/V gradient reduce-scatter, the
DP x CP gradient reduce-scatter, the loss all-reduce, micro-batch accumulation), each in every
modelled order (gloo ring, canonical, reversed, pairwise tree, fp64 then one rounding). The suspects
follow from the first diverging buffer: a forward activation can only be moved by TP sums; the loss
by its all-reduce and the vocab-parallel sums; a gradient by any of the four gradient sites; a
parameter alone (gradients exact) by none, so it is a bug. A site whose groups have at most two
members is skipped: a + b is the same in every order.

A mismatching buffer is **order** when a variant reproduces it bit for bit (the cause names that
site and order) or when every differing element lies inside the elementwise [min, max] envelope of
the reference and all variants; otherwise it is a **bug**, located by the first differing element:
step, micro-batch (activations), layer, parameter, and the pipeline stage, TP rank, DP x CP shard
and global rank that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from numerics.activations import plan_positions
from numerics.compare import _INT_VIEW
from numerics.plan import SITES, AccumulationPlan
from numerics.reduction_order import ALTERNATIVES
from numerics.reference_step import ReferenceRun


@dataclass(frozen=True)
class Verdict:
    step: int
    buffer: str
    kind: str  # "order" or "bug"
    cause: str  # order: the site and order that explain it; bug: how far outside the envelope
    location: str  # stage / TP rank / shard / rank of the first differing element


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = _INT_VIEW[a.dtype]
    return (a.contiguous().view(view) != b.contiguous().view(view)).reshape(-1)


def group_sizes(plan: AccumulationPlan) -> dict[str, int]:
    c = plan.cfg
    return {"tp": c.tp, "cp": c.cp, "dp": c.dp * c.cp, "loss": c.dp * c.cp, "accum": c.micro_batches}


def suspect_sites(plan: AccumulationPlan, differing: Sequence[str]) -> list[str]:
    """Reduction sites that can move the differing buffers (groups of > 2 only)."""
    sites: list[str] = []
    for name in differing:
        if name.startswith("act/"):
            sites += ["tp"]
        elif name == "loss":
            sites += ["loss", "tp"]
        elif name.startswith("grad/"):
            sites += ["tp", "cp", "dp", "accum"]
    sizes = group_sizes(plan)
    return [s for s in SITES if s in sites and sizes[s] > 2]


def variants(plan: AccumulationPlan, sites: Sequence[str]) -> list[tuple[tuple[str, str], ...]]:
    """One site in another order at a time, then (two or more sites) every site in the same order."""
    own = {s: ("canonical" if s == "accum" else plan.order_of(s).name) for s in sites}
    out = [((s, o),) for s in sites for o in ALTERNATIVES if o != own[s]]
    if len(sites) > 1:
        out += [tuple((s, o) for s in sites) for o in ALTERNATIVES]
    return out


def _describe(variant: tuple[tuple[str, str], ...]) -> str:
    if len(variant) == 1:
        site, order = variant[0]
        return f"{site} ({SITES[site]}) in {order} order"
    return f"{' + '.join(s for s, _ in variant)} all in {variant[0][1]} order"


def _vstage_of(plan: AccumulationPlan, name: str) -> int:
    body = name.split("/", 1)[1]
    if body.startswith("layers."):
        i = int(body.split(".")[1])
        return next(vs for vs, layers in enumerate(plan.stage_layers) if i in layers)
    return 0 if body.startswith("embed") else plan.cfg.n_vstages_total - 1


def _rank(plan: AccumulationPlan, dp: int, pp: int, cp: int, tp: int) -> int:
    c = plan.cfg  # ranks ordered [TP, CP, PP, DP], innermost first
    return tp + c.tp * (cp + c.cp * (pp + c.pp * dp))


def locate_element(plan: AccumulationPlan, name: str, actual: torch.Tensor, expected: torch.Tensor,
                   step: int) -> str:
    """Where the first differing element of ``name`` lives: stage, TP rank, shard, global rank."""
    c = plan.cfg
    flat = _differs(actual, expected).nonzero()
    if flat.numel() == 0:
        return ""
    index = int(flat[0])
    if name == "loss":
        last = (c.n_vstages_total - 1) % c.pp
        return (f"step {step}: the loss on the last stage (pp rank {last}) of every dp x cp rank: token losses "
                "summed / tokens per step, then all-reduced over dp x cp")
    vs = _vstage_of(plan, name)
    pp = vs % c.pp
    if name.startswith("act/"):
        return _locate_activation(plan, name, actual, expected, step, vs)
    pname = name.split("/", 1)[1]
    bp = next(b for b in plan.buckets if any(p.name == pname for p in b.params))
    k = [p.name for p in bp.params].index(pname)
    param = bp.params[k]
    coords = list(torch.unravel_index(torch.tensor(index), param.shape))
    coords = [int(x) for x in coords]
    if param.tp_dim is None:
        tp, local, tp_text = 0, index, "every TP rank (replicated)"
    else:
        width = param.shape[param.tp_dim] // c.tp
        tp = coords[param.tp_dim] // width
        shard_shape = list(param.shape)
        shard_shape[param.tp_dim] = width
        local_coords = list(coords)
        local_coords[param.tp_dim] %= width
        local = 0
        for x, n in zip(local_coords, shard_shape):
            local = local * n + x
        tp_text = f"tp rank {tp}"
    shard = (bp.offsets[k] + local) // bp.shard_len
    dp, cp = divmod(shard, c.cp)
    layer = f"layer {pname.split('.')[1]}, " if pname.startswith("layers.") else ""
    return (f"step {step}: {layer}{pname} element {tuple(coords)}; stage {vs} (pp rank {pp}), {tp_text}, "
            f"dp x cp shard {shard} (dp {dp}, cp {cp}) = rank {_rank(plan, dp, pp, cp, tp)}")


def _locate_activation(plan: AccumulationPlan, name: str, actual: torch.Tensor, expected: torch.Tensor,
                       step: int, vs: int) -> str:
    c = plan.cfg
    d_all = _differs(actual, expected).reshape(actual.shape)  # [dp, mb, b, S, ...]
    per_token = d_all.reshape(*d_all.shape[:4], -1)
    hits = per_token.any(-1).nonzero().tolist()
    dp, mb, seq, tok = min(hits, key=lambda h: (h[1], h[0], h[2], h[3]))  # execution order: mb, then dp
    pos = plan_positions(plan, step)[dp][mb][seq]  # [cp, S/cp]
    cp = int((pos == tok).any(-1).nonzero()[0])
    j = int((pos[cp] == tok).nonzero()[0])
    point = name[4:]
    if point == "token_loss":
        tp = int(per_token[dp, mb, seq, tok].nonzero()[0])
    elif point.endswith("heads") or point == "logits":
        col = int(per_token[dp, mb, seq, tok].nonzero()[0])
        tp = col // (per_token.shape[-1] // c.tp)
    else:
        tp = j // (c.seq_len // c.cp // c.tp)
    pp = vs % c.pp
    return (f"step {step}: micro-batch {mb} (dp {dp}), sequence {seq}, token {tok}; stage {vs} (pp rank {pp}), "
            f"cp rank {cp}, tp rank {tp} = rank {_rank(plan, dp, pp, cp, tp)}")


def classify(plan: AccumulationPlan, steps: Sequence, parallel: Sequence[dict], reference: Sequence[dict],
             flatten: Callable[..., dict[str, torch.Tensor]]) -> tuple[Verdict, ...]:
    """One Verdict per mismatching (step, buffer), in comparison order."""
    bad = [(s.step, b.name) for s in steps for b in s.comparison.buffers if not b.bit_exact]
    if not bad:
        return ()
    sites = suspect_sites(plan, [n for _, n in bad])
    par = [flatten(plan, st, k, f"parallel step {k}") for k, st in enumerate(parallel)]
    ref = [flatten(plan, st, k, f"reference step {k}") for k, st in enumerate(reference)]
    alt: dict[tuple[tuple[str, str], ...], list[dict[str, torch.Tensor]]] = {}
    for variant in variants(plan, sites):
        vplan = plan
        for site, order in variant:
            vplan = vplan.with_order(site, order)
        run = ReferenceRun(vplan)
        alt[variant] = [flatten(vplan, run.step(), k, f"{_describe(variant)} step {k}") for k in range(plan.cfg.steps)]
    out = []
    for step, name in bad:
        p, r = par[step][name], ref[step][name]
        where = locate_element(plan, name, p, r, step)
        exact = [v for v, states in alt.items() if not bool(_differs(p, states[step][name]).any())]
        if exact:
            out.append(Verdict(step, name, "order", _describe(exact[0]), where))
            continue
        stack = torch.stack([r.double().reshape(-1)] + [s[step][name].double().reshape(-1) for s in alt.values()])
        lo, hi = stack.min(0).values, stack.max(0).values
        p64 = p.double().reshape(-1)
        moved = _differs(p, r)
        outside = moved & ~((p64 >= lo) & (p64 <= hi))
        if alt and not bool(outside.any()):
            near = min(alt, key=lambda v: int(_differs(p, alt[v][step][name]).sum()))
            out.append(Verdict(step, name, "order", f"within the envelope; nearest: {_describe(near)}", where))
        else:
            tried = f"{len(alt)} reorderings of {', '.join(sites)}" if alt else "no reordering possible (groups of <= 2)"
            out.append(Verdict(step, name, "bug", f"{int(outside.sum())}/{int(moved.sum())} differing elements "
                               f"outside the envelope ({tried})", where))
    return tuple(out)
