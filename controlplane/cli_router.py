"""CLI commands about routing: ``modelplane endpoints traffic`` (canary and shadow) and
``modelplane router replicas`` (what every live router sees: work in flight, ejections)."""

from __future__ import annotations

import os

import httpx
import typer
from rich.console import Console
from rich.table import Table

from controlplane import db
from controlplane.settings import Settings
from controlplane.splits import Share, SplitError, SplitStore

console = Console()
router_app = typer.Typer(help="What the routers see.", no_args_is_help=True)


def parse_share(option: str, value: str) -> Share:
    """``REVISION=PERCENT`` as a :class:`Share`.

    >>> parse_share("--canary", "gec-v2-1a=10")
    Share(revision_id='gec-v2-1a', percent=10.0)
    """
    revision, sep, percent = value.rpartition("=")
    try:
        if not sep or not revision:
            raise ValueError
        return Share(revision, float(percent))
    except ValueError:
        raise typer.BadParameter(f"{option} takes REVISION=PERCENT, e.g. gec-v2-1a2b=10; got {value!r}") from None


def endpoints_traffic(
    name: str,
    canary: str = typer.Option(None, "--canary", help="REVISION=PERCENT: that revision takes PERCENT of requests."),
    shadow: str = typer.Option(None, "--shadow", help="REVISION=PERCENT: that revision gets a copy of PERCENT of "
                               "requests; its answers are discarded."),
    clear: bool = typer.Option(False, "--clear", help="Remove the canary and the shadow."),
) -> None:
    """Show or set an endpoint's canary and shadow traffic (routers apply it within a second)."""
    store = SplitStore(db.make_engine(Settings.from_env().database_url))
    try:
        if clear:
            splits = store.set(name, canary=None, shadow=None)
        elif canary or shadow:
            changes = {key: parse_share(f"--{key}", value) for key, value in (("canary", canary), ("shadow", shadow))
                       if value}
            splits = store.set(name, **changes)
        else:
            splits = store.get(name)
    except SplitError as exc:
        console.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(1) from None
    if splits is None:
        console.print(f"[red]endpoint {name!r} serves no revision (or does not exist)[/red]", highlight=False)
        raise typer.Exit(1)
    lines = [f"{name}: serving {splits.serving}"]
    lines += [f"  {role}: {share.revision_id} at {share.percent:g}%" for role, share in
              (("canary", splits.canary), ("shadow", splits.shadow)) if share is not None]
    print("\n".join(lines))


@router_app.command("replicas")
def router_replicas(endpoint: str = typer.Option(None, "--endpoint", help="Only this endpoint.")) -> None:
    """Every live router's view of each endpoint's replicas: in flight, ejected as an outlier."""
    from controlplane.routers import RouterStore
    from controlplane.tokens import TokenStore

    engine = db.make_engine(Settings.from_env().database_url)
    urls = RouterStore(engine).live_urls()
    if not urls:
        console.print("[yellow]no live router (is `modelplane up` running?)[/yellow]")
        raise typer.Exit(1)
    tokens = TokenStore(engine)
    token_id, token = tokens.create([], admin=True, description=f"modelplane router replicas, pid {os.getpid()}")
    table = Table("router", "endpoint", "replica", "revision", "role", "in flight", "units", "ejected")
    try:
        for router_id, url in sorted(urls.items()):
            try:
                answer = httpx.get(f"{url}/internal/replicas", headers={"Authorization": f"Bearer {token}"},
                                   timeout=5.0).json()
            except (httpx.HTTPError, ValueError) as exc:
                console.print(f"[yellow]router {router_id} at {url} did not answer: {exc}[/yellow]")
                continue
            for name, view in sorted(answer.get("endpoints", {}).items()):
                if endpoint is not None and name != endpoint:
                    continue
                for replica in view["replicas"]:
                    ejected = (f"yes, {replica.get('ejected_remaining_s', 0):.0f} s more" if replica.get("ejected")
                               else "no")
                    table.add_row(router_id, name, replica["url"], replica["revision"], replica["role"],
                                  str(replica["in_flight_requests"]), f"{replica['in_flight_units']:g}", ejected)
    finally:
        tokens.revoke(token_id)
    Console().print(table)  # sized now: Rich reads COLUMNS when a Console is made, not when it prints
