"""The ``modelplane`` command line: ``up``, ``demo``, ``endpoints …``, ``requests``, ``simulate`` and ``db …``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from controlplane import db
from controlplane.settings import OFFLINE_ENV, Settings
from controlplane.progress import waiting
from controlplane.specs import SpecError, json_schema, load_spec

for _name, _value in OFFLINE_ENV.items():  # before anything imports mlflow
    os.environ.setdefault(_name, _value)

from controlplane.cli_router import endpoints_traffic, router_app  # noqa: E402 - after the imports above
from controlplane.cli_simulate import simulate  # noqa: E402
from controlplane.cli_logs import logs  # noqa: E402
from controlplane.cli_status import status  # noqa: E402

app = typer.Typer(help="modelplane: self-hosted model serving built from Dagster assets.", no_args_is_help=True)
endpoints_app = typer.Typer(help="Endpoint specs: which registered model alias to serve, and how.", no_args_is_help=True)
db_app = typer.Typer(help="The control-plane database schema.", no_args_is_help=True)
tokens_app = typer.Typer(help="Bearer tokens for the router and the admin API.", no_args_is_help=True)
app.add_typer(endpoints_app, name="endpoints")
app.add_typer(tokens_app, name="tokens")
app.add_typer(db_app, name="db")
app.add_typer(router_app, name="router")
endpoints_app.command("traffic")(endpoints_traffic)
app.command("simulate")(simulate)
app.command("status")(status)
app.command("logs")(logs)
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

PortOption = typer.Option(None, min=1, max=65535)


def _settings(mlflow_port: int | None = None, dagster_port: int | None = None, admin_port: int | None = None,
              router_port: int | None = None) -> Settings:
    try:
        settings = Settings.from_env()
    except ValueError as exc:  # pydantic's ValidationError is one
        _fail(f"bad environment setting:\n{exc}", code=2)
    overrides = {k: v for k, v in {"mlflow_port": mlflow_port, "dagster_port": dagster_port,
                                   "admin_port": admin_port, "router_port": router_port}.items() if v is not None}
    if overrides:
        settings = settings.model_copy(update={"ports": settings.ports.model_copy(update=overrides)})
    return settings


def _fail(message: str, code: int = 1) -> None:
    errors.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _stores(settings: Settings):
    from controlplane.store import EndpointStore

    db.upgrade(settings.database_url)
    return EndpointStore(db.make_engine(settings.database_url))


# Set by SIGTERM/SIGHUP and by Ctrl-C. The exception the handler raises can be lost (a signal
# that lands while the main thread runs a finalizer is "ignored"); the loops of `up` check this
# flag as well, so a stop request is never lost.
STOP_REQUESTED = threading.Event()


def stop_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt, like Ctrl-C, and remember the request.

    Installed before anything starts, so a signal that arrives while services are still
    starting unwinds through ``Platform.stop`` too instead of orphaning them.
    """
    def _interrupt(signum, _frame) -> None:
        STOP_REQUESTED.set()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def serve_until_stopped(platform) -> int:
    """Block until Ctrl-C, SIGTERM or SIGHUP (return 0). A service that dies is restarted
    (the others keep serving); one that keeps dying ends `up` (return 1)."""
    from controlplane.platform import PlatformError

    try:
        while not STOP_REQUESTED.is_set():
            try:
                for line in platform.revive(time.monotonic()):
                    errors.print(f"[yellow]{line}[/yellow]; see {platform.settings.logs_dir}", highlight=False)
            except PlatformError as exc:
                errors.print(f"[red]{exc}[/red]", highlight=False)
                return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0


def print_urls(platform) -> None:
    for name, url in platform.urls().items():
        console.print(f"  {name:<11} {url}")
    console.print(f"  {'State':<11} {platform.settings.home}")


@app.command()
def up(
    mlflow_port: int = typer.Option(None, min=1, max=65535, help="MLflow port (default 5000, env MODELPLANE_MLFLOW_PORT)."),
    dagster_port: int = typer.Option(None, min=1, max=65535, help="Dagster UI port (default 3000, env MODELPLANE_DAGSTER_PORT)."),
    admin_port: int = typer.Option(None, min=1, max=65535, help="Admin API port (default 8100, env MODELPLANE_ADMIN_PORT)."),
    router_port: int = typer.Option(None, min=1, max=65535, help="Router port (default 8080, env MODELPLANE_ROUTER_PORT)."),
    routers: int = typer.Option(None, min=1, max=64, help="Router processes sharing the router port, active-active "
                                "(default 1, env MODELPLANE_ROUTERS)."),
    prometheus: bool = typer.Option(False, "--prometheus", help="Also run Prometheus on 127.0.0.1 (port 9090, env "
                                    "MODELPLANE_PROMETHEUS_PORT) scraping the routers, replicas and control plane, "
                                    "with recording rules (docs/metrics.md)."),
) -> None:
    """Start MLflow, Dagster (webserver + daemon), the admin API, the replica supervisor and the
    router; Ctrl-C stops them all."""
    from controlplane.platform import Platform, PlatformError

    stop_on_signals()
    settings = _settings(mlflow_port, dagster_port, admin_port, router_port)
    if routers is not None:
        settings = settings.model_copy(update={"routers": routers})
    if prometheus:
        settings = settings.model_copy(update={"prometheus": True})
    platform = Platform(settings,
                        log=lambda m: console.print(f"[dim]{m}[/dim]"), stop_requested=STOP_REQUESTED.is_set)
    try:
        with waiting(console, "starting MLflow, Dagster, the admin API, the supervisor, the routers and the autoscaler"):
            platform.start()
    except PlatformError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    try:
        console.print("[bold green]modelplane is up[/bold green] (Ctrl-C to stop)")
        print_urls(platform)
        code = serve_until_stopped(platform)
    finally:
        console.print("stopping…")
        platform.stop()
    raise typer.Exit(code)


@app.command()
def demo(
    exit_when_started: bool = typer.Option(False, "--exit", help="Stop the platform once both endpoints answered."),
    mlflow_port: int = typer.Option(None, min=1, max=65535),
    dagster_port: int = typer.Option(None, min=1, max=65535),
    admin_port: int = typer.Option(None, min=1, max=65535),
    router_port: int = typer.Option(None, min=1, max=65535),
) -> None:
    """`up`, register the demo models (gec, iris) with alias champion, follow their deploy runs,
    then ask both endpoints a question through the router."""
    from controlplane.demo_flow import run_demo

    stop_on_signals()
    settings = _settings(mlflow_port, dagster_port, admin_port, router_port)
    raise typer.Exit(run_demo(settings, console, keep_running=not exit_when_started))


@endpoints_app.command("create")
def endpoints_create(file: Path = typer.Option(..., "-f", "--file", help="YAML endpoint spec.")) -> None:
    """Validate a spec and store it (replacing the spec of the same name)."""
    try:
        spec = load_spec(file)
    except SpecError as exc:
        _fail(f"{file} is not a valid endpoint spec:\n{exc}", code=2)
    created = _stores(Settings.from_env()).put(spec)
    console.print(f"endpoint [bold]{spec.name}[/bold] {'created' if created else 'updated'}: serves {spec.model}")


@endpoints_app.command("list")
def endpoints_list() -> None:
    """List stored endpoint specs (and any that no longer validate)."""
    store = _stores(Settings.from_env())
    specs = store.list()
    table = Table("name", "model", "runtime", "replicas", "p99 SLO (ms)")
    for spec in specs:
        table.add_row(spec.name, spec.model, spec.runtime.value,
                      f"{spec.scaling.min_replicas}–{spec.scaling.max_replicas}", f"{spec.slo.p99_latency_ms:g}")
    console.print(table)
    for name, why in store.invalid():
        errors.print(f"[yellow]{name}: stored spec no longer validates and is skipped:[/yellow] {why}", highlight=False)


@endpoints_app.command("show")
def endpoints_show(name: str) -> None:
    """Print one spec as JSON."""
    try:
        spec = _stores(Settings.from_env()).get(name)
    except SpecError as exc:
        _fail(str(exc))
    if spec is None:
        _fail(f"no endpoint named {name!r}; `modelplane endpoints list` shows what exists")
    print(spec.model_dump_json(indent=2))


def status_lines(name: str, revision) -> list[str]:
    """What ``endpoints status`` prints for an endpoint and the revision taking its traffic (None: none).

    >>> from types import SimpleNamespace as R
    >>> status_lines("gec", R(id="gec-gec-v1-1", partition_key="gec.v1", state="serving", desired_replicas=1,
    ...     details={"checkpoint": "int8-w8a8-channel", "eval_gate": "passed", "hardware_profile": "cpu/X/2cpu",
    ...              "cpu_amx": "absent"}))[:2]
    ['gec: serving revision gec-gec-v1-1 (gec.v1), state serving, 1 replica(s)', '  checkpoint: int8-w8a8-channel']
    """
    if revision is None:
        return [f"{name}: no revision takes its traffic (no version deployed yet, or every deploy failed; "
                "see the deploy runs in the Dagster UI)"]
    details = revision.details
    lines = [f"{name}: serving revision {revision.id} ({revision.partition_key}), state {revision.state}, "
             f"{revision.desired_replicas} replica(s)"]
    if "checkpoint" in details:
        lines.append(f"  checkpoint: {details['checkpoint']}")
    if "eval_gate" in details:
        lines.append(f"  eval gate: {details['eval_gate']}")
        lines += [f"    - {reason}" for reason in details.get("eval_gate_reasons", [])]
    if "hardware_profile" in details:
        lines.append(f"  hardware: {details['hardware_profile']} (AMX: {details.get('cpu_amx', 'unknown')})")
    return lines


def scaling_lines(horizontal, vertical) -> list[str]:
    """The newest autoscaler decision of each axis (``controlplane.scaling.ScalingDecision`` or None).

    >>> from types import SimpleNamespace as D
    >>> from datetime import datetime, timezone
    >>> at = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc)
    >>> scaling_lines(D(at=at, replicas=3, rule="scale-up", reason="11 in flight / 4 = 3"), None)
    ['  autoscaler: 3 replica(s) at 2027-01-15 08:00:00 UTC (scale-up: 11 in flight / 4 = 3)', '  target: from the cost model, not retuned yet']
    """
    lines = []
    if horizontal is None:
        lines.append("  autoscaler: no decision yet (it scales once it has seen traffic or a full lookback)")
    else:
        lines.append(f"  autoscaler: {horizontal.replicas} replica(s) at {horizontal.at:%Y-%m-%d %H:%M:%S} UTC "
                     f"({horizontal.rule}: {horizontal.reason})")
    if vertical is None:
        lines.append("  target: from the cost model, not retuned yet")
    else:
        lines.append(f"  target: {vertical.target:g} in flight per replica at {vertical.at:%Y-%m-%d %H:%M:%S} UTC "
                     f"({vertical.rule}: {vertical.reason})")
    return lines


@endpoints_app.command("status")
def endpoints_status(name: str) -> None:
    """Which revision serves an endpoint, from which checkpoint, what the eval gate and the autoscaler decided."""
    from controlplane.revisions import RevisionStore
    from controlplane.scaling import ScalingStore

    settings = Settings.from_env()
    if _stores(settings).get(name) is None:
        _fail(f"no endpoint named {name!r}; `modelplane endpoints list` shows what exists")
    engine = db.make_engine(settings.database_url)
    revisions, scaling = RevisionStore(engine), ScalingStore(engine)
    revision_id = revisions.traffic().get(name)
    lines = status_lines(name, revisions.get(revision_id) if revision_id else None)
    if revision_id:
        lines += scaling_lines(scaling.latest(name, "horizontal", revision_id), scaling.latest(name, "vertical", revision_id))
    print("\n".join(lines))


@endpoints_app.command("delete")
def endpoints_delete(name: str) -> None:
    """Delete a spec."""
    if not _stores(Settings.from_env()).delete(name):
        _fail(f"no endpoint named {name!r}")
    console.print(f"endpoint [bold]{name}[/bold] deleted")


@endpoints_app.command("schema")
def endpoints_schema() -> None:
    """Print the JSON schema of endpoint specs (docs/endpoint-spec.schema.json)."""
    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


@app.command()
def requests(
    endpoint: str,
    since: str = typer.Option("10m", "--since", help="How far back: 30s, 10m, 2h, 1d (a bare number: seconds)."),
    limit: int = typer.Option(50, "--limit", min=1, help="Most records to print (not applied to --export)."),
    kind: str = typer.Option(None, "--kind", help="Only serve, canary (a split's canary revision) or shadow "
                             "(copies to a shadow revision)."),
    export: Path = typer.Option(None, "--export", help="Write every matching record to this Parquet file instead."),
) -> None:
    """The router's sampled requests to an endpoint, newest first, or all of them exported to Parquet."""
    from controlplane.inference_log import KINDS, InferenceLogStore, parse_since
    from controlplane.store import utc_now

    try:
        window = parse_since(since)
    except ValueError as exc:
        _fail(str(exc), code=2)
    if kind is not None and kind not in KINDS:
        _fail(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}", code=2)
    settings = _settings()
    specs = _stores(settings)
    store, start = InferenceLogStore(db.make_engine(settings.database_url)), utc_now() - window
    if export is not None:
        count = store.export_parquet(endpoint, start, export, kind=kind)
        console.print(f"wrote {count} record(s) of {endpoint} since {start:%Y-%m-%d %H:%M:%S} UTC to {export}")
        return
    records = store.recent(endpoint, start, limit=limit, kind=kind)
    if not records:
        try:
            known = specs.get(endpoint) is not None
        except SpecError:  # stored, though its spec no longer validates
            known = True
        if not known:
            _fail(f"no endpoint named {endpoint!r} and no logged requests to it; "
                  "`modelplane endpoints list` shows what exists")
        console.print(f"no logged requests to {endpoint} in the last {since} (the router logs a sample of requests)")
        return
    table = Table()
    for header in ("time (UTC)", "revision", "kind", "status", "ms", "req B", "resp B", "token"):
        # Ids fold onto more lines in a narrow terminal; nothing is ever cut off.
        table.add_column(header, no_wrap=header not in ("revision", "token"), overflow="fold")
    for r in records:
        table.add_row(f"{r.at:%Y-%m-%d %H:%M:%S}", r.revision_id or "-", r.kind, str(r.status),
                      f"{r.latency_ms:.1f}", str(r.request_bytes), str(r.response_bytes), r.token_id or "-")
    Console(soft_wrap=True).print(table)  # sized now: Rich reads COLUMNS when a Console is made, not when it prints


def _tokens():
    from controlplane.tokens import TokenStore

    settings = Settings.from_env()
    db.upgrade(settings.database_url)
    return TokenStore(db.make_engine(settings.database_url))


@tokens_app.command("create")
def tokens_create(
    endpoint: list[str] = typer.Option([], "--endpoint", "-e", help="Endpoint the token may call (repeatable)."),
    admin: bool = typer.Option(False, "--admin", help="May call every endpoint and the admin API."),
    description: str = typer.Option(None, "--description", help="Who or what the token is for."),
) -> None:
    """Create a token and print it once; only its SHA-256 is stored."""
    if not endpoint and not admin:
        _fail("give at least one --endpoint NAME, or --admin", code=2)
    token_id, token = _tokens().create(endpoint, admin=admin, description=description)
    errors.print(f"token {token_id} for {'every endpoint (admin)' if admin else ', '.join(endpoint)}; "
                 "it is shown only now:")
    print(token)


@tokens_app.command("list")
def tokens_list() -> None:
    """List tokens (never the tokens themselves)."""
    table = Table("id", "endpoints", "admin", "revoked", "created", "description")
    for row in _tokens().list():
        table.add_row(row["id"], ", ".join(row["endpoints"]) or "-", "yes" if row["admin"] else "",
                      "yes" if row["revoked"] else "", f"{row['created_at']:%Y-%m-%d %H:%M}", row["description"] or "")
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str) -> None:
    """Revoke a token by id; the router refuses it within a second."""
    if not _tokens().revoke(token_id):
        _fail(f"no live token with id {token_id!r}")
    console.print(f"token {token_id} revoked")


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION."""
    settings = Settings.from_env()
    db.upgrade(settings.database_url, revision)
    console.print(f"control-plane schema at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str) -> None:
    """Revert migrations down to REVISION ('base' drops every table)."""
    settings = Settings.from_env()
    db.downgrade(settings.database_url, revision)
    console.print(f"control-plane schema at {revision}")


if __name__ == "__main__":
    app()
