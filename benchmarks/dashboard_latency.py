"""Dashboard latency in a real browser: time to first render and to update after a heatmap click.

Serves `tracekit dashboard` on a store and drives Debian's headless Chromium (Playwright). Stores:
- wia: ByteDance's real what-if-analysis traces AR (16 ranks, 44 steps), when present;
- synthetic 64 ranks x 20 steps (tp 2, cp 2, pp 4, dp 4) from the discrete-event job model of
  tests/synthetic_job.py with rank 37 slowed 1.3x, written into a real DuckDB store.
First render: page load until the verdict, the heatmap canvas and the timeline title are on the
page. Click: mouse click on a heatmap cell until the timeline title and the selection line name
the new cell. The machine this ran on is shared, so repeat runs vary; compare within one run.

    PYTHONPATH=$PWD python benchmarks/dashboard_latency.py [--clicks 5] [--out /tmp/dash-bench]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import _dashboard as D  # noqa: E402

WIA = ROOT.parent / "shared" / "fixtures" / "real" / "wia" / "AR"


def synthetic_store(path: Path) -> Path:
    from synthetic_job import Faults, make_job

    from tracekit.store import connect
    from tracekit.topology import Layout

    tables = make_job(Layout(tp=2, cp=2, pp=4, dp=4), steps=20, microbatches=4,
                      faults=Faults(slow_rank=37, slow_factor=1.3), run_id="synthetic-64x20")
    con = connect(path)
    for name, df in tables.items():
        con.register("frame", df.to_arrow())
        con.execute(f"INSERT INTO {name} SELECT * FROM frame")
        con.unregister("frame")
    con.execute("UPDATE runs SET ingested_at = now() WHERE ingested_at IS NULL")
    con.close()
    return path


def wia_store(path: Path) -> Path:
    from tracekit.ingest import ingest

    ingest([WIA], path, workers=1)
    return path


def measure(store: Path, clicks: int, shots: Path) -> dict:
    spots = [(0.3 + 0.4 * (i % 2), 0.25 + 0.4 * ((i // 2) % 2)) for i in range(clicks)]
    with D.served(store) as url, D.chromium(Path(tempfile.mkdtemp(prefix="chromium-"))) as page:
        t0 = time.perf_counter()
        page.goto(url)
        D.wait_rendered(page)
        first = time.perf_counter() - t0
        page.screenshot(path=str(shots / f"{store.stem}-open.png"), full_page=True)
        updates = []
        for fx, fy in spots:
            t0 = time.perf_counter()
            try:
                D.click_heatmap(page, fx, fy)
            except TimeoutError:  # the click landed on the cell already selected
                continue
            updates.append(time.perf_counter() - t0)
        page.screenshot(path=str(shots / f"{store.stem}-clicked.png"), full_page=True)
    return {"first_render_s": first, "click_update_s": updates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clicks", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="dash-bench-")))
    args = ap.parse_args()
    if (why := D.browser_missing()):
        raise SystemExit(f"cannot run: {why}")
    args.out.mkdir(parents=True, exist_ok=True)
    stores = [synthetic_store(args.out / "synthetic-64x20.duckdb")]
    if WIA.is_dir():
        stores.append(wia_store(args.out / "wia-AR.duckdb"))
    print(f"{'store':<22} {'first render (s)':>17} {'click -> timeline (s), median [min..max]':>42}")
    for store in stores:
        r = measure(store, args.clicks, args.out)
        u = r["click_update_s"]
        clicks = (f"{statistics.median(u):.2f} [{min(u):.2f}..{max(u):.2f}] over {len(u)} clicks" if u
                  else "no click changed the cell")
        print(f"{store.stem:<22} {r['first_render_s']:>17.2f} {clicks:>42}")
    print(f"screenshots: {args.out}")


if __name__ == "__main__":
    main()
