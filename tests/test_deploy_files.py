"""The deployment files (infra/deploy/) agree with the code: commands, settings, ports, volumes.

Docker and a cluster are not available where the tests run, so the images and manifests
are not started here; what can drift silently (a renamed command or setting, a port, the
package list) is checked against the code instead, and the Kubernetes overlay is rendered
with ``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from genrec.app.cli import build_parser
from genrec.infra.settings import PROCESS_VARIABLES, Settings, setting_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "infra" / "deploy"
K8S = DEPLOY / "k8s"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def k8s_documents() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(K8S.glob("*.yaml"))}


def genrec_services() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if s.get("image") == "genrec:latest"}


def containers() -> dict[str, dict]:
    """Every genrec container of the Kubernetes manifests, by workload name."""
    found = {}
    for doc in k8s_documents().values():
        if doc["kind"] in ("Deployment", "Job"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                found[doc["metadata"]["name"]] = container
    return found


def dockerfile_env() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    block = re.search(r"^ENV (.+?)(?:\n\n|\nWORKDIR)", text, re.S | re.M).group(1)
    return dict(re.findall(r"(\w+)=(\S+)", block))


def test_every_command_is_a_genrec_command() -> None:
    parser = build_parser()
    commands = [s["command"] for s in genrec_services().values() if "command" in s]
    commands += [c["args"] for c in containers().values()]
    assert len(commands) >= 8
    for command in commands:
        args = parser.parse_args(command)  # SystemExit on an unknown command or option
        assert getattr(args, "handler", None) is not None, command


def test_every_genrec_variable_is_a_setting_and_valid(monkeypatch) -> None:
    variables = dict(compose()["x-genrec"]["environment"])
    variables["GENREC_DATABASE_URL"] = "postgresql+psycopg://genrec:pw@postgres:5432/genrec"
    docs = k8s_documents()
    variables |= docs["configmap.yaml"]["data"] | docs["secret.example.yaml"]["stringData"]
    variables |= {k: v for k, v in dockerfile_env().items() if k.startswith("GENREC_")}
    unknown = set(variables) - setting_names() - PROCESS_VARIABLES
    assert not unknown, f"not settings: {sorted(unknown)}"
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))
    settings = Settings()  # raises on a value of the wrong type or choice
    assert settings.ingest.metrics_port == 9101 and settings.online.metrics_port == 9102
    assert settings.kafka.security_protocol == "SASL_SSL"


def test_probes_and_scrape_ports_are_the_metrics_ports() -> None:
    environment = compose()["x-genrec"]["environment"]
    config = k8s_documents()["configmap.yaml"]["data"]
    ports = {"ingest": "9101", "serve": "9102"}
    assert environment["GENREC_INGEST__METRICS_PORT"] == config["GENREC_INGEST__METRICS_PORT"]
    assert environment["GENREC_ONLINE__METRICS_PORT"] == config["GENREC_ONLINE__METRICS_PORT"]
    assert config["GENREC_INGEST__METRICS_PORT"] == ports["ingest"]
    assert config["GENREC_ONLINE__METRICS_PORT"] == ports["serve"]
    services = genrec_services()
    docs = {d["metadata"]["name"]: d for d in k8s_documents().values() if "metadata" in d}
    for role, port in ports.items():
        assert f"127.0.0.1:{port}/healthz" in " ".join(services[role]["healthcheck"]["test"])
        workload = docs[f"genrec-{role}"]["spec"]["template"]
        assert workload["metadata"]["annotations"]["prometheus.io/port"] == port
        container = workload["spec"]["containers"][0]
        assert container["ports"][0]["containerPort"] == int(port)
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/healthz"
    exposed = re.search(r"^EXPOSE (.+)$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    assert set(exposed.split()) == set(ports.values())


def test_artifact_readers_and_writers_share_one_volume_at_genrec_home() -> None:
    """The database names artifacts by absolute path: every pod mounts them at one place."""
    home = dockerfile_env()["GENREC_HOME"]
    assert k8s_documents()["configmap.yaml"]["data"]["GENREC_HOME"] == home
    assert compose()["x-genrec"]["volumes"] == [f"genrec-data:{home}"]
    for name in ("genrec-serve", "genrec-scheduler"):
        mounts = containers()[name]["volumeMounts"]
        assert {"name": "data", "mountPath": home} in mounts
    claim = k8s_documents()["data-volume.yaml"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_image_installs_what_the_makefile_installs() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    no_deps = re.search(r"^NO_DEPS_PACKAGES := (.+)$", makefile, re.M).group(1).split()
    assert re.search(r'^ARG NO_DEPS_PACKAGES="(.+)"$', dockerfile, re.M).group(1).split() == no_deps
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = set(re.findall(r'"genrec\.\w+" = "(\w+)"', pyproject))
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.M))
    assert copied == package_dirs
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {f"!{d}/" for d in package_dirs} <= set(ignore)


def test_kustomization_lists_every_manifest_but_the_secret_example() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests - {"secret.example.yaml"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_the_overlay() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    kinds = [doc["kind"] for doc in yaml.safe_load_all(rendered)]
    assert sorted(kinds) == ["ConfigMap", "Deployment", "Deployment", "Deployment", "Job",
                             "PersistentVolumeClaim"]  # fmt: skip
