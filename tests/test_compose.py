"""compose.yaml is validated by the real Compose binary (no Docker engine needed for ``config``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from parkway.actors.launch.processes import clean_environment
from parkway.actors.tools.cli import _parser
from parkway.protocol.signing import Keyring

from tests.support.compose import compose, env_lines, example_env, generated_env_text
from tests.support.paths import ROOT


@pytest.mark.slow  # runs the Compose binary
def test_compose_config_is_valid() -> None:
    result = compose("config", "-q", env=example_env())
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # runs the Compose binary and parkway keys
def test_compose_config_is_valid_from_a_generated_env_file_alone(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(generated_env_text())  # cp .env.example .env && parkway keys generate --env >> .env
    bare = clean_environment(strip=("PARKWAY_", "RABBITMQ_"))  # nothing from the shell
    result = compose("config", "--format", "json", env=bare, env_file=env_file)
    assert result.returncode == 0, result.stderr
    keys = env_lines(env_file.read_text())
    for name, svc in json.loads(result.stdout)["services"].items():
        if name in ("rabbitmq", "prometheus"):
            continue
        role = _parser().parse_args(svc["command"][1:]).role if name != "controller" else "controller"
        env = svc["environment"]
        # Its own role's private key and the public table; no shared secret; no other role's key.
        assert env["PARKWAY_SIGNING_KEY"] == keys[f"PARKWAY_KEY_{role.upper()}"], name
        assert env["PARKWAY_SIGNING_KEY"].startswith(f"{role}:"), name
        assert env["PARKWAY_PUBLIC_KEYS"] == keys["PARKWAY_PUBLIC_KEYS"]
        assert "PARKWAY_SECRET" not in env
        Keyring.from_text(env["PARKWAY_SIGNING_KEY"], env["PARKWAY_PUBLIC_KEYS"])  # they parse and match


@pytest.mark.slow  # runs the Compose binary
@pytest.mark.parametrize("missing", ["PARKWAY_KEY_AGENT", "PARKWAY_KEY_CONTROLLER", "PARKWAY_PUBLIC_KEYS"])
def test_compose_refuses_to_start_without_a_key(missing: str) -> None:
    env = example_env()
    del env[missing]
    result = compose("config", "-q", env=env)
    assert result.returncode != 0 and missing in result.stderr
    assert "parkway keys generate --env" in result.stderr


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    result = compose("config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


@pytest.mark.slow  # the `services` fixture runs the Compose binary
def test_every_actor_runs_as_its_own_service(services: dict[str, dict]) -> None:
    actors = {name: svc for name, svc in services.items() if name not in ("rabbitmq", "controller")}
    parsed = {name: _parser().parse_args(svc["command"][1:]) for name, svc in actors.items()}
    assert sorted((a.role, a.replica) for a in parsed.values()) == [
        ("agent", 0),
        ("agent", 1),
        ("policy", 0),
        ("resources", 0),
        ("resources", 1),
        ("tq", 0),
        ("trainer", 0),
    ]
    # The controller runs the example workload; every actor reads the same configuration file.
    controller = _parser().parse_args(services["controller"]["command"][1:])
    assert controller.func.__name__ == "_cmd_run" and services["controller"]["restart"] == "on-failure"
    assert {a.config for a in parsed.values()} == {controller.config} == {"/app/examples/cluster.yaml"}
    for name, svc in services.items():
        if name == "rabbitmq":
            continue
        assert svc["command"][0] == "parkway", name
        assert svc["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
        env = svc["environment"]
        assert "PARKWAY_SECRET" not in env and env["PARKWAY_SIGNING_KEY"]  # from the env file, not the code
        assert env["PARKWAY_BROKER_URL"] == "amqp://parkway:change-me@rabbitmq:5672/"
        assert [v["target"] for v in svc["volumes"]] == ["/var/lib/parkway"]  # one shared state volume


@pytest.mark.slow  # the `services` fixture runs the Compose binary
def test_the_services_off_a_snapshots_window_yield_the_cpu_to_those_on_it(services: dict[str, dict]) -> None:
    # The window waits on the controller, the agents and the broker only (SAVE_SEQUENCE); the others
    # get half the default CPU weight (1024) when the host's cores are contended.
    weights = {name: svc.get("cpu_shares") for name, svc in services.items()}
    on_window = {"controller", "agent-0", "agent-1", "rabbitmq"}
    assert {name: weights[name] for name in on_window} == dict.fromkeys(on_window)
    assert {name: w for name, w in weights.items() if name not in on_window} == {
        "tq": 512,
        "policy": 512,
        "resources-0": 512,
        "resources-1": 512,
        "trainer": 512,
    }


def test_the_image_carries_the_example_configuration() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY examples ./examples" in dockerfile and "WORKDIR /app" in dockerfile
    assert "examples" not in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.slow  # the `services` fixture runs the Compose binary
def test_rabbitmq_has_the_management_ui_and_a_health_check(services: dict[str, dict]) -> None:
    rabbit = services["rabbitmq"]
    assert "management" in rabbit["image"]
    assert {p["target"] for p in rabbit["ports"]} == {5672, 15672}
    assert rabbit["healthcheck"]["test"][0] == "CMD"


@pytest.mark.slow  # runs the Compose binary
def test_metrics_are_behind_the_metrics_profile(services: dict[str, dict]) -> None:
    assert "prometheus" not in services  # plain `docker compose up` runs no Prometheus
    result = compose("--profile", "metrics", "config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    with_metrics = json.loads(result.stdout)["services"]
    prometheus = with_metrics["prometheus"]
    assert prometheus["profiles"] == ["metrics"]
    [config] = [v for v in prometheus["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml"]
    assert Path(config["source"]) == ROOT / "deploy" / "prometheus.yml" and config["read_only"]
    # It scrapes every actor service, at the port that service serves its metrics on.
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = sorted(
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    )
    actors = {name: svc for name, svc in with_metrics.items() if name not in ("rabbitmq", "prometheus")}
    assert targets == sorted(
        f"{name}:{svc['environment']['PARKWAY_METRICS_PORT']}" for name, svc in actors.items()
    )
    assert {svc["environment"]["PARKWAY_METRICS_PORT"] for svc in actors.values()} == {"9464"}


@pytest.mark.slow  # runs the Compose binary
def test_traces_are_behind_the_observability_profile(services: dict[str, dict]) -> None:
    assert "jaeger" not in services
    assert {svc["environment"]["OTEL_TRACES_EXPORTER"] for n, svc in services.items() if n != "rabbitmq"} == {
        ""
    }
    result = compose("--profile", "observability", "config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    with_traces = json.loads(result.stdout)["services"]
    assert with_traces["jaeger"]["profiles"] == ["observability"]
    assert {p["target"] for p in with_traces["jaeger"]["ports"]} == {16686, 4318}
    actors = {name: svc for name, svc in with_traces.items() if name not in ("rabbitmq", "jaeger")}
    assert {svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] for svc in actors.values()} == {
        "http://jaeger:4318"
    }


@pytest.mark.slow  # runs the Compose binary
def test_the_cluster_profile_adds_two_nodes_and_the_actors_fail_over_along_them() -> None:
    urls = ",".join(f"amqp://u:p@{host}:5672/" for host in ("rabbitmq", "rabbitmq-2", "rabbitmq-3"))
    env = {**example_env(), "PARKWAY_BROKER_URLS": urls, "PARKWAY_QUEUE_TYPE": "quorum"}
    result = compose("--profile", "cluster", "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    nodes = {name: svc for name, svc in services.items() if name.startswith("rabbitmq")}
    assert sorted(nodes) == ["rabbitmq", "rabbitmq-2", "rabbitmq-3"]
    assert len({svc["environment"]["RABBITMQ_ERLANG_COOKIE"] for svc in nodes.values()}) == 1
    for name in ("rabbitmq-2", "rabbitmq-3"):
        assert nodes[name]["hostname"] == name and "rabbitmq" in nodes[name]["depends_on"]
        [conf] = [v for v in nodes[name]["volumes"] if v["target"].startswith("/etc/rabbitmq")]
        assert Path(conf["source"]).read_text().count("classic_config.nodes.") == 3
    for name, svc in services.items():
        if not name.startswith("rabbitmq") and name not in ("prometheus", "jaeger"):
            assert svc["environment"]["PARKWAY_BROKER_URL"] == urls, name
            assert svc["environment"]["PARKWAY_QUEUE_TYPE"] == "quorum", name
    # Without the profile, one node, the single URL, classic queues.
    plain = compose("config", "--format", "json", env=example_env())
    single = json.loads(plain.stdout)["services"]
    assert [name for name in single if name.startswith("rabbitmq")] == ["rabbitmq"]
    assert single["tq"]["environment"]["PARKWAY_BROKER_URL"].endswith("@rabbitmq:5672/")
    assert single["tq"]["environment"]["PARKWAY_QUEUE_TYPE"] == "classic"
