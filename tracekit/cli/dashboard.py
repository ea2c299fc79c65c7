"""`tracekit dashboard`: serve the Panel dashboard (apps/dashboard.py) over a store or a run dir."""

from __future__ import annotations

from pathlib import Path

import click

from tracekit.cli._common import fail, ingest_progress


@click.command("dashboard")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="Store to ingest a run directory into (default: <dir>.tracekit.duckdb beside it).")
@click.option("--port", type=int, default=5006, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option("--show/--no-show", default=False, help="Open a browser tab.")
def dashboard_command(path: Path, store_path: Path | None, port: int, address: str, show: bool) -> None:
    """Serve the dashboard for a tracekit store, or for a run directory (ingested on the fly)."""
    from rich.console import Console
    from rich.markup import escape

    from tracekit.store import StoreError

    err = Console(stderr=True)
    if path.is_dir():
        from tracekit.ingest import ingest
        from tracekit.ingest.cached import store_for
        from tracekit.ingest.common import IngestError

        store = store_for(path, store_path)
        with ingest_progress() as progress:
            try:
                report = ingest([path], store, progress=progress)
            except IngestError as e:
                fail(str(e))
        for f in report.failed:
            err.print(f"[yellow]warning:[/yellow] not ingested: {escape(f.error or '')}", soft_wrap=True)
    else:
        store = path
    try:
        from apps.dashboard import serve
        from apps.data import DashboardData
    except ImportError as e:
        fail(f"the dashboard needs its extra ({e.name} missing): pip install 'tracekit[dashboard]'")

    try:
        data = DashboardData(store)  # fail here, clearly, before the server starts
        newest = data.newest_run()
    except StoreError as e:
        fail(str(e))
    with err.status(f"analysing run {newest} ..."):  # what the first page shows, before anyone asks
        try:
            data.warm(newest)
        except ValueError as e:  # the page says which views cannot show this run
            err.print(f"[yellow]warning:[/yellow] run {escape(str(newest))}: {escape(str(e))}", soft_wrap=True)
    err.print(f"tracekit dashboard: http://{address}:{port}/dashboard  (store {store})")
    serve(store, port=port, address=address, show=show, data=data)
