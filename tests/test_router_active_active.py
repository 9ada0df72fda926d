"""Several routers on one port (``modelplane up --routers N``): SO_REUSEPORT for clients, a
port of its own per router for the control plane."""

import socket
import threading
from collections import Counter

import httpx
import uvicorn

from controlplane.services import router_services
from controlplane.settings import Settings
from controlplane.tokens import Grant, token_sha256
from serving.router.app import create_app
from serving.router.server import listening_sockets
from serving.router.config import RouterConfig
from serving.router.table import EndpointRoute, RoutingTable
from tests.conftest import wait_for
from tests.fake_replicas import FakeReplica

TOKEN = "mp_a_gec"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_up_with_three_routers_starts_three_router_processes(tmp_path):
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/db", routers=3)
    services = router_services(settings)
    assert [s.name for s in services] == ["router", "router-2", "router-3"]
    assert [s.port for s in services] == [settings.ports.router_port, None, None]  # one port, checked once
    assert all(s.argv[-1] == "serving.router.server" for s in services)


def test_two_routers_share_one_port_and_each_keeps_its_own(tmp_path):
    replica = FakeReplica("gec-0").start()
    port = free_port()
    table = RoutingTable({"gec": EndpointRoute("gec", "vllm", "gec-r1", (replica.url,))},
                         {token_sha256(TOKEN): Grant("a", frozenset({"gec"}), True)})
    servers, own_ports = [], []
    for number in range(2):
        shared, own = listening_sockets("127.0.0.1", port)
        own_ports.append(own.getsockname()[1])
        server = uvicorn.Server(uvicorn.Config(create_app(RouterConfig(port=port), lambda: table,
                                                          router_id=f"router-{number}"), log_level="warning"))
        threading.Thread(target=server.run, kwargs={"sockets": [shared, own]}, daemon=True).start()
        servers.append(server)
    try:
        wait_for(lambda: all(s.started for s in servers), 20, "both routers")
        answered_by = Counter()
        headers = {"Authorization": f"Bearer {TOKEN}"}
        body = {"model": "gec", "messages": [{"role": "user", "content": "she go"}]}
        for _ in range(60):  # a new connection each time: the kernel picks a router per connection
            assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers).status_code \
                == 200
        for number, own_port in enumerate(own_ports):
            answered = httpx.get(f"http://127.0.0.1:{own_port}/metrics").text
            answered_by[number] = sum(float(line.split()[-1]) for line in answered.splitlines()
                                      if line.startswith('modelplane_router_requests_total{code="200"'))
            router = httpx.get(f"http://127.0.0.1:{own_port}/internal/replicas", headers=headers).json()["router"]
            assert router == f"router-{number}"  # each own port reaches that router, and only it
        assert sum(answered_by.values()) == 60
        assert min(answered_by.values()) > 0  # both took connections
    finally:
        for server in servers:
            server.should_exit = True
        replica.stop()


def test_router_replicas_shows_each_live_routers_view_with_ejections(sqlite_url, monkeypatch):
    from dataclasses import replace
    from datetime import datetime, timezone

    from typer.testing import CliRunner

    from controlplane import db
    from controlplane.cli import app as cli
    from controlplane.routers import RouterStore
    from controlplane.tokens import TokenStore
    from serving.router.outliers import EjectionConfig
    from serving.router.policy import RoutePolicy

    monkeypatch.setenv("MODELPLANE_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("COLUMNS", "250")
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    good, bad = FakeReplica("gec-0").start(), FakeReplica("gec-1", behaviour="error").start()
    policy = RoutePolicy(ejection=EjectionConfig(consecutive_failures=1, max_ejected_percent=50.0))
    static = RoutingTable({"gec": EndpointRoute("gec", "vllm", "gec-r1", (good.url, bad.url), policy=policy)},
                          {token_sha256(TOKEN): Grant("a", frozenset({"gec"}), False)})
    shared, own = listening_sockets("127.0.0.1", free_port())
    own_url = f"http://127.0.0.1:{own.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(
        RouterConfig(), lambda: replace(static, grants={**static.grants, **TokenStore(engine).grants()}),
        router_id="router-a"), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [shared, own]}, daemon=True).start()
    try:
        wait_for(lambda: server.started, 20, "the router")
        RouterStore(engine).report("router-a", datetime.now(timezone.utc), own_url)
        body = {"model": "gec", "messages": [{"role": "user", "content": "she go"}]}
        for _ in range(10):
            httpx.post(f"{own_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        shown = CliRunner().invoke(cli, ["router", "replicas"])
    finally:
        server.should_exit = True
        good.stop()
        bad.stop()
    assert shown.exit_code == 0, shown.output
    rows = {line.split("│")[3].strip(): line for line in shown.output.splitlines() if "gec-r1" in line}
    assert "yes, " in rows[bad.url] and "no" in rows[good.url].split("│")[-2]
    assert [t["revoked"] for t in TokenStore(engine).list()] == [True]  # the command's own token, revoked
