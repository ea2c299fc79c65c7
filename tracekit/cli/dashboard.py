"""`tracekit dashboard`: serve the Panel dashboard (apps/dashboard.py) over a store or a run dir."""

from __future__ import annotations

from pathlib import Path

import click

from tracekit.cli._common import fail, interrupted, store_of


@click.command("dashboard")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="Store to ingest a run directory into (default: <dir>.tracekit.duckdb beside it).")
@click.option("--port", type=int, default=5006, show_default=True,
              help="Port to serve on; if the default is in use, a free one (and it says which).")
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option("--show/--no-show", default=False, help="Open a browser tab.")
def dashboard_command(path: Path, store_path: Path | None, port: int, address: str, show: bool) -> None:
    """Serve the dashboard for a tracekit store, or for a run directory (ingested on the fly)."""
    from rich.console import Console
    from rich.markup import escape

    from tracekit.store import StoreError

    err = Console(stderr=True)

    def warn(message: str) -> None:
        err.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True, highlight=False)

    store, _ = store_of(path, None, False, store_path, warn=warn)
    ctx = click.get_current_context()
    port = _port(address, port, chosen=ctx.get_parameter_source("port") is not click.core.ParameterSource.DEFAULT,
                 warn=warn)
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
        except StoreError as e:
            fail(str(e))
        except ValueError as e:  # the page says which views cannot show this run
            err.print(f"[yellow]warning:[/yellow] run {escape(str(newest))}: {escape(str(e))}", soft_wrap=True)
    err.print(f"tracekit dashboard: http://{address}:{port}/dashboard  (store {store})")
    serve(store, port=port, address=address, show=show, data=data)
    interrupted()  # Panel's server returns only when Ctrl-C stopped it (it handles the signal itself)


def _port(address: str, port: int, chosen: bool, warn) -> int:  # type: ignore[no-untyped-def]
    """``port`` if it is free on ``address``; else, for the default port, a free one (said through
    ``warn``), and for a port the user chose, a one-line error."""
    import socket

    def free(p: int) -> int | None:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            try:
                s.bind((address, p))
            except OSError:
                return None
            return s.getsockname()[1]

    if free(port) is not None:
        return port
    if chosen:
        fail(f"port {port} on {address} is in use; choose another with --port")
    other = free(0)
    if other is None:
        fail(f"cannot listen on {address}: no free port")
    warn(f"port {port} is in use; serving on port {other}")
    return other
