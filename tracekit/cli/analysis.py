"""`tracekit stragglers | cp-wait | steps | hangs | report | demo`: render the analyses (no analysis here).

Each takes a store file or a run directory. A run directory is ingested on the fly into the store
tracekit.ingest.cached.store_for names (``<dir>.tracekit.duckdb`` beside it, or ``--store``); files
already ingested are skipped, so a second call is fast. Human-readable by default, ``--json`` for
machines.

Exit codes: 0 ok; 1 a finding with ``--check`` (a straggler, slow steps, a hang, CP waiting with a
cause); 2 bad input (no such path, not a store, unreadable traces, unknown run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import click

from tracekit.cli._common import EXIT_FINDING, EXIT_OK, fail, store_of
from tracekit.report import Findings, gather, markdown
from tracekit.layout_infer import ASSUMED_LAYOUTS

# The run `tracekit demo --no-train` reports on (sample_traces/README.md).
BUNDLED_SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "slow_rank_8"


def open_source(path: Path, run_id: str | None, quiet: bool, store: Path | None = None):
    """(Store, run_id) for a store file or a run directory (``_common.store_of``)."""
    import tracekit
    from tracekit.store import StoreError

    path, run_id = store_of(path, run_id, quiet, store, warn=_warn)
    try:
        opened = tracekit.open(path)
        opened.check(run_id)  # fails early, with the file's name, on a bad store or run id
    except (StoreError, ValueError) as e:
        fail(f"{path}: {e}" if str(path) not in str(e) else str(e))
    return opened, run_id


def _warn(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)


def _common(fn: Callable) -> Callable:
    fn = click.option("--check", is_flag=True, help="Exit 1 when there is a finding.")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")(fn)
    fn = click.option("--run-id", default=None, help="Run to analyse (default: the newest in the store).")(fn)
    fn = click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
                      help="Store to ingest a run directory into (default: <dir>.tracekit.duckdb beside it).")(fn)
    return click.argument("source", type=click.Path(path_type=Path))(fn)


def _run(source: Path, store_path: Path | None, run_id: str | None, as_json: bool, check: bool,
         parts: tuple[str, ...], fmt: str = "terminal") -> None:
    store, rid = open_source(source, run_id, quiet=as_json, store=store_path)
    try:
        findings = gather(store, rid, parts)
    finally:
        store.close()
    if len(parts) == 1 and findings.skipped:  # the one thing asked for cannot be analysed
        fail(f"{source}: {findings.skipped[parts[0]]}")
    if as_json:
        click.echo(json.dumps(findings.to_dict(), indent=2, default=str))
    elif fmt == "markdown":
        click.echo(markdown(findings))
    else:
        render_terminal(findings)
    sys.exit(EXIT_FINDING if check and findings.any_finding else EXIT_OK)


@click.command("stragglers")
@_common
def stragglers_command(source: Path, store_path: Path | None, run_id: str | None, as_json: bool,
                       check: bool) -> None:
    """Which rank made the run slow, and why (top-down DP -> PP -> CP -> TP, then root cause)."""
    _run(source, store_path, run_id, as_json, check, ("stragglers",))


@click.command("cp-wait")
@_common
def cp_wait_command(source: Path, store_path: Path | None, run_id: str | None, as_json: bool,
                    check: bool) -> None:
    """Exposed CP communication: waiting vs transfer, and what the waiting is due to."""
    _run(source, store_path, run_id, as_json, check, ("cp_wait",))


@click.command("steps")
@_common
def steps_command(source: Path, store_path: Path | None, run_id: str | None, as_json: bool,
                  check: bool) -> None:
    """Step times per rank, the slow steps and what made each slow."""
    _run(source, store_path, run_id, as_json, check, ("steps",))


@click.command("hangs")
@_common
def hangs_command(source: Path, store_path: Path | None, run_id: str | None, as_json: bool,
                  check: bool) -> None:
    """Where the ranks stopped (flight-recorder entries) and which never joined."""
    _run(source, store_path, run_id, as_json, check, ("hangs",))


@click.command("report")
@_common
@click.option("--format", "fmt", type=click.Choice(["terminal", "markdown"]), default="terminal")
def report_command(source: Path, store_path: Path | None, run_id: str | None, as_json: bool, check: bool,
                   fmt: str) -> None:
    """Everything: stragglers, steps, CP wait and hangs."""
    _run(source, store_path, run_id, as_json, check, ("stragglers", "steps", "cp_wait", "hangs"), fmt)


@click.command("demo")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where the run and its store go (default: a temporary directory).")
@click.option("--no-train", is_flag=True, help="Use the bundled sample run instead of training.")
@click.option("--json", "as_json", is_flag=True)
def demo_command(out: Path | None, no_train: bool, as_json: bool) -> None:
    """Train the reference model with rank 3 computing 3x slower, ingest, report culprit and cause
    (``--no-train``: the bundled sample run sample_traces/slow_rank_8, rank 5 2x slower)."""
    from rich.console import Console

    from tracekit import demo_run

    out = out or Path(tempfile.mkdtemp(prefix="tracekit-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    err = Console(stderr=True)
    if no_train:
        if not (BUNDLED_SAMPLE / "manifest.json").exists():
            fail(f"{BUNDLED_SAMPLE}: no bundled sample run in this checkout; run without --no-train")
        run_dir = BUNDLED_SAMPLE
    else:
        run_dir = out / "demo-run"
        # torch's C++ warnings (the profiler's "memory block of unknown size" from every rank) are
        # noise on a newcomer's first screen; a user's own setting wins
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        with err.status(f"training 4 ranks (tp 2, dp 2), rank {demo_run.DEMO_FAULT.rank} "
                        f"{demo_run.DEMO_FAULT.factor}x slower ..."):
            demo_run.run_scenarios([demo_run.Scenario(demo_run.DEMO_CONFIG, str(run_dir), (demo_run.DEMO_FAULT,))])
    # The store goes to --out, never beside the bundled sample (the checkout may be read-only or shared).
    store, rid = open_source(run_dir, None, quiet=as_json, store=out / f"{run_dir.name}.tracekit.duckdb")
    try:
        findings = gather(store, rid, ("stragglers", "steps", "cp_wait", "hangs"))
    finally:
        store.close()
    truth = json.loads((run_dir / "manifest.json").read_text()).get("faults", [])
    if as_json:
        click.echo(json.dumps({**findings.to_dict(), "injected": truth}, indent=2, default=str))
    else:
        render_terminal(findings)
        for f in truth:
            err.print(f"injected: {f['kind']} on ranks {f['ranks']} ({f['magnitude']})")
    sys.exit(EXIT_OK)


def render_terminal(f: Findings) -> None:
    """The findings as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    out = Console()
    if f.layout_source in ASSUMED_LAYOUTS:
        out.print(f"[yellow]note:[/] {ASSUMED_LAYOUTS[f.layout_source]}", highlight=False)
    if f.layout_note:
        out.print(f"[yellow]warning:[/] {escape(f.layout_note)}", highlight=False)
    if f.damaged:  # every analysis names the ranks it could not judge
        out.print("[yellow]not judged (no data):[/] " + escape("; ".join(
            f"rank {r}: {why}" for r, why in sorted(f.damaged.items()))), highlight=False)
    for part, why in (f.skipped or {}).items():
        out.print(f"[yellow]{part}:[/] not analysed: {escape(why)}", highlight=False)
    if f.diagnosis is not None:
        loc, cause = f.diagnosis.localization, f.diagnosis.cause
        colour = "green" if loc.verdict in ("no_straggler", "no_data") else "red"
        out.print(f"[bold {colour}]stragglers:[/] {escape(f.diagnosis.headline)}", highlight=False)
        if f.diagnosis.scope is not None:
            out.print(f"[yellow]note:[/] {escape(f.diagnosis.scope.summary)}", highlight=False)
        for i, x in enumerate(f.diagnosis.findings, 1):
            steps = ",".join(map(str, x.steps)) if x.kind in ("transient", "moving") else "every step"
            out.print(f"  {i}. [bold]{x.kind}[/] ({x.cause}) at {escape(x.where)}: "
                      f"{x.cost_text()}, {steps}, confidence {x.confidence:.2f}", highlight=False)
            out.print(f"     next: {escape(x.next_step)}", highlight=False)
        t = Table(title="top-down localization (waits)")
        for c in ("level", "verdict", "chosen", "margin", "steps agree", "effect ms", "noise ms"):
            t.add_column(c, justify="left" if c in ("level", "verdict") else "right")
        for lv in loc.levels:
            t.add_row(lv.level, lv.verdict, str(lv.chosen), f"{lv.margin:.1f}", f"{lv.steps_agree}/{lv.steps_total}",
                      f"{lv.effect_ns / 1e6:.2f}", f"{lv.noise_ns / 1e6:.2f}")
        out.print(t)
        if cause.evidence:
            out.print("evidence: " + ", ".join(f"{k}={_fmt(v)}" for k, v in cause.evidence.items()), highlight=False)
    if f.steps is not None:
        out.print(f"[bold]steps:[/] {f.steps.headline}", highlight=False)
        if f.steps.slow:
            t = Table(title="slow steps")
            for c in ("step", "ms", "excess ms", "cause", "ranks", "why"):
                t.add_column(c)
            for s in f.steps.slow:
                t.add_row(str(s.step), f"{s.step_ns / 1e6:.1f}", f"{s.excess_ns / 1e6:.1f}", s.cause,
                          ",".join(map(str, s.ranks)), s.summary)
            out.print(t)
    if f.cp_wait is not None:
        out.print(f"[bold]cp-wait:[/] {f.cp_wait.headline}", highlight=False)
        if f.cp_wait.per_rank.height:
            t = Table(title="exposed CP time per rank (ms)")
            for c in ("rank", "exposed", "wait", "transfer", "explained", "of step"):
                t.add_column(c, justify="right")
            for r in f.cp_wait.per_rank.iter_rows(named=True):
                t.add_row(str(r["rank"]), *(f"{r[k] / 1e6:.1f}" for k in ("exposed_ns", "wait_ns", "transfer_ns",
                                                                         "explained_ns")), f"{r['exposed_frac']:.1%}")
            out.print(t)
    if f.hangs is not None:
        out.print(f"[bold]hangs:[/] {f.hangs.headline}", highlight=False)


def _fmt(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


__all__: list[Any] = [stragglers_command, cp_wait_command, steps_command, hangs_command, report_command,
                      demo_command]
