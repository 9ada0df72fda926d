"""``modelplane demo``: the platform, the two demo models, and their deploy runs.

1. start the platform (``modelplane up``);
2. store the example endpoint specs ``examples/endpoints/{iris,gec}.yaml``;
3. register ``iris`` (scikit-learn) and ``gec`` (SmolLM2-135M-Instruct) in MLflow and point
   alias ``champion`` at them (skipped for a model whose alias already exists);
4. follow the deploy runs that Dagster starts by itself — nothing here launches them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from rich.console import Console

from controlplane import db
from controlplane.progress import waiting
from controlplane.settings import REPO_ROOT, Settings
from controlplane.specs import load_spec
from controlplane.store import EndpointStore
from pipelines.registry import MlflowRegistry, partition_key

ALIAS = "champion"
RUNS_QUERY = """
query Runs($tags: [ExecutionTag!]) {
  runsOrError(filter: {tags: $tags}) { ... on Runs { results { runId status } } }
}"""
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


@dataclass
class DemoModel:
    name: str
    spec_file: str
    register: Callable[[Settings], str]  # logs a new version, returns its number


def _register_iris(settings: Settings) -> str:
    from demo.iris import log_iris

    return str(log_iris(settings.mlflow_url, registered_model_name="iris").version)


def _register_gec(settings: Settings) -> str:
    from demo.smollm2 import build_smollm2_checkpoint, log_gec

    checkpoint = build_smollm2_checkpoint(settings.home / "demo" / "smollm2-135m-instruct")
    return str(log_gec(settings.mlflow_url, checkpoint, registered_model_name="gec").version)


DEMO_MODELS = [
    DemoModel("iris", "examples/endpoints/iris.yaml", _register_iris),
    DemoModel("gec", "examples/endpoints/gec.yaml", _register_gec),
]


def dagster_runs(dagster_url: str, partition: str) -> list[dict]:
    response = httpx.post(
        f"{dagster_url}/graphql",
        json={"query": RUNS_QUERY, "variables": {"tags": [{"key": "dagster/partition", "value": partition}]}},
        timeout=10.0,
    )
    response.raise_for_status()
    return response.json()["data"]["runsOrError"]["results"]


def register_demo_models(settings: Settings, console: Console) -> dict[str, str]:
    """Store the specs, register what is missing, set the alias; returns {model: version}."""
    store = EndpointStore(db.make_engine(settings.database_url))
    registry = MlflowRegistry(settings.mlflow_url)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url, registry_uri=settings.mlflow_url)
    versions = {}
    for model in DEMO_MODELS:
        store.put(load_spec(REPO_ROOT / model.spec_file))
        version = registry.alias_version(model.name, ALIAS)
        if version is not None:
            console.print(f"{model.name}: already registered, {ALIAS} → v{version}")
        else:
            started = time.monotonic()
            with waiting(console, f"{model.name}: building and registering in MLflow"):
                version = model.register(settings)
                client.set_registered_model_alias(model.name, ALIAS, version)
            console.print(f"{model.name}: registered v{version}, {ALIAS} → v{version} ({time.monotonic() - started:.0f} s)")
        versions[model.name] = version
    return versions


def follow_runs(settings: Settings, console: Console, partitions: list[str], started_at: float,
                timeout_s: float = 1800.0, describe: Callable[[str], None] = lambda _text: None) -> bool:
    """Print each deploy run as Dagster starts it and as it changes (``describe``: where they stand
    now, for a spinner's line); True when all succeeded."""
    last: dict[str, str] = {}
    announced = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for key in partitions:
            runs = dagster_runs(settings.dagster_url, key)
            if runs and last.get(key) != runs[0]["status"]:
                last[key] = runs[0]["status"]
                console.print(f"  {key}: run {runs[0]['runId'][:8]} {runs[0]['status'].lower()}"
                              f"  ({settings.dagster_url}/runs/{runs[0]['runId']})")
        if not announced and all(key in last for key in partitions):
            announced = True
            console.print(f"[bold green]deploy runs started for {' and '.join(partitions)}[/bold green] "
                          f"({time.monotonic() - started_at:.0f} s after `modelplane demo` began)")
        if announced and all(status in FINISHED for status in last.values()):
            return all(status == "SUCCESS" for status in last.values())
        if announced:
            describe("deploy runs: " + ", ".join(f"{key} {last[key].lower()}" for key in partitions))
        time.sleep(1.0)
    console.print(f"[red]gave up waiting for the deploy runs after {timeout_s:.0f} s[/red]")
    return False


GEC_INSTRUCTIONS = "You correct English grammar. Reply with the corrected sentence only."
GEC_QUESTION = "Correct the grammar: she go to school yesterday."
IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]


def print_serving(settings: Settings, console: Console, endpoints: list[str]) -> None:
    """What serves each endpoint: revision, checkpoint, the eval gate's verdict, hardware."""
    from controlplane.cli import status_lines
    from controlplane.revisions import RevisionStore

    revisions = RevisionStore(db.make_engine(settings.database_url))
    traffic = revisions.traffic()
    for name in endpoints:
        for line in status_lines(name, revisions.get(traffic[name]) if name in traffic else None):
            console.print(line, highlight=False)


def ask_both_endpoints(settings: Settings, console: Console) -> bool:
    """Create a token for the demo endpoints and ask each one a question through the router."""
    from openai import OpenAI

    from controlplane.tokens import TokenStore

    _, token = TokenStore(db.make_engine(settings.database_url)).create(
        ["gec", "iris"], description="modelplane demo")
    console.print(f"token for gec and iris (shown once): [bold]{token}[/bold]")
    client = OpenAI(base_url=f"{settings.router_url}/v1", api_key=token)
    chat = client.chat.completions.create(model="gec", messages=[
        {"role": "system", "content": GEC_INSTRUCTIONS}, {"role": "user", "content": GEC_QUESTION}],
        max_tokens=48, temperature=0)
    console.print(f"[bold]gec[/bold] (openai client, {settings.router_url}/v1/chat/completions)")
    console.print(f"  Q: {GEC_QUESTION}\n  A: {chat.choices[0].message.content.strip()}")
    columns = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
    response = httpx.post(f"{settings.router_url}/serving-endpoints/iris/invocations", timeout=30,
                          headers={"Authorization": f"Bearer {token}"},
                          json={"dataframe_split": {"columns": columns, "data": IRIS_ROWS}})
    console.print(f"[bold]iris[/bold] (HTTP, {settings.router_url}/serving-endpoints/iris/invocations)")
    console.print(f"  rows {IRIS_ROWS} → {response.status_code} {response.text.strip()}")
    return response.status_code == 200 and bool(chat.choices[0].message.content)


def run_demo(settings: Settings, console: Console, keep_running: bool = True) -> int:
    from controlplane.cli import STOP_REQUESTED, print_urls, serve_until_stopped
    from controlplane.platform import Platform, PlatformError

    started_at = time.monotonic()
    platform = Platform(settings, log=lambda m: console.print(f"[dim]{m}[/dim]"), stop_requested=STOP_REQUESTED.is_set)
    try:
        with waiting(console, "starting MLflow, Dagster, the admin API, the supervisor and the router"):
            platform.start()
    except PlatformError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        console.print(f"[bold green]modelplane is up[/bold green] ({time.monotonic() - started_at:.0f} s)")
        print_urls(platform)
        versions = register_demo_models(settings, console)
        partitions = [partition_key(model, version) for model, version in versions.items()]
        with waiting(console, "waiting for Dagster's registry sensor to launch the deploy runs") as describe:
            ok = follow_runs(settings, console, partitions, started_at, describe=describe)
        console.print(("[bold green]deploy runs succeeded[/bold green]" if ok else "[red]a deploy run failed[/red]")
                      + f"; see {settings.dagster_url}/runs")
        if ok:
            print_serving(settings, console, list(versions))
            ok = ask_both_endpoints(settings, console)
        if keep_running:
            console.print("the platform keeps running; Ctrl-C stops it")
            print_urls(platform)
            return serve_until_stopped(platform) or (0 if ok else 1)
        return 0 if ok else 1
    except KeyboardInterrupt:
        return 130
    finally:
        console.print("stopping…")
        platform.stop()
