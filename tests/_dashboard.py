"""Drive the dashboard in Debian's headless Chromium (Playwright, never a downloaded browser).

Shared by tests/test_dashboard_browser.py and benchmarks/dashboard_latency.py: write a store, start
`tracekit dashboard` on it, open it, wait for views, click a point of a plot, read the page.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def browser_missing() -> str | None:
    """Why the browser checks cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "python package playwright not installed (pip install playwright; no browser download needed)"
    return None


def write_store(path: Path, tables: dict, when: str | None = None, fresh: bool = True) -> Path:
    """A real store file holding ``tables`` (the store's table name -> polars frame), ingested at
    ``when`` (default now); ``fresh=False`` adds them to the store already there."""
    from tracekit.store import connect

    if fresh:
        path.unlink(missing_ok=True)
    con = connect(path)
    for name, df in tables.items():
        con.register("frame", df.to_arrow())
        con.execute(f"INSERT INTO {name} SELECT * FROM frame")
        con.unregister("frame")
    con.execute("UPDATE runs SET ingested_at = coalesce(?::TIMESTAMP, now()) WHERE ingested_at IS NULL", [when])
    con.close()
    return path


def with_kernels(tables: dict, kernel_ns: int = 20_000, gap_ns: int = 5_000) -> dict:
    """The job model's tables with every annotated compute span replaced by GPU-kernel-sized spans
    (``kernel_ns`` long, ``gap_ns`` apart, no phase: what a GPU trace without annotations holds),
    so that a step's compute lane holds thousands of spans."""
    import polars as pl

    ev = tables["events"]
    annotated = pl.col("phase").is_in(["fwd", "bwd"]).fill_null(False)
    kernels = ev.filter(annotated).with_columns(
        pl.int_ranges(0, pl.col("dur_ns") // (kernel_ns + gap_ns)).alias("k")).explode("k").drop_nulls("k")
    kernels = kernels.with_columns(
        (pl.col("ts_ns") + pl.col("k") * (kernel_ns + gap_ns)).alias("ts_ns"), pl.lit(kernel_ns).alias("dur_ns"),
        pl.lit("kernel").alias("kind"), pl.format("sm90_xmma_gemm_{}", pl.col("k") % 7).alias("name"),
        pl.lit(None, pl.Utf8).alias("phase")).select(ev.columns).cast(ev.schema)
    return {**tables, "events": pl.concat([ev.filter(~annotated), kernels])}


def memory_rows(run_id: str, rank: int, t0: int, t1: int, n: int):
    """An allocator trace for ``rank`` between t0 and t1 (memory_events rows): blocks allocated and
    freed in turn, one 64 MiB block in the middle making the peak."""
    import numpy as np
    import polars as pl

    rows, live = [], []
    for i, t in enumerate(np.linspace(t0, t1, n).astype(np.int64)):
        if live and i % 3 == 2:
            addr, size = live.pop()
            rows.append((run_id, rank, i, int(t), "free_completed", addr, size))
        else:
            size = 64 << 20 if i == n // 2 else 1 << 20
            live.append((1000 + i, size))
            rows.append((run_id, rank, i, int(t), "alloc", 1000 + i, size))
    df = pl.DataFrame(rows, schema=["run_id", "rank", "seq", "ts_ns", "action", "addr", "size"], orient="row")
    return df.with_columns(pl.lit(None, pl.Int64).alias("stream"), pl.lit(None, pl.Utf8).alias("category"),
                           pl.lit(None, pl.Utf8).alias("frame"), pl.lit(None, pl.Utf8).alias("frames"))


NUMERICS = ROOT / "tests" / "numerics_fixture"
SLOW = 5  # the slowed rank of ``job_store``'s run "slow": dp 0, pp 1, cp 0, tp 1 of tp 2 x cp 2 x pp 2 x dp 2


def job_store(root: Path, memory_points: int) -> Path:
    """A store of the job model (tests/synthetic_job.py, tp 2 x cp 2 x pp 2 x dp 2, 6 steps) with
    three runs: "broken" (its memory trace has a negative size, its numerics.json is not JSON),
    "clean", and "slow" (rank SLOW 1.5x,
    ingested last). "slow" has a numerics.json in its run directory, rank SLOW a memory trace of
    ``memory_points`` events on the steps' clock and rank 0 one of 300 on a clock of its own."""
    import json

    import polars as pl
    from synthetic_job import Faults, make_job

    from tracekit.topology import Layout

    layout, path = Layout(tp=2, cp=2, pp=2, dp=2), root / "store.duckdb"
    broken = make_job(layout, steps=6, run_id="broken")
    broken["memory_events"] = memory_rows("broken", 0, 0, 10**9, 30).with_columns(pl.lit(-1, pl.Int64).alias("size"))
    (root / "broken-run").mkdir()
    (root / "broken-run" / "numerics.json").write_text("[{not json")
    broken["runs"] = broken["runs"].with_columns(pl.lit(str(root / "broken-run")).alias("root"))
    slow = make_job(layout, steps=6, faults=Faults(slow_rank=SLOW, slow_factor=1.5), run_id="slow")
    run_dir = root / "slow-run"
    run_dir.mkdir()
    for f in NUMERICS.iterdir():  # a real `numerics check --out` report (tests/numerics_fixture/README.md)
        if f.suffix == ".json":
            (run_dir / f.name).write_bytes(f.read_bytes())
    slow["runs"] = slow["runs"].with_columns(pl.lit(str(run_dir)).alias("root"))
    steps = slow["steps"].filter(pl.col("rank") == SLOW)
    slow["memory_events"] = pl.concat([
        memory_rows("slow", SLOW, steps["start_ns"].min(), steps["end_ns"].max(), memory_points),
        memory_rows("slow", 0, 10**9, 2 * 10**9, 300)])
    for when, tables in (("2026-01-01", broken), ("2026-01-02", make_job(layout, steps=6, run_id="clean")),
                         ("2026-01-03", slow)):
        write_store(path, tables, when=when, fresh=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(store: Path, timeout_s: float = 180.0, root: Path = ROOT):
    """`tracekit dashboard <store>` in a subprocess, from the source tree ``root`` (this one unless
    a benchmark compares with another version); yields the page URL; stops it afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "BOKEH_LOG_LEVEL": "warn"}
    log = open(store.parent / f"dashboard-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from tracekit.cli import main; main()", "dashboard", str(store),
                             "--port", str(port)], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/dashboard"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dashboard not answering at {url}: {Path(log.name).read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextmanager
def chromium(user_data_dir: Path):
    """A headless Debian Chromium page (fresh, empty profile)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1600, "height": 1300})
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


def wait_rendered(page, timeout_ms: int = 120_000) -> None:
    """Until the verdict, a drawn heatmap and the timeline's title are on the page."""
    page.locator(".tk-verdict").first.wait_for(timeout=timeout_ms)
    page.locator(".tk-heatmap canvas").first.wait_for(timeout=timeout_ms)
    page.locator(".tk-timeline-title").first.wait_for(timeout=timeout_ms)


def wait_job_raster(page, timeout_ms: int = 120_000) -> bool:
    """Until the whole-job raster is drawn (it joins the page after the first render); False for a
    version of the dashboard without it."""
    try:
        page.locator(".tk-job-plot canvas").first.wait_for(timeout=timeout_ms)
    except Exception:  # playwright's TimeoutError: no whole-job view in this version
        return False
    return True


def wait_every_view(page, timeout_ms: int = 120_000) -> None:
    """Until the views below the first screen (CP wait, memory, numerics) are on the page too."""
    for css in (".tk-cpwait", ".tk-memory", ".tk-numerics"):
        page.locator(css).first.wait_for(state="attached", timeout=timeout_ms)


FOCUS = re.compile(r"rank (\d+) \(dp (\d+), pp (\d+), cp (\d+), tp (\d+)\), step (\d+)")
TITLE = re.compile(r"Timeline: step (\d+), rank (\d+)")


TEXT_JS = """el => {
    const out = [];
    const walk = (n) => {
        if (n.nodeType === Node.TEXT_NODE) { out.push(n.textContent); return; }
        if (n.nodeName === 'STYLE' || n.nodeName === 'SCRIPT') return;
        if (n.shadowRoot) walk(n.shadowRoot);
        for (const c of n.childNodes) walk(c);
    };
    walk(el);
    return out.join(' ').replace(/\\s+/g, ' ');
}"""


def text(page, css_class: str) -> str:
    """Visible text under the first element with ``css_class``, through nested shadow roots (Panel
    renders each pane's content in one), without style sheets."""
    return page.locator(css_class).first.evaluate(TEXT_JS)


def focus(page) -> tuple[int, int]:
    """(rank, step) the page's shared selection says."""
    m = FOCUS.search(text(page, ".tk-focus"))
    assert m, "no selection line on the page"
    return int(m.group(1)), int(m.group(6))


def timeline_title(page) -> tuple[int, int]:
    """(rank, step) the timeline shows."""
    m = TITLE.search(text(page, ".tk-timeline-title"))
    assert m, "no timeline title on the page"
    return int(m.group(2)), int(m.group(1))


POINT_JS = """([name, x, y]) => {
    const named = (v) => v.model.name === name || (v.model.title?.text ?? "").startsWith(name);
    const view = Bokeh.index.query_one(v => v.frame !== undefined && named(v));
    if (view == null) return null;
    view.el.scrollIntoView({block: "center"});
    const box = view.el.getBoundingClientRect();
    const sx = Array.isArray(x) ? view.model.x_range.synthetic(x) : x;
    const sy = y === null ? view.frame.bbox.vcenter : view.frame.y_scale.compute(y);
    const px = x === null ? view.frame.bbox.hcenter : view.frame.x_scale.compute(sx);
    return [box.left + px, box.top + sy];
}"""


def plot_point(page, figure: str, x, y: float | None) -> tuple[float, float]:
    """Where data point (x, y) of the Bokeh figure named ``figure`` (or whose title starts so)
    is on the page (viewport pixels, after scrolling it into view); x may be a factor (a list) on
    a categorical axis, x or y None for the middle of the plot."""
    pt = page.evaluate(POINT_JS, [figure, x, y])
    assert pt is not None, f"no plot named {figure!r} on the page"
    return pt[0], pt[1]


def plot_column(page, figure: str, column: str) -> list:
    """A column of the data source of the first glyph of the Bokeh figure named ``figure``, as the
    browser holds it (what the server shipped)."""
    return page.evaluate("""([name, column]) => {
        const view = Bokeh.index.query_one(v => v.model.name === name && v.frame !== undefined);
        return Array.from(view.model.renderers[0].data_source.data[column]);
    }""", [figure, column])


def wheel_zoom(page, figure: str, x: float, y: float, notches: int) -> None:
    """Zoom ``figure`` in around data point (x, y) with the mouse wheel (its wheel-zoom tool made
    active first: the dashboard leaves page scrolling to the wheel)."""
    page.evaluate("""(name) => {
        const view = Bokeh.index.query_one(v => v.model.name === name && v.frame !== undefined);
        const bar = view.model.toolbar;
        bar.active_scroll = bar.tools.find(t => t.type === "WheelZoomTool");
    }""", figure)
    px, py = plot_point(page, figure, x, y)
    page.mouse.move(px, py)
    for _ in range(notches):
        page.mouse.wheel(0, -200)
        page.wait_for_timeout(30)


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def click_and_wait(page, figure: str, x, y: float | None, changed, timeout_s: float = 60.0) -> float:
    """Click data point (x, y) of ``figure``; wait until ``changed()`` is true. Returns the
    seconds from the click to the change (what the latency benchmark reports)."""
    px, py = plot_point(page, figure, x, y)
    t0 = time.perf_counter()
    page.mouse.click(px, py)
    wait_for(changed, f"nothing changed after a click at ({x}, {y}) of {figure}", timeout_s)
    return time.perf_counter() - t0


HEATMAP = "lateness: peers waited on it"  # the heatmap's title (in every version of the dashboard)


def click_heatmap(page, step_index: int, rank: int, timeout_ms: int = 60_000) -> tuple[tuple[int, int], float]:
    """Click the heatmap cell of (step_index, rank); wait until the timeline's title and the
    selection line both show a new cell. Returns the timeline's (rank, step) and the seconds from
    the click until both had changed."""
    before = text(page, ".tk-timeline-title")
    dt = click_and_wait(page, HEATMAP, step_index, rank,
                        lambda: text(page, ".tk-timeline-title") != before, timeout_ms / 1000)
    shown = timeline_title(page)
    wait_for(lambda: focus(page) == shown, f"the selection line never showed the clicked cell {shown}",
             timeout_ms / 1000)
    return shown, dt
