"""The memory view in a real browser (Debian's headless Chromium via Playwright): the hover shows
the whole stack of the allocation under the mouse, on a store whose slow rank's memory is a real
CUDA snapshot (an H100 FSDP2 run, tests/gpu_fixtures/native_fsdp2_h100; the oracle is the
pickle), and on the bundled trainer run, whose CPU snapshots' stacks are the profiler spans
around each allocation; and linked selections: a click on the memory curve, on the step timeline's peer lanes
and on the heatmap moves every other view."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytestmark = pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing()))
SNAPSHOT = Path(__file__).parent / "gpu_fixtures" / "native_fsdp2_h100" / "memory" / "rank0.pickle"
SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8"

TOOLTIP_JS = """() => {  // the texts of the tooltips shown (Bokeh draws them in the plot's shadow root)
    const out = [];
    const walk = (n) => {
        if (n.shadowRoot) walk(n.shadowRoot);
        if (n.classList && n.classList.contains("bk-tooltip-content") && n.innerText) out.push(n.innerText);
        for (const c of n.children ?? []) walk(c);
    };
    walk(document.body);
    return out;
}"""


def _python_stacks() -> set[str]:
    with open(SNAPSHOT, "rb") as f:
        raw = pickle.load(f)  # our own committed fixture
    stacks = set()
    for e in raw["device_traces"][0]:
        lines = [f"{f['filename']}:{f['line']}:{f['name']}" for f in e.get("frames") or []
                 if str(f["filename"]).endswith(".py")]
        if lines:
            stacks.add("\n".join(lines[:32]))
    return stacks


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The job model's store with rank SLOW's memory in run "slow" replaced by the real snapshot."""
    import duckdb

    from tracekit.ingest import pipeline

    root = tmp_path_factory.mktemp("memstack")
    path = D.job_store(root, 300)
    snap = root / "snap"
    snap.mkdir()
    (snap / "rank0.pickle").write_bytes(SNAPSHOT.read_bytes())
    pipeline.ingest([snap / "rank0.pickle"], root / "snap.duckdb")
    con = duckdb.connect(str(path))
    con.execute(f"ATTACH '{root / 'snap.duckdb'}' AS snap (READ_ONLY)")
    con.execute("DELETE FROM memory_events WHERE run_id = 'slow' AND rank = ?", [D.SLOW])
    con.execute("INSERT INTO memory_events BY NAME SELECT * REPLACE ('slow' AS run_id, ? AS rank) "
                "FROM snap.memory_events", [D.SLOW])
    con.close()
    return path


def _hover_the_deepest_stack(page, stacks: set[str], shot: Path, right_of: float = 0.5) -> None:
    """Hover the point of the memory curve with the deepest stack right of ``right_of`` of the time
    axis (its tooltip fits on the left) and check that the tooltip shows that stack, which must be
    one of ``stacks``."""
    page.locator(".tk-memory canvas").first.wait_for(timeout=60_000)
    mem = D.text(page, ".tk-memory")
    assert "its stack" in mem and "allocation sites unknown" not in mem
    shipped = D.plot_column(page, "tk-memory-fig", "stack")
    t_ms = D.plot_column(page, "tk-memory-fig", "t_ms")
    right = [i for i in range(len(t_ms)) if t_ms[i] > min(t_ms) + right_of * (max(t_ms) - min(t_ms))]
    deep = max(right, key=lambda i: (shipped[i] or "").count("\n"))
    assert shipped[deep] in stacks  # the browser holds each point's stack as the snapshot has it
    px, py = D.plot_point(page, "tk-memory-fig", t_ms[deep], None)
    page.mouse.move(px - 40, py)  # a move over the plot (not a jump onto it) fires the hover
    page.mouse.move(px, py, steps=8)
    D.wait_for(lambda: page.evaluate(TOOLTIP_JS), "no tooltip over the memory curve", 30)
    shown = page.evaluate(TOOLTIP_JS)
    assert any(any(s.split("\n")[0] in tip and s.split("\n")[-1] in tip for s in stacks) for tip in shown)
    assert any(shipped[deep].split("\n")[-1] in tip for tip in shown)
    page.locator(".tk-memory").first.screenshot(path=str(shot))


def test_hovering_the_memory_curve_shows_the_allocation_s_whole_stack(store, tmp_path):
    with D.served(store) as url, D.chromium(tmp_path / "profile") as page:
        page.goto(url)
        D.wait_rendered(page)
        assert D.focus(page)[0] == D.SLOW
        _hover_the_deepest_stack(page, _python_stacks(), tmp_path / "memory-hover.png")


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason=f"bundled sample run not found at {SAMPLE}")
def test_hovering_a_trainer_run_s_memory_shows_the_spans_that_allocated(tmp_path):
    """The bundled trainer run (CPU snapshots): a point's stack is the profiler op and the trainer's
    annotations around the allocation, as the rank's pickle has them (the oracle reads the pickle)."""
    run = tmp_path / "slow_rank_8"
    shutil.copytree(SAMPLE, run)  # the store is written next to the run; keep the repo clean
    rank = json.loads((run / "manifest.json").read_text())["faults"][0]["ranks"][0]  # the page's focus
    with open(run / "memory" / f"rank{rank}.pickle", "rb") as f:
        raw = pickle.load(f)  # our own committed sample
    stacks = {"\n".join(f"{f['filename']}:{f['line']}:{f['name']}" for f in e["frames"][:32])
              for e in raw["device_traces"][0] if e["frames"]}
    assert any(s.startswith("<profiler op>:0:") and "<annotation>:0:tk.compute phase=" in s for s in stacks)
    with D.served(run) as url, D.chromium(tmp_path / "profile") as page:
        page.goto(url)
        D.wait_rendered(page)
        assert D.focus(page)[0] == rank
        page.locator(".tk-memory canvas").first.wait_for(timeout=60_000)
        assert "allocated by <profiler op>:0:" in D.text(page, ".tk-memory")
        page.locator(".tk-memory").first.screenshot(path=str(tmp_path / "memory-trainer.png"))  # docs/img
        _hover_the_deepest_stack(page, stacks, tmp_path / "memory-hover-trainer.png", right_of=0.75)


STEP_STARTS_JS = """() => {  // the memory plot's step starts (x in ms on its axis, step)
    const view = Bokeh.index.query_one(v => v.model.name === "tk-memory-fig" && v.frame !== undefined);
    const r = view.model.renderers.find(r => r.data_source.data.step !== undefined);
    return [Array.from(r.data_source.data.x), Array.from(r.data_source.data.step)];
}"""


def _memory_axis(page) -> str:
    """The memory plot's x-axis label (drawn on its canvas: read from the browser's model)."""
    return page.evaluate("""() => Bokeh.index.query_one(v => v.model.name === "tk-memory-fig"
                                                          && v.frame !== undefined).model.below[0].axis_label""")


def test_clicks_on_memory_timeline_and_heatmap_move_every_view(tmp_path):
    store = D.job_store(tmp_path, 600)  # rank SLOW's memory is on the steps' clock
    with D.served(store) as url, D.chromium(tmp_path / "profile") as page:
        page.goto(url)
        D.wait_rendered(page)
        page.locator(".tk-memory canvas").first.wait_for(timeout=60_000)
        rank, step = D.focus(page)
        assert rank == D.SLOW
        xs, steps = page.evaluate(STEP_STARTS_JS)
        i = next(k for k in range(len(steps) - 1) if steps[k] != step)  # another step's window
        target = steps[i]
        # memory -> every view: a click inside that step's window selects it
        D.click_and_wait(page, "tk-memory-fig", (xs[i] + xs[i + 1]) / 2, None, lambda: D.focus(page) == (D.SLOW, target))
        D.wait_for(lambda: D.timeline_title(page) == (D.SLOW, target), "the timeline never followed the memory click")
        assert f"rank {D.SLOW}'s step {target} start" in _memory_axis(page)  # re-centred on it
        # timeline -> every view: a click on the peer's lanes selects the peer in the same step
        peer = int(D.text(page, ".tk-timeline-title").split("healthy peer rank ")[1].split()[0].strip("*"))
        D.click_and_wait(page, "tk-timeline-fig", None, 2.0, lambda: D.focus(page)[0] == peer)
        D.wait_for(lambda: D.timeline_title(page) == (peer, target), "the timeline never selected the peer")
        assert f"selected rank {peer}" in D.text(page, ".tk-drilldown")
        assert f"rank {peer} has no snapshot" in D.text(page, ".tk-memory")
        # heatmap -> memory: the slow rank's cell in another step shades that step on its curve
        (r, s), _ = D.click_heatmap(page, 1, D.SLOW)
        assert r == D.SLOW
        D.wait_for(lambda: f"rank {D.SLOW}'s step {s} start" in _memory_axis(page),
                   "the memory view never followed the heatmap click")
