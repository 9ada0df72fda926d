"""The services `modelplane up` runs (controlplane.services): how Dagster's code location is served.

A running platform is checked in tests/test_platform.py (one code server after minutes of deploys).
"""

from pathlib import Path

import pytest

from controlplane.services import build_services, dagster_workspace
from controlplane.settings import Settings


def settings_at(home: Path) -> Settings:
    return Settings.from_env({"MODELPLANE_HOME": str(home)})


def test_the_webserver_and_the_daemon_start_after_the_code_server_and_load_the_workspace_that_names_it(tmp_path):
    settings = settings_at(tmp_path)
    services = build_services(settings)
    names = [s.name for s in services]
    code_server = services[names.index("dagster-code-server")]
    assert code_server.argv[1:3] == ["-m", "controlplane.code_server"]  # `dagster api grpc`, run workers forked
    assert code_server.argv[code_server.argv.index("--socket") + 1] == str(settings.dagster_code_socket)
    assert code_server.argv[code_server.argv.index("-m", 2) + 1] == "pipelines.definitions"
    for name in ("dagster-webserver", "dagster-daemon"):
        service = services[names.index(name)]
        assert names.index(name) > names.index("dagster-code-server") and service.after == "dagster-code-server"
        assert service.argv[service.argv.index("-w") + 1] == str(settings.dagster_workspace)
    assert [s.name for s in services if s.after] == ["dagster-webserver", "dagster-daemon"]


@pytest.mark.parametrize("home", ["home", "a: #b"])  # YAML would read an unquoted "a: #b" wrongly
def test_the_workspace_is_one_grpc_server_location_on_the_code_servers_socket(tmp_path, home):
    from dagster._core.remote_origin import GrpcServerCodeLocationOrigin
    from dagster._core.workspace.load import location_origins_from_yaml_paths

    settings = settings_at(tmp_path / home)
    settings.dagster_workspace.parent.mkdir(parents=True)
    settings.dagster_workspace.write_text(dagster_workspace(settings))
    [origin] = location_origins_from_yaml_paths([str(settings.dagster_workspace)])
    assert isinstance(origin, GrpcServerCodeLocationOrigin)
    assert (origin.socket, origin.port, origin.location_name) == (str(settings.dagster_code_socket), None, "modelplane")


def test_a_home_too_deep_for_a_socket_address_gets_a_socket_in_the_temporary_directory(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    sockets = {settings_at(deep).dagster_code_socket, settings_at(deep / "other").dagster_code_socket}
    assert len(sockets) == 2 and all(len(str(s)) < 108 and not str(s).startswith(str(deep)) for s in sockets)
    assert settings_at(tmp_path).dagster_code_socket == tmp_path / "dagster" / "code-server.sock"
