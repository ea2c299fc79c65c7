"""Layout inference on groups that torch's own ``init_device_mesh`` creates (gloo, 8 ranks), every
dimension at 1 and above 1, with the mesh's names, with plain names, and with no names at all;
plus one profiled job whose trace goes through the real ingest."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import duckdb
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tracekit.layout_infer import infer_layout
from tracekit.topology import Layout

WORLD = 8
# (dp, pp, cp, tp): each dimension at 1 and at 2 somewhere, and one dimension holding the world
SHAPES = [(2, 2, 2, 1), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (8, 1, 1, 1), (1, 1, 1, 8), (1, 4, 1, 2),
          (2, 1, 4, 1)]
NAMES = ("dp", "pp", "cp", "tp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # one profiled collective per mesh group of one mesh, the job's only one so far: its trace's
    # distributedInfo.pg_config lists the groups as a real job records them
    mesh = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=NAMES)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name in NAMES:
            dist.all_reduce(torch.ones(4), group=mesh.get_group(name))
    Path(out, "traces").mkdir(exist_ok=True)
    prof.export_chrome_trace(str(Path(out, "traces", f"rank{rank}.json")))
    found = []
    for shape in SHAPES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
        groups = []
        for name in NAMES:
            g = mesh.get_group(name)
            groups.append({"desc": g.group_desc, "ranks": dist.get_process_group_ranks(g)})
        found.append({"shape": shape, "groups": groups})
    # torchtitan's HSDP mesh (parallel_dims.py): DP split in a replicate and a shard part, flattened
    # back into "dp" (data loading), "dp_shard_cp" (FSDP) and "dp_cp" (the loss) groups of their own
    titan = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    titan["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
    titan["dp_shard"]._flatten(mesh_dim_name="dp_shard_cp")
    titan["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp_cp")
    mine = [(titan[n].get_group().group_desc, dist.get_process_group_ranks(titan[n].get_group()))
            for n in ("dp_replicate", "dp_shard", "tp", "dp", "dp_shard_cp", "dp_cp")]
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    # ... and with PP, outermost as torchtitan puts it (Megatron-LM too: "tp-cp-ep-dp-pp")
    titan_pp = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    titan_pp["dp_shard"]._flatten(mesh_dim_name="dp")
    titan_pp["dp_shard"]._flatten(mesh_dim_name="dp_shard_cp")
    mine_pp = [(titan_pp[n].get_group().group_desc, dist.get_process_group_ranks(titan_pp[n].get_group()))
               for n in ("pp", "dp_shard", "tp", "dp", "dp_shard_cp")]
    every_pp = [None] * WORLD
    dist.all_gather_object(every_pp, mine_pp)
    if rank == 0:
        Path(out, "groups.json").write_text(json.dumps(found))
        Path(out, "titan_groups.json").write_text(json.dumps([g for gs in every for g in gs]))
        Path(out, "titan_pp_groups.json").write_text(json.dumps([g for gs in every_pp for g in gs]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mesh")
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, start_method="fork")
    return out


def _shapes(run: Path):
    for item in json.loads((run / "groups.json").read_text()):
        dp, pp, cp, tp = item["shape"]
        yield Layout(tp=tp, cp=cp, pp=pp, dp=dp), item["groups"]


def _all_groups(groups: list[dict], lay: Layout, rename) -> list[tuple]:
    """Every rank's view: the mesh groups of each rank (what pg_config of all ranks adds up to)."""
    out = [("default_pg", tuple(range(WORLD)))]
    for dim_index, g in enumerate(groups):
        dim = NAMES[dim_index]
        for r in range(WORLD):
            out.append((rename(g["desc"], dim), lay.group(r, dim)))
    return out


def test_device_mesh_describes_groups_as_mesh_dims(mesh_run):
    """torch names each dimension's group mesh_<dim>, sizes of 1 included; a dimension spanning the
    whole world reuses the default group (so its name is not recorded)."""
    for lay, groups in _shapes(mesh_run):
        for name, g in zip(NAMES, groups):
            assert len(g["ranks"]) == getattr(lay, name)
            assert g["desc"] == ("default_pg" if getattr(lay, name) == WORLD else f"mesh_{name}")


def test_mesh_names_give_the_layout_with_every_dimension_at_1_and_above(mesh_run):
    for lay, groups in _shapes(mesh_run):
        guess = infer_layout(WORLD, _all_groups(groups, lay, lambda desc, dim: desc))
        assert (guess.layout, guess.source, guess.ambiguity) == (lay, "group-names", None), lay


def test_plain_names_give_the_layout(mesh_run):
    for lay, groups in _shapes(mesh_run):
        guess = infer_layout(WORLD, _all_groups(groups, lay, lambda desc, dim: dim))
        assert (guess.layout, guess.source) == (lay, "group-names"), lay


def test_unnamed_groups_give_the_strides_and_say_when_names_were_guessed(mesh_run):
    for lay, groups in _shapes(mesh_run):
        guess = infer_layout(WORLD, _all_groups(groups, lay, lambda desc, dim: None))
        if max(lay.as_dict().values()) == WORLD:  # one dimension is the world: no group says which
            assert (guess.layout, guess.source) == (None, "unknown")
            continue
        assert guess.source == "group-structure"
        got = guess.layout
        # the same strides: the same groups, whatever they are called
        assert sorted(sorted(g) for d in NAMES for g in got.groups(d) if len(g) > 1) == \
            sorted(sorted(g) for d in NAMES for g in lay.groups(d) if len(g) > 1), lay
        if got != lay:
            assert guess.ambiguity and "guessed" in guess.ambiguity, lay


def test_torchtitans_hsdp_mesh_gives_dp_as_its_two_parts(mesh_run):
    """dp_replicate 2 x dp_shard 2 x tp 2, as torch records torchtitan's mesh: DP is 4, named so
    (the flattened 'mesh_dp' and the parts agree). 'mesh_dp_shard' used to read as DP of 2, against
    'mesh_dp' of 4: 'groups named alike have different sizes', and the layout fell to the structure."""
    groups = [("default_pg", tuple(range(WORLD)))] + [
        (desc, tuple(ranks)) for desc, ranks in json.loads((mesh_run / "titan_groups.json").read_text())]
    assert {d for d, _ in groups} >= {"mesh_dp_replicate", "mesh_dp_shard", "mesh_dp", "mesh_dp_shard_cp"}
    guess = infer_layout(WORLD, groups)
    assert (guess.layout, guess.source, guess.ambiguity) == (Layout(tp=2, dp=4), "group-names", None)
    # without the flattened groups the parts alone say as much
    parts = [(d, r) for d, r in groups if d in ("default_pg", "mesh_dp_replicate", "mesh_dp_shard", "mesh_tp")]
    assert infer_layout(WORLD, parts).layout == Layout(tp=2, dp=4)


def test_torchtitans_mesh_with_pp_outermost_gives_that_order(mesh_run):
    """pp 2 x dp_shard 2 x tp 2 as torch records torchtitan's mesh: rank = tp + 2 * (dp + 2 * pp).
    Held against the [TP, CP, PP, DP] order alone, the names did not fit and the structure read
    dp 4 x tp 2: PP lost, every pipeline group called DP."""
    from tracekit.topology import PP_OUTERMOST

    groups = [("default_pg", tuple(range(WORLD)))] + [
        (desc, tuple(ranks)) for desc, ranks in json.loads((mesh_run / "titan_pp_groups.json").read_text())]
    want = Layout(tp=2, pp=2, dp=2, order=PP_OUTERMOST)
    assert ("mesh_pp", want.group(0, "pp")) in groups and ("mesh_dp_shard", want.group(0, "dp")) in groups
    guess = infer_layout(WORLD, groups)
    assert (guess.layout, guess.source, guess.ambiguity) == (want, "group-names", None)
    # Megatron-LM's names in that order
    megatron = {"mesh_pp": "pipeline_model_parallel", "mesh_dp_shard": "data_parallel", "mesh_tp": "tensor_model_parallel"}
    plain = [(megatron.get(d, d), r) for d, r in groups if d in megatron]
    assert infer_layout(WORLD, plain).layout == want
    # no names: the groups that carried p2p are the pipeline's, whatever the order; whether the
    # stride-2 groups are DP or CP no group says, and the guess says it guessed
    unnamed = [(None, r) for d, r in groups if d in megatron]
    guess = infer_layout(WORLD, unnamed, p2p_groups=want.groups("pp"))
    assert guess.layout.groups("pp") == want.groups("pp") and "guessed" in guess.ambiguity


def test_p2p_groups_name_the_pipeline(mesh_run):
    for lay, groups in _shapes(mesh_run):
        if lay.pp == 1:
            continue
        unnamed = _all_groups(groups, lay, lambda desc, dim: None)
        guess = infer_layout(WORLD, unnamed, p2p_groups=lay.groups("pp"))
        assert guess.layout.pp == lay.pp and guess.layout.groups("pp") == lay.groups("pp"), lay


def test_ingest_reads_the_mesh_from_a_real_profiler_trace(mesh_run, tmp_path):
    store = tmp_path / "s.duckdb"
    from click.testing import CliRunner

    from tracekit.cli import main

    res = CliRunner().invoke(main, ["ingest", str(mesh_run / "traces"), "--store", str(store)])
    assert res.exit_code == 0, res.output
    con = duckdb.connect(str(store), read_only=True)
    row = con.execute("SELECT layout_source, dp, pp, cp, tp FROM runs").fetchone()
    assert row == ("group-names", 2, 1, 2, 2)
    dims = dict(con.execute("SELECT pg_desc, any_value(dim) FROM groups WHERE size > 1 GROUP BY 1").fetchall())
    assert dims["mesh_tp"] == "tp" and dims["mesh_cp"] == "cp" and dims["mesh_dp"] == "dp"
