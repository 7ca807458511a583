"""The deployment files (infra/deploy/) agree with the code: commands, settings, ports, volumes.

Docker and a cluster are not available where the tests run, so the images and manifests
are not started here; what can drift silently (a renamed command or setting, a port, the
package list) is checked against the code instead, and the Kubernetes overlay is rendered
with ``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

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
    """The first object of each manifest, by file name."""
    return {p.name: next(yaml.safe_load_all(p.read_text())) for p in sorted(K8S.glob("*.yaml"))}


def genrec_services() -> dict[str, dict]:
    """The Compose services that run a genrec command (not the Ray head: same image, ``ray``)."""
    return {n: s for n, s in compose()["services"].items()
            if s.get("image") == "genrec:latest" and "entrypoint" not in s}  # fmt: skip


def k8s_objects() -> list[dict]:
    """Every object of the overlay's manifests (a file may hold several, ``---``)."""
    return [doc for p in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(p.read_text())]


def pod_templates(doc: dict) -> dict[str, dict]:
    """The pod templates of a workload, by a name: Deployment and Job, or a RayCluster's
    head and worker groups."""
    if doc["kind"] in ("Deployment", "Job"):
        return {doc["metadata"]["name"]: doc["spec"]["template"]}
    if doc["kind"] == "RayCluster":
        name = doc["metadata"]["name"]
        found = {f"{name}-head": doc["spec"]["headGroupSpec"]["template"]}
        for group in doc["spec"].get("workerGroupSpecs", []):
            found[f"{name}-{group['groupName']}"] = group["template"]
        return found
    return {}


def containers(image: str = "genrec") -> dict[str, dict]:
    """Every container of ``image`` in the Kubernetes manifests, by workload name."""
    found = {}
    for doc in k8s_objects():
        for name, template in pod_templates(doc).items():
            for container in template["spec"]["containers"]:
                if container["image"] == image:
                    found[name] = container
    return found


def dockerfile_env() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    block = re.search(r"^ENV (.+?)(?:\n\n|\nWORKDIR)", text, re.S | re.M).group(1)
    return dict(re.findall(r"(\w+)=(\S+)", block))


def test_every_command_is_a_genrec_command() -> None:
    parser = build_parser()
    commands = [s["command"] for s in genrec_services().values() if "command" in s]
    commands += [c["args"] for c in containers().values() if "args" in c]
    # the RayJob's entrypoint is a shell line on the Ray head: `genrec ...`
    [job] = [d for d in k8s_objects() if d["kind"] == "RayJob"]
    program, *entrypoint = shlex.split(job["spec"]["entrypoint"])
    assert program == "genrec"
    commands.append(entrypoint)
    assert len(commands) >= 9
    for command in commands:
        args = parser.parse_args(command)  # SystemExit on an unknown command or option
        assert getattr(args, "handler", None) is not None, command


def test_every_genrec_variable_is_a_setting_and_valid(monkeypatch) -> None:
    # RAY_*: Ray's own (token authentication between the head and genrec's drivers)
    variables = {k: v for k, v in compose()["x-genrec"]["environment"].items()
                 if not k.startswith("RAY_")}  # fmt: skip
    variables["GENREC_DATABASE_URL"] = "postgresql+psycopg://genrec:pw@postgres:5432/genrec"
    docs = k8s_documents()
    variables |= docs["configmap.yaml"]["data"] | docs["secret.example.yaml"]["stringData"]
    variables |= {k: v for k, v in dockerfile_env().items() if k.startswith("GENREC_")}
    for container in containers().values():  # values a pod sets itself (the Ray head's)
        variables |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    unknown = set(variables) - setting_names() - PROCESS_VARIABLES
    assert not unknown, f"not settings: {sorted(unknown)}"
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))
    settings = Settings()  # raises on a value of the wrong type or choice
    assert settings.ingest.metrics_port == 9101 and settings.online.metrics_port == 9102
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.online.kv_store == "redis" and settings.train.workers > 1


def test_compose_has_redis_and_a_ray_head_the_refresh_reaches() -> None:
    services = compose()["services"]
    environment = compose()["x-genrec"]["environment"]
    assert environment["GENREC_REDIS__HOST"] == "redis"
    assert "--requirepass" in services["redis"]["command"]
    policy = services["redis"]["command"].index("--maxmemory-policy")
    assert services["redis"]["command"][policy + 1] == "noeviction"
    head = services["ray-head"]
    assert head["entrypoint"] == ["ray"] and head["command"][:2] == ["start", "--head"]
    client_port = next(a for a in head["command"] if a.startswith("--ray-client-server-port="))
    assert environment["GENREC_OFFLINE__RAY_ADDRESS"] == (
        f"ray://ray-head:{client_port.split('=')[1]}"
    )
    # Ray Train's checkpoints come back through the artifact volume: the head mounts it too
    assert head["volumes"] == compose()["x-genrec"]["volumes"]
    for role in ("scheduler", "bootstrap"):
        assert {"redis", "ray-head"} <= set(services[role].get("depends_on", {})), role
    assert "redis" in services["serve"]["depends_on"]


def test_k8s_has_redis_a_ray_cluster_and_a_refresh_rayjob() -> None:
    objects = {(d["kind"], d["metadata"]["name"]): d for d in k8s_objects() if "metadata" in d}
    config = k8s_documents()["configmap.yaml"]["data"]
    service = objects[("Service", "genrec-redis")]
    assert config["GENREC_REDIS__HOST"] == service["metadata"]["name"]
    redis = objects[("Deployment", "genrec-redis")]
    assert service["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    secret_keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"]}
    assert secret_keys == {"GENREC_REDIS__PASSWORD"}
    assert secret_keys <= set(k8s_documents()["secret.example.yaml"]["stringData"])
    cluster = objects[("RayCluster", "genrec-ray")]
    job = objects[("RayJob", "genrec-refresh")]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    # KubeRay names the head's service <cluster>-head-svc; 10001 is Ray Client's port
    assert config["GENREC_OFFLINE__RAY_ADDRESS"] == "ray://genrec-ray-head-svc:10001"
    head = containers()["genrec-ray-head"]
    assert {"name": "client", "containerPort": 10001} in head["ports"]
    # every Ray pod mounts the artifact volume at GENREC_HOME (Ray Train's checkpoints)
    home = config["GENREC_HOME"]
    for name, container in containers().items():
        if name.startswith("genrec-ray"):
            assert {"name": "data", "mountPath": home} in container["volumeMounts"], name


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
    # the RayJob runs a refresh when created: applied on its own once there are events
    applied_alone = {"secret.example.yaml", "refresh-rayjob.yaml"}
    assert set(kustomization["resources"]) == manifests - applied_alone


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_the_overlay() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    kinds = [doc["kind"] for doc in yaml.safe_load_all(rendered)]
    assert sorted(kinds) == ["ConfigMap", "Deployment", "Deployment", "Deployment", "Deployment",
                             "Job", "PersistentVolumeClaim", "RayCluster", "Service"]  # fmt: skip


# --- monitoring: Prometheus and the Grafana dashboard (Compose) ---------------------------

GRAFANA = DEPLOY / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
# Words of PromQL that are not metric names when they are not followed by "(".
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                "and", "or", "unless"}  # fmt: skip
PROMETHEUS_OWN = {"up"}  # written by Prometheus for every scrape target, not by genrec


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def expressions(node) -> list[str]:
    """Every PromQL expression in a dashboard: panel targets and annotation queries."""
    if isinstance(node, dict):
        own = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return own + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in expressions(value)]
    return []


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (strings, label matchers, ranges and grouping
    labels removed first; a word followed by "(" is a function or an aggregation)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def exposed_metric_names() -> set[str]:
    """What a genrec process's /metrics can hold: its registry's families with the series
    names of their type (a counter's _total, a histogram's _bucket, _count and _sum, ...)."""
    from prometheus_client import REGISTRY

    import genrec.infra.metrics  # noqa: F401 - defines (registers) every genrec metric

    suffixes = {
        "counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"), "stateset": ("",), "unknown": ("",),
        "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    }  # fmt: skip
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in suffixes[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


def provisioned_datasource() -> dict:
    files = sorted((GRAFANA / "provisioning" / "datasources").glob("*.yaml"))
    sources = [s for f in files for s in yaml.safe_load(f.read_text())["datasources"]]
    [source] = sources
    return source


def bind_mounts(service: str) -> dict[str, str]:
    """Container path -> host path (relative to infra/deploy/) of a service's bind mounts."""
    mounts = {}
    for volume in compose()["services"][service]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = source
    return mounts


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.95, sum by (stage, le) (rate(genrec_stage_latency_seconds_bucket'
        '{job=~"a|b"}[$__rate_interval]))) / on (x) group_left foo:bar == 1'
    ) == {"genrec_stage_latency_seconds_bucket", "foo:bar"}  # fmt: skip


def test_every_metric_the_dashboard_queries_is_one_genrec_exposes() -> None:
    exposed = exposed_metric_names()
    assert {"genrec_events_total", "genrec_request_latency_seconds_bucket",
            "genrec_stage_latency_seconds_count", "process_cpu_seconds_total"} <= exposed  # fmt: skip
    for name, dashboard in dashboards().items():
        queried = {m for e in expressions(dashboard) for m in promql_metric_names(e)}
        assert queried, name
        unknown = queried - exposed - PROMETHEUS_OWN
        assert not unknown, f"{name} queries metrics genrec does not expose: {sorted(unknown)}"
    # ... and every metric genrec defines has a panel somewhere.
    from prometheus_client import REGISTRY

    families = {f.name for f in REGISTRY.collect() if f.name.startswith("genrec_")}
    queried = " ".join(e for d in dashboards().values() for e in expressions(d))
    assert not [f for f in families if f not in queried], "metrics without a panel"


def test_the_dashboard_is_grafana_json_on_the_provisioned_datasource() -> None:
    source = provisioned_datasource()
    assert source["type"] == "prometheus"
    datasource = {"type": "prometheus", "uid": source["uid"]}
    assert dashboards(), "no dashboard JSON"
    for name, dashboard in dashboards().items():
        assert dashboard["uid"] and dashboard["title"], name
        assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
        panels = all_panels(dashboard)
        assert len({p["id"] for p in panels}) == len(panels), f"{name}: panel ids repeat"
        cells: set[tuple[int, int]] = set()
        for panel in panels:
            grid = panel["gridPos"]
            assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
            assert (
                grid["h"] > 0 and grid["w"] > 0 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
            )
            area = {
                (grid["x"] + i, grid["y"] + j) for i in range(grid["w"]) for j in range(grid["h"])
            }
            assert not area & cells, f"{name}: {panel['title']} overlaps another panel"
            cells |= area
            if panel["type"] == "row":
                assert not panel.get("targets"), panel["title"]
                continue
            assert panel["type"] in {"timeseries", "stat", "table", "heatmap", "gauge", "bargauge"}
            assert panel["title"] and panel["datasource"] == datasource, panel["title"]
            targets = panel["targets"]
            assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
            for target in targets:
                assert target["expr"].strip(), panel["title"]
                assert target.get("datasource", datasource) == datasource, panel["title"]
        for annotation in dashboard["annotations"]["list"]:
            if annotation["datasource"].get("type") == "prometheus":
                assert annotation["datasource"] == datasource and annotation["expr"]


def test_compose_provisions_grafana_and_prometheus_with_the_files_that_exist() -> None:
    services = compose()["services"]
    for service in ("prometheus", "grafana"):
        for source in bind_mounts(service).values():
            assert (DEPLOY / source).exists(), f"{service} mounts a missing {source}"
    # Prometheus reads the mounted config.
    config_flag = next(
        a for a in services["prometheus"]["command"] if a.startswith("--config.file=")
    )
    assert bind_mounts("prometheus")[config_flag.split("=", 1)[1]] == "./prometheus/prometheus.yml"
    # Grafana gets the provisioning folder, and the provider's path is where the dashboards are.
    grafana = bind_mounts("grafana")
    assert (DEPLOY / grafana["/etc/grafana/provisioning"]).resolve() == GRAFANA / "provisioning"
    [provider] = yaml.safe_load((GRAFANA / "provisioning/dashboards/genrec.yaml").read_text())[
        "providers"
    ]
    assert (DEPLOY / grafana[provider["options"]["path"]]).resolve() == DASHBOARDS
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (DASHBOARDS / Path(home).name).exists()
    # No monitoring file is left out of the containers.
    mounted = [
        (DEPLOY / s).resolve() for m in ("prometheus", "grafana") for s in bind_mounts(m).values()
    ]
    for path in [*GRAFANA.rglob("*"), *PROMETHEUS_CONFIG.parent.rglob("*")]:
        if path.is_file():
            assert any(path == m or m in path.parents for m in mounted), f"{path} is not mounted"
    # The datasource is the Compose Prometheus.
    url = urlparse(provisioned_datasource()["url"])
    assert url.hostname == "prometheus"
    assert f":{url.port}" in " ".join(services["prometheus"]["ports"])


def test_prometheus_scrapes_every_replica_on_its_metrics_port() -> None:
    environment = compose()["x-genrec"]["environment"]
    expected = {
        "ingest": int(environment["GENREC_INGEST__METRICS_PORT"]),
        "serve": int(environment["GENREC_ONLINE__METRICS_PORT"]),
    }
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    scraped, jobs = {}, set()
    for job in config["scrape_configs"]:
        jobs.add(job["job_name"])
        for discovery in job["dns_sd_configs"]:  # every container of the service, any replicas
            for name in discovery["names"]:
                scraped[name] = discovery["port"]
    assert scraped == expected
    assert set(scraped) <= set(compose()["services"])
    # The dashboard's job matchers name these jobs.
    matchers = {
        job
        for dashboard in dashboards().values()
        for expr in expressions(dashboard)
        for pattern in re.findall(r'job=~?"([^"]+)"', expr)
        for job in pattern.split("|")
    }
    assert matchers and matchers <= jobs
