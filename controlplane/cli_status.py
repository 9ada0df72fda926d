"""``modelplane status``: every endpoint, its revisions and traffic split, replicas, load, p99
against its SLO and its target concurrency, in two tables (or ``--json``).

This module only gathers: the control-plane database (specs, revisions, splits, replicas
through the configured cluster backend, the autoscaler's newest vertical decision) and every
live router's ``/metrics``, scraped twice ``--sample-s`` apart. What the tables say is decided
in ``controlplane.status_view`` from that plain data.

Nothing here writes: no token is created, no migration is run, so ``status`` is safe on a
read-only database user and never changes what it looks at.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import typer
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from controlplane import db
from controlplane.settings import Settings
from controlplane.status_view import (ENDPOINT_HEADERS, REVISION_HEADERS, ROLE_ORDER, SINCE_START_NOTE, Decision,
                                      EndpointStatus, RevisionStatus, Share, Traffic, endpoint_rows,
                                      parse_router_metrics, revision_rows, target_of, traffic_by_endpoint, version_of)

console = Console()
FOLD_MIN_CHARS = 14  # a folding column narrower than this would shred its ids: one block per row instead
errors = Console(stderr=True, soft_wrap=True)

LIVE_STATES = ("pending", "ready", "serving", "draining")
SCRAPE_TIMEOUT_S = 3.0


class PlatformDown(Exception):
    """The platform cannot be read; the message is one line that says what to do."""


def open_engine(settings: Settings) -> Engine:
    """An engine on the control-plane database, without creating it: a SQLite file that does not
    exist means the platform never ran here (or MODELPLANE_HOME points elsewhere)."""
    url = settings.database_url
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:" and not Path(path).is_file():
            raise PlatformDown(f"no control-plane database at {path}: start the platform with `modelplane up` "
                               "(or set MODELPLANE_HOME or MODELPLANE_DATABASE_URL to the one that runs)")
    return db.make_engine(url)


def unreachable(settings: Settings, exc: DBAPIError) -> PlatformDown:
    """The one line for a database that refused or failed a read."""
    reason = str(exc.orig if exc.orig is not None else exc).strip()
    first = reason.splitlines()[0] if reason else type(exc).__name__
    where = make_url(settings.database_url).render_as_string(hide_password=True)
    if "no such table" in first or ("relation" in first and "does not exist" in first):
        return PlatformDown(f"the control-plane database at {where} has no modelplane schema: start the platform "
                            "with `modelplane up` (or run `modelplane db upgrade`)")
    return PlatformDown(f"cannot read the control-plane database at {where} ({first}): start it, or the platform "
                        "with `modelplane up`, and check MODELPLANE_DATABASE_URL")


def scrape_traffic(urls: dict[str, str], sample_s: float, fetch: Callable[[str], str],
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> tuple[dict[str, Traffic], list[str]]:
    """Each router's ``/metrics`` now and ``sample_s`` later → ``{endpoint: Traffic}``, and the
    routers that did not answer (either time), as ``"<id> at <url>: <why>"``."""
    def read(url: str):
        text = fetch(f"{url}/metrics")
        return clock(), parse_router_metrics(text)  # the time of the answer

    before, silent = {}, []
    for router_id, url in sorted(urls.items()):
        try:
            before[router_id] = read(url)
        except (httpx.HTTPError, ValueError) as exc:
            silent.append(f"{router_id} at {url}: {str(exc) or type(exc).__name__}")
    if before:
        sleep(sample_s)
    samples = []
    for router_id, (then_s, then) in before.items():
        try:
            now_s, now = read(urls[router_id])
        except (httpx.HTTPError, ValueError) as exc:
            silent.append(f"{router_id} at {urls[router_id]}: {str(exc) or type(exc).__name__}")
            continue
        samples.append((then, now, now_s - then_s))
    return traffic_by_endpoint(samples), silent


def http_fetch(client: httpx.Client) -> Callable[[str], str]:
    def fetch(url: str) -> str:
        response = client.get(url)
        response.raise_for_status()
        return response.text
    return fetch


def read_platform(engine: Engine, cluster, traffic: dict[str, Traffic] | None,
                  only: str | None = None) -> tuple[list[EndpointStatus], list[RevisionStatus]]:
    """The plain data of both views from the stores and the cluster backend (``traffic`` None: no router answered)."""
    from autoscale.vertical import held_target
    from controlplane.revisions import RevisionStore
    from controlplane.scaling import ScalingStore
    from controlplane.splits import SplitStore
    from controlplane.store import EndpointStore

    specs = [s for s in EndpointStore(engine).list() if only is None or s.name == only]
    revisions_store, splits_store, scaling = RevisionStore(engine), SplitStore(engine), ScalingStore(engine)
    live = {r.id: r for r in revisions_store.list(states=LIVE_STATES) if only is None or r.endpoint == only}
    ready: dict[str, int] = {}
    for replica in cluster.replicas():
        ready[replica.revision_id] = ready.get(replica.revision_id, 0) + (1 if replica.ready else 0)

    def desired(revision) -> int:
        try:  # the backend's count (Kubernetes: the Deployment's, which the revisions table does not follow)
            return cluster.desired_replicas(revision.id)
        except KeyError:
            return revision.desired_replicas

    endpoints, roles = [], {}
    for spec in specs:
        splits = splits_store.get(spec.name)
        serving = revisions_store.get(splits.serving) if splits is not None else None
        if splits is None or serving is None:
            endpoints.append(EndpointStatus(spec.name, spec.slo.p99_latency_ms))
            continue
        shares = {}
        for role, share in (("canary", splits.canary), ("shadow", splits.shadow)):
            if share is not None:
                other = live.get(share.revision_id) or revisions_store.get(share.revision_id)
                shares[role] = Share(share.revision_id, version_of(other.partition_key) if other else "?",
                                     share.percent)
                roles[share.revision_id] = (role, share.percent)
        canary_percent = splits.canary.percent if splits.canary is not None else 0.0
        roles[serving.id] = ("serving", 100.0 - canary_percent)
        live.setdefault(serving.id, serving)
        latest = scaling.latest(spec.name, "vertical", serving.id)
        decision = Decision(latest.target, latest.rule, latest.reason) if latest and latest.target is not None else None
        cost_model = serving.details.get("target_concurrency")
        cost_target = float(cost_model) if isinstance(cost_model, (int, float)) else None
        pinned = spec.scaling.target_concurrency
        target, source = target_of(pinned, cost_target, decision)
        held = held_target(pinned or cost_target or 1.0, pinned is not None, tuple(spec.cost_model.concurrency),
                           decision.target if decision else None)
        if held != target:  # a decision outside the sweep of the cost model now: the controller holds it inside
            target, source = held, f"{source} (held within the swept concurrency)"
        endpoints.append(EndpointStatus(
            spec.name, spec.slo.p99_latency_ms, serving.id, version_of(serving.partition_key), shares.get("canary"),
            shares.get("shadow"), ready.get(serving.id, 0), desired(serving),
            None if traffic is None else traffic.get(spec.name, Traffic(0.0, None)), target, source))
    revisions = [RevisionStatus(r.endpoint, r.id, version_of(r.partition_key), r.state,
                                *roles.get(r.id, (None, None)), ready.get(r.id, 0), desired(r))
                 for r in live.values()]
    return endpoints, sorted(revisions, key=lambda r: (r.endpoint, ROLE_ORDER.get(r.role, 3), r.revision_id))


def _cell(header: str, cell: str) -> Text:
    """A p99 over its SLO in red, under in green (the words say it without colour)."""
    return Text(cell, style=("red" if "(over)" in cell else "green") if header == "p99 ms" and cell != "-" else "")


def render(title: str, headers: tuple[str, ...], rows: list[tuple[str, ...]], caption: str | None = None,
           width: int | None = None) -> Table | Group:
    """A rich table of the rows; where even its narrowest form is wider than ``width`` (the terminal's),
    one block of ``header  value`` lines per row instead, so that nothing is cut off or folded to shreds."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for index, header in enumerate(headers):
        # ids and reasons fold onto more lines in a narrow terminal, down to FOLD_MIN_CHARS wide
        folds = header in ("serving", "split", "revision", "target source")
        longest = max((len(row[index]) for row in rows), default=0)
        table.add_column(header, overflow="fold", no_wrap=not folds,
                         min_width=min(FOLD_MIN_CHARS, max(longest, len(header))) if folds else None)
    for row in rows:
        table.add_row(*(_cell(header, cell) for header, cell in zip(headers, row)))
    if width is None or Measurement.get(console, console.options.update_width(10_000), table).minimum <= width:
        return table
    blocks: list = [Text(title, style="italic")]
    for row in rows:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="bold")
        grid.add_column(overflow="fold")
        for header, cell in zip(headers, row):
            grid.add_row(header, _cell(header, cell))
        blocks += [grid, Text("")]
    if caption:
        blocks.append(Text(caption))
    return Group(*blocks)


class UnknownEndpoint(Exception):
    pass


@dataclass(frozen=True)
class Gathered:
    endpoints: list[EndpointStatus]
    revisions: list[RevisionStatus]
    live_routers: int
    silent_routers: list[str]  # "<id> at <url>: <why>" of those that did not answer /metrics
    invalid_specs: list[tuple[str, str]]  # (name, why) of stored specs that no longer validate


def gather(settings: Settings, only: str | None, sample_s: float) -> Gathered:
    """Everything both views need; :class:`PlatformDown` (with what to do) when it cannot be read,
    :class:`UnknownEndpoint` for an ``only`` that names no endpoint."""
    from cluster.factory import from_settings
    from controlplane.routers import STALE_AFTER_S, RouterStore
    from controlplane.schema import EndpointRow
    from controlplane.store import EndpointStore

    engine = open_engine(settings)
    try:
        if only is not None:
            with Session(engine) as session:
                if session.get(EndpointRow, only) is None:
                    raise UnknownEndpoint(only)
        urls = RouterStore(engine).live_urls()
        if not urls:
            raise PlatformDown(f"modelplane is not running: no router has reported in the last {STALE_AFTER_S:.0f} s; "
                               "start it with `modelplane up`")
        try:
            cluster = from_settings(settings, engine)
        except ValueError as exc:  # e.g. Kubernetes without a kubeconfig: the message says which to set
            raise PlatformDown(str(exc)) from None
        with httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client:
            traffic, silent = scrape_traffic(urls, sample_s, http_fetch(client))
        endpoints, revisions = read_platform(engine, cluster, None if len(silent) == len(urls) else traffic, only)
        invalid = [(name, why) for name, why in EndpointStore(engine).invalid() if only in (None, name)]
    except DBAPIError as exc:
        raise unreachable(settings, exc) from None
    finally:
        engine.dispose()
    return Gathered(endpoints, revisions, len(urls), silent, invalid)


def status(
    endpoint: str = typer.Option(None, "--endpoint", help="Only this endpoint."),
    as_json: bool = typer.Option(False, "--json", help="Print the data of both tables as JSON."),
    sample_s: float = typer.Option(1.0, "--sample-s", min=0.1, max=60.0,
                                   help="Seconds between the two scrapes of each router's /metrics."),
) -> None:
    """Endpoints, revisions and traffic split, replicas ready/desired, requests/s, p99 against the
    SLO, and the target concurrency with where it came from (cost model or autoscaler)."""
    def fail(message: str, code: int) -> None:
        errors.print(f"[red]error:[/red] {message}", highlight=False)
        raise typer.Exit(code)

    try:
        found = gather(Settings.from_env(), endpoint, sample_s)
    except PlatformDown as exc:
        fail(str(exc), 1)
    except UnknownEndpoint:
        fail(f"no endpoint named {endpoint!r}; `modelplane endpoints list` shows what exists", 2)
    for name, why in found.invalid_specs:
        errors.print(f"[yellow]{name}: its stored spec no longer validates, so it is not shown: {why}; store a "
                     "corrected one with `modelplane endpoints create -f`[/yellow]", highlight=False)
    for line in found.silent_routers:
        errors.print(f"[yellow]router {line} did not answer /metrics; its requests are not counted[/yellow]",
                     highlight=False)
    if as_json:
        answered = found.live_routers - len(found.silent_routers)
        print(json.dumps({"sample_s": sample_s, "routers": {"live": found.live_routers, "answered": answered},
                          "endpoints": [asdict(e) for e in found.endpoints],
                          "revisions": [asdict(r) for r in found.revisions]}, indent=2))
        return
    since_start = any(e.traffic is not None and e.traffic.p99_since_start for e in found.endpoints)
    console = Console()  # sized now: Rich reads COLUMNS when a Console is made, not when it prints
    console.print(render("Endpoints", ENDPOINT_HEADERS, endpoint_rows(found.endpoints),
                         SINCE_START_NOTE if since_start else None, width=console.width))
    console.print(render("Revisions", REVISION_HEADERS, revision_rows(found.revisions), width=console.width))
    if not found.endpoints:
        console.print("no endpoints yet: `modelplane endpoints create -f SPEC.yaml` stores one")
