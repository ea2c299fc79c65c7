"""The memory view's hover in a real browser (Debian's headless Chromium via Playwright): the whole
stack of the allocation under the mouse, on a store whose slow rank's memory is a real CUDA
snapshot (an H100 FSDP2 run, tests/gpu_fixtures/native_fsdp2_h100). The oracle is the pickle."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytestmark = pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing()))
SNAPSHOT = Path(__file__).parent / "gpu_fixtures" / "native_fsdp2_h100" / "memory" / "rank0.pickle"

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


def test_hovering_the_memory_curve_shows_the_allocation_s_whole_stack(store, tmp_path):
    stacks = _python_stacks()
    with D.served(store) as url, D.chromium(tmp_path / "profile") as page:
        page.goto(url)
        D.wait_rendered(page)
        page.locator(".tk-memory canvas").first.wait_for(timeout=60_000)
        assert D.focus(page)[0] == D.SLOW
        mem = D.text(page, ".tk-memory")
        assert "its stack" in mem and "allocation sites unknown" not in mem
        shipped = D.plot_column(page, "tk-memory-fig", "stack")
        t_ms = D.plot_column(page, "tk-memory-fig", "t_ms")
        deep = max(range(len(shipped)), key=lambda i: shipped[i].count("\n"))
        assert shipped[deep] in stacks  # the browser holds each point's stack as the snapshot has it
        px, py = D.plot_point(page, "tk-memory-fig", t_ms[deep], None)
        page.mouse.move(px - 40, py)  # a move over the plot (not a jump onto it) fires the hover
        page.mouse.move(px, py, steps=8)
        D.wait_for(lambda: page.evaluate(TOOLTIP_JS), "no tooltip over the memory curve", 30)
        shown = page.evaluate(TOOLTIP_JS)
        assert any(any(s.split("\n")[0] in tip and s.split("\n")[-1] in tip for s in stacks) for tip in shown)
        assert any(shipped[deep].split("\n")[-1] in tip for tip in shown)
        page.locator(".tk-memory").first.screenshot(path=str(tmp_path / "memory-hover.png"))
