"""Dashboard latency in a real browser: time to first render and to update after a click.

Serves `tracekit dashboard` on a store and drives Debian's headless Chromium (Playwright). Stores:
- simulated jobs (`tracekit simulate`, ingested): 8 ranks (tp 2, pp 2, dp 2, 6 steps), 64 ranks
  (tp 2, cp 2, pp 4, dp 4, 10 steps) and 1,024 ranks (tp 4, cp 2, pp 4, dp 32, 4 steps), one rank
  slowed 1.3x; written once into --cache (the 1,024-rank ingest takes minutes) and reused;
- with --legacy also: the job model at 64 ranks x 20 steps, a crowded 16-rank store (GPU-kernel-
  sized spans, 1.5 M events) and ByteDance's real what-if-analysis traces AR, when present.
First render: page load until the verdict, the heatmap canvas and the step timeline's title are on
the page; "every view": until the views below the first screen (CP wait, memory, numerics) are on
it too, and "job raster": the whole-job raster drawn (these join the page after the first render).
Click: mouse click on a heatmap cell until the step timeline's title and
the selection line name the new cell ("heatmap"), and on the whole-job raster until the selection
line names the rank under it ("job"); "kB/click" is what the server sent the browser for a heatmap
click (websocket frames).

The machine this runs on is shared, so absolute times move with its load (printed with every
row). ``--baseline REV`` measures the dashboard of git revision REV (exported to a temporary
directory and served from there) on the same stores, alternating with this one, and prints the
ratios: a comparison under the same load.

    PYTHONPATH=$PWD python benchmarks/dashboard_latency.py [--ranks 8 64 1024] [--clicks 6] [--repeat 1]
        [--cache DIR] [--baseline main] [--legacy] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import _dashboard as D  # noqa: E402

WIA = ROOT / "tests" / "fixtures" / "real" / "wia" / "AR"


def synthetic_store(path: Path) -> Path:
    from synthetic_job import Faults, make_job

    from tracekit.topology import Layout

    return D.write_store(path, make_job(Layout(tp=2, cp=2, pp=4, dp=4), steps=20, microbatches=4,
                                        faults=Faults(slow_rank=37, slow_factor=1.3), run_id="synthetic-64x20"))


def crowded_store(path: Path) -> Path:
    from synthetic_job import Faults, make_job

    from tracekit.topology import Layout

    return D.write_store(path, D.with_kernels(make_job(Layout(tp=1, cp=1, pp=4, dp=4), steps=10, microbatches=4,
                                                       faults=Faults(slow_rank=9, slow_factor=1.3),
                                                       run_id="crowded-16x10")))


SIMULATED = {8: dict(tp=2, pp=2, dp=2, steps=6, faults=("slow:rank=5,factor=1.3",)),
             64: dict(tp=2, cp=2, pp=4, dp=4, steps=10, faults=("slow:rank=37,factor=1.3",)),
             1024: dict(tp=4, cp=2, pp=4, dp=32, steps=4, faults=("slow:rank=301,factor=1.3",))}


def simulated_store(ranks: int, cache: Path) -> Path:
    """The simulated job of ``ranks`` ranks, ingested into cache/sim<ranks>.duckdb (once)."""
    from tracekit.ingest import ingest
    from tracekit.simulate import SimConfig, simulate

    path = cache / f"sim{ranks}.duckdb"
    if not path.is_file():
        run = simulate(SimConfig(seed=2, **SIMULATED[ranks]), cache / f"sim{ranks}")
        ingest([run], path.with_suffix(".partial"), workers=2)
        path.with_suffix(".partial").rename(path)
    return path


def wia_store(path: Path) -> Path:
    from tracekit.ingest import ingest

    path.unlink(missing_ok=True)
    ingest([WIA], path, workers=1)
    return path


def grid(store: Path) -> tuple[int, int]:
    """(steps, ranks) of the store's run, for choosing cells to click."""
    import duckdb

    con = duckdb.connect(str(store), read_only=True)
    steps, ranks = con.execute("SELECT count(DISTINCT step), count(DISTINCT rank) FROM steps").fetchone()
    con.close()
    return steps, ranks


def export(rev: str, into: Path) -> Path:
    """The source tree of git revision ``rev`` (apps/, tracekit/, ...) under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(store: Path, clicks: int, shots: Path, root: Path = D.ROOT, tag: str = "") -> dict:
    steps, ranks = grid(store)
    cells = [(int(steps * (0.15 + 0.7 * ((i * 0.37) % 1))), int(ranks * (0.1 + 0.8 * ((i * 0.61) % 1))))
             for i in range(clicks)]
    received: list[int] = []
    with D.served(store, root=root) as url, D.chromium(Path(tempfile.mkdtemp(prefix="chromium-"))) as page:
        page.on("websocket", lambda ws: ws.on("framereceived", lambda p: received.append(len(p))))
        t0 = time.perf_counter()
        page.goto(url)
        D.wait_rendered(page)
        first = time.perf_counter() - t0
        D.wait_every_view(page)
        every = time.perf_counter() - t0
        raster = time.perf_counter() - t0 if D.wait_job_raster(page, 60_000) else None
        page.wait_for_timeout(500)  # let the page settle (late layout messages) before clicking
        page.screenshot(path=str(shots / f"{store.stem}{tag}-open.png"), full_page=True, timeout=180_000)
        updates, sent, job = [], [], []
        for step_index, rank in cells:
            if D.focus(page)[0] == rank:
                rank = (rank + 1) % ranks
            received.clear()
            _, dt = D.click_heatmap(page, step_index, rank)
            updates.append(dt)
            page.wait_for_timeout(300)  # anything sent after the title changed counts too
            sent.append(sum(received) / 1e3)
        if page.locator(".tk-job-timeline").count():  # the whole-job raster: a click selects the rank under it
            for _, rank in cells:
                if D.focus(page)[0] == rank:
                    rank = (rank + 1) % ranks
                x = page.evaluate("""() => { const v = Bokeh.index.query_one(v => v.model.name === "tk-job-fig");
                                             const r = v.model.x_range; return (r.start + r.end) / 2; }""")
                job.append(D.click_and_wait(page, "tk-job-fig", x, rank, lambda: D.focus(page)[0] == rank))
                page.wait_for_timeout(300)
        page.screenshot(path=str(shots / f"{store.stem}{tag}-clicked.png"), full_page=True, timeout=180_000)
    return {"first_render_s": first, "every_view_s": every, "job_raster_s": raster, "click_update_s": updates,
            "kb_per_click": sent, "job_click_s": job}


def _row(name: str, r: dict) -> str:
    def spread(u: list[float]) -> str:
        return f"{statistics.median(u):.2f} [{min(u):.2f}..{max(u):.2f}]" if u else "-"
    raster = "-" if r["job_raster_s"] is None else f"{r['job_raster_s']:.2f}"
    return (f"{name:<18} {r['first_render_s']:>12.2f} {r['every_view_s']:>10.2f} {raster:>10} "
            f"{spread(r['click_update_s']):>26} "
            f"{spread(r['job_click_s']):>26} "
            f"{statistics.median(r['kb_per_click']):>9.1f} {os.getloadavg()[0]:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=sorted(SIMULATED), choices=sorted(SIMULATED))
    ap.add_argument("--clicks", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=1, help="measure each store this many times (rows each)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tracekit-dash-bench",
                    help="where the simulated stores are written once and reused")
    ap.add_argument("--baseline", metavar="REV", help="also measure the dashboard of this git revision")
    ap.add_argument("--legacy", action="store_true", help="also the job-model, crowded and WIA stores")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="dash-bench-")))
    args = ap.parse_args()
    if (why := D.browser_missing()):
        raise SystemExit(f"cannot run: {why}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    base = export(args.baseline, args.out / "baseline") if args.baseline else None
    stores = [simulated_store(n, args.cache) for n in args.ranks]
    if args.legacy:
        stores += [synthetic_store(args.out / "synthetic-64x20.duckdb"), crowded_store(args.out / "crowded-16x10.duckdb")]
        if WIA.is_dir():
            stores.append(wia_store(args.out / "wia-AR.duckdb"))
    print(f"{'store':<18} {'first render':>12} {'every view':>10} {'job raster':>10} {'heatmap click (s) med [range]':>26} "
          f"{'job click (s) med [range]':>26} {'kB/click':>9} {'load':>6}")
    for store in [s for s in stores for _ in range(args.repeat)]:
        now = measure(store, args.clicks, args.out)
        print(_row(store.stem, now), flush=True)
        if base is not None:
            then = measure(store, args.clicks, args.out, root=base, tag="-baseline")
            print(_row(f"{store.stem} @{args.baseline}", then), flush=True)
            print(f"{'':<27} {'ratio baseline/now':>16}: first render {then['first_render_s'] / now['first_render_s']:.1f}x, "
                  f"click {statistics.median(then['click_update_s']) / statistics.median(now['click_update_s']):.1f}x",
                  flush=True)
    print(f"screenshots: {args.out}")


if __name__ == "__main__":
    main()
