"""Dashboard latency in a real browser: time to first render and to update after a heatmap click.

Serves `tracekit dashboard` on a store and drives Debian's headless Chromium (Playwright). Stores:
- synthetic 64 ranks x 20 steps (tp 2, cp 2, pp 4, dp 4) from the discrete-event job model of
  tests/synthetic_job.py with rank 37 slowed 1.3x, written into a real DuckDB store;
- crowded 16 ranks x 10 steps (pp 4, dp 4): the same model with every compute span replaced by
  GPU-kernel-sized spans (20 us kernels, 5 us apart: about 9,000 per rank and step, 1.5 M
  events), so the timeline's compute lanes are too crowded to ship span by span;
- wia: ByteDance's real what-if-analysis traces AR (16 ranks, 44 steps), when present.
First render: page load until the verdict, the heatmap canvas and the timeline title are on the
page. Click: mouse click on a heatmap cell until the timeline title and the selection line name
the new cell; "kB/click" is what the server sent the browser for it (websocket frames).

The machine this runs on is shared, so absolute times move with its load (printed with every
row). ``--baseline REV`` measures the dashboard of git revision REV (exported to a temporary
directory and served from there) on the same stores, alternating with this one, and prints the
ratios: a comparison under the same load.

    PYTHONPATH=$PWD python benchmarks/dashboard_latency.py [--clicks 6] [--baseline main] [--out DIR]
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
        page.wait_for_timeout(500)  # let the page settle (late layout messages) before clicking
        page.screenshot(path=str(shots / f"{store.stem}{tag}-open.png"), full_page=True)
        updates, sent = [], []
        for step_index, rank in cells:
            if D.focus(page)[0] == rank:
                rank = (rank + 1) % ranks
            received.clear()
            _, dt = D.click_heatmap(page, step_index, rank)
            updates.append(dt)
            page.wait_for_timeout(300)  # anything sent after the title changed counts too
            sent.append(sum(received) / 1e3)
        page.screenshot(path=str(shots / f"{store.stem}{tag}-clicked.png"), full_page=True)
    return {"first_render_s": first, "click_update_s": updates, "kb_per_click": sent}


def _row(name: str, r: dict) -> str:
    u = r["click_update_s"]
    clicks = f"{statistics.median(u):.2f} [{min(u):.2f}..{max(u):.2f}] over {len(u)} clicks"
    return (f"{name:<27} {r['first_render_s']:>16.2f} {clicks:>44} {statistics.median(r['kb_per_click']):>9.1f} "
            f"{os.getloadavg()[0]:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clicks", type=int, default=6)
    ap.add_argument("--baseline", metavar="REV", help="also measure the dashboard of this git revision")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="dash-bench-")))
    args = ap.parse_args()
    if (why := D.browser_missing()):
        raise SystemExit(f"cannot run: {why}")
    args.out.mkdir(parents=True, exist_ok=True)
    base = export(args.baseline, args.out / "baseline") if args.baseline else None
    stores = [synthetic_store(args.out / "synthetic-64x20.duckdb"), crowded_store(args.out / "crowded-16x10.duckdb")]
    stores.append(wia_store(args.out / "wia-AR.duckdb"))
    print(f"{'store':<27} {'first render (s)':>16} {'click -> timeline (s), median [min..max]':>44} "
          f"{'kB/click':>9} {'load':>6}")
    for store in stores:
        now = measure(store, args.clicks, args.out)
        print(_row(store.stem, now), flush=True)
        if base is not None:
            then = measure(store, args.clicks, args.out, root=base, tag="-baseline")
            print(_row(f"{store.stem} @{args.baseline}", then), flush=True)
            print(f"{'':<27} {'ratio baseline/now':>16}: first render {then['first_render_s'] / now['first_render_s']:.1f}x, "
                  f"click {statistics.median(then['click_update_s']) / statistics.median(now['click_update_s']):.1f}x, "
                  f"kB/click {statistics.median(then['kb_per_click']) / statistics.median(now['kb_per_click']):.1f}x",
                  flush=True)
    print(f"screenshots: {args.out}")


if __name__ == "__main__":
    main()
