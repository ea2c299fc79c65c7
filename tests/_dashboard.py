"""Drive the dashboard in Debian's headless Chromium (Playwright, never a downloaded browser).

Shared by tests/test_dashboard_browser.py and benchmarks/dashboard_latency.py: start
`tracekit dashboard` on a store, open it, wait for views, click a heatmap cell.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(store: Path, timeout_s: float = 180.0):
    """`tracekit dashboard <store>` in a subprocess; yields the page URL; stops it afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BOKEH_LOG_LEVEL": "warn"}
    log = open(store.parent / f"dashboard-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from tracekit.cli import main; main()", "dashboard", str(store),
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
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


def heatmap_canvas_box(page) -> dict:
    """Bounding box of the heatmap's largest canvas (the plot, not the colour bar or toolbar)."""
    canvases = page.locator(".tk-heatmap canvas").all()
    canvases[0].scroll_into_view_if_needed()  # boxes are relative to the viewport
    boxes = [c.bounding_box() for c in canvases]
    boxes = [b for b in boxes if b]
    return max(boxes, key=lambda b: b["width"] * b["height"])


def click_heatmap(page, fx: float, fy: float, timeout_ms: int = 60_000) -> tuple[int, int]:
    """Click at fractions (fx, fy) of the heatmap canvas; wait until the timeline's title changes
    (the latency measured) and the selection line agrees; return the timeline's new (rank, step)."""
    before = text(page, ".tk-timeline-title")
    box = heatmap_canvas_box(page)
    page.mouse.click(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
    deadline = time.monotonic() + timeout_ms / 1000
    while text(page, ".tk-timeline-title") == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the timeline did not change after a heatmap click ({before.strip()!r})")
        page.wait_for_timeout(20)
    shown = timeline_title(page)
    while focus(page) != shown:  # the selection line re-renders after the timeline (watcher order)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the selection line never showed the clicked cell {shown}")
        page.wait_for_timeout(20)
    return shown
