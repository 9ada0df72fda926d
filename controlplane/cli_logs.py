"""``modelplane logs ENDPOINT``: the logs of the replicas serving an endpoint, each line prefixed
with its replica id, or with ``--run`` the event log of the newest Dagster run of its model.

Which replicas: those of every revision the endpoint routes to (serving, canary, shadow); when
none does (no deploy has succeeded yet, or the last one failed), those of its newest revision,
which is where the reason usually is. A run's log shows INFO and above unless ``--level``
says otherwise (Dagster's own step events are DEBUG). ``--follow`` keeps printing as lines arrive, picks up
replicas that start meanwhile, and stops on Ctrl-C (a run's log: also when the run finishes).
"""

from __future__ import annotations

import logging
import sys
import time
from enum import Enum

import typer
from rich.console import Console
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from controlplane.cli_status import PlatformDown, open_engine, unreachable
from controlplane.replica_logs import Tail, follow, last_lines, replica_logs
from controlplane.settings import Settings

errors = Console(stderr=True, soft_wrap=True)
POLL_S = 0.5


class RunLogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _fail(message: str, code: int = 1) -> None:
    errors.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def revisions_to_show(engine, endpoint: str) -> tuple[list[str], str | None]:
    """The revision ids whose replicas ``logs`` shows, and a note when they are not the routed ones."""
    from controlplane.schema import RevisionRow, TrafficRow

    with Session(engine) as session:
        row = session.get(TrafficRow, endpoint)
        routed = [] if row is None else [r for r in (row.revision_id, row.canary_revision_id, row.shadow_revision_id)
                                          if r]
        if routed:
            return routed, None
        newest = session.scalars(select(RevisionRow).where(RevisionRow.endpoint == endpoint)
                                 .order_by(RevisionRow.created_at.desc()).limit(1)).first()
    if newest is None:
        return [], None
    return [newest.id], f"no revision serves {endpoint}; showing its newest, {newest.id} ({newest.state})"


def logs(
    endpoint: str = typer.Argument(..., help="The endpoint whose logs to show."),
    follow_lines: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines to print first, from the end of each log."),
    run: bool = typer.Option(False, "--run", help="The newest Dagster run of the endpoint's model instead "
                             "(deploy, rollback, health check)."),
    level: RunLogLevel = typer.Option(RunLogLevel.info, "--level", help="--run: the least level shown; debug adds "
                                      "Dagster's own step events (launched, inputs loaded, finished)."),
) -> None:
    """The serving replicas' logs (each line prefixed with its replica id), or the newest deploy run's log."""
    from controlplane.schema import EndpointRow

    settings = Settings.from_env()
    try:
        engine = open_engine(settings)
        try:
            with Session(engine) as session:
                row = session.get(EndpointRow, endpoint)
                model = None if row is None else row.registered_model
            if model is None:
                _fail(f"no endpoint named {endpoint!r}; `modelplane endpoints list` shows what exists", code=2)
            if not run:
                revision_ids, note = revisions_to_show(engine, endpoint)
        except DBAPIError as exc:
            raise unreachable(settings, exc) from None
    except PlatformDown as exc:
        _fail(str(exc))
    try:
        if run:
            _run_log(settings, model, follow_lines, lines, logging.getLevelNamesMapping()[level.value.upper()])
        else:
            _replica_logs(settings, endpoint, revision_ids, note, follow_lines, lines)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends --follow; that is how it is meant to stop


def _replica_logs(settings: Settings, endpoint: str, revision_ids: list[str], note: str | None, follow_lines: bool,
                  lines: int) -> None:
    if settings.cluster == "kubernetes":
        _fail(f"replicas run on Kubernetes; their logs: kubectl logs -n {settings.k8s_namespace} "
              f"-l modelplane.io/endpoint={endpoint} --prefix --tail {lines}{' -f' if follow_lines else ''}")
    if not revision_ids:
        _fail(f"{endpoint} has no revision yet, so no replica has run; its deploy run's log: "
              f"`modelplane logs {endpoint} --run`")
    if note:
        errors.print(f"[yellow]{note}[/yellow]", highlight=False)
    replicas_dir = settings.logs_dir / "replicas"
    files = replica_logs(replicas_dir, revision_ids)
    if not files and not follow_lines:
        _fail(f"no replica log of {', '.join(revision_ids)} in {replicas_dir}; replicas write there once the "
              f"supervisor starts them (`modelplane up`); why a deploy stopped: `modelplane logs {endpoint} --run`")
    tail = Tail()
    for replica_id, path in files:
        for line in last_lines(path, lines):
            _emit(f"{replica_id} | {line}")
        tail.add(replica_id, path)
    if follow_lines:
        for replica_id, line in follow(tail, lambda: replica_logs(replicas_dir, revision_ids), lambda: False,
                                       time.sleep, POLL_S):
            _emit(f"{replica_id} | {line}")


def _run_log(settings: Settings, model: str, follow_lines: bool, lines: int, min_level: int) -> None:
    from controlplane.run_logs import FINISHED, DagsterRunLogs, NoRuns

    try:
        source = DagsterRunLogs(settings.dagster_home)
    except NoRuns as exc:
        _fail(str(exc))
    try:
        try:
            run = source.latest_run(model)
        except NoRuns as exc:
            _fail(str(exc))
        errors.print(f"run {run.run_id} of {run.partition} ({run.job_name}, {run.status.lower()}): "
                     f"{settings.dagster_url}/runs/{run.run_id}", highlight=False)
        printed, newest = source.last_lines(run.run_id, lines, min_level)
        for line in printed:
            _emit(line)
        status = run.status
        while follow_lines and status not in FINISHED:
            time.sleep(POLL_S)
            status = source.status(run.run_id)  # before the read, so the last lines of a finished run are shown
            printed, newest = source.after(run.run_id, newest, min_level)
            for line in printed:
                _emit(line)
        if follow_lines:
            errors.print(f"run {run.run_id} finished: {status.lower()}", highlight=False)
    finally:
        source.close()
