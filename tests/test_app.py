"""The assembly point, without Ray: which config changes a running cluster can take, what the ingress is
given, and the direction of imports between the rooms (DESIGN.md §2)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.app import check_same_workers, ingress_config
from cluster.config import ClusterConfig, ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(folder: str) -> set[str]:
    modules = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module)
    return modules


@pytest.mark.parametrize("folder", ["router", "engine", "prefill_workers", "decode_workers", "kv_transfer"])
def test_no_room_but_cluster_imports_cluster(folder):
    assert not {m for m in imported_modules(folder) if m.split(".")[0] == "cluster"}


def test_engine_imports_none_of_the_rooms_above_it():
    above = {"router", "cluster", "prefill_workers", "decode_workers"}
    assert not {m for m in imported_modules("engine") if m.split(".")[0] in above}


def test_the_control_plane_loads_without_torch():
    """The cluster controller's module, config validation, the metrics hub, constraint validation and the
    worker actor classes load no torch: the controller, which imports the worker classes to create workers,
    starts them without first loading the model code itself (seconds of CPU on a small box, on the path of
    every `tandem serve`, Serve deploy, scale-up and controller restart); each worker loads it in its own
    process."""
    light = ["cluster.controller", "cluster.config", "cluster.autoscaler", "router.metrics", "engine.structured",
             "kv_transfer.addresses", "kv_transfer.tls", "decode_workers.worker", "prefill_workers.worker"]
    code = f"import sys; [__import__(m) for m in {light!r}]; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_stopping_ingress_replica_checks_its_requests_often_and_still_waits_for_them():
    # Serve's default sleeps 2 s before its first check, so an idle replica took 2 s to stop; the bound on
    # waiting for requests in flight stays Serve's (20 s).
    from router.api.ingress import Ingress

    # As build_app deploys it: its options keep the drain settings.
    deployment = Ingress.options(num_replicas=2, max_ongoing_requests=64, max_queued_requests=64)._deployment_config
    assert deployment.graceful_shutdown_wait_loop_s <= 0.2
    assert deployment.graceful_shutdown_timeout_s >= 20


def test_the_engine_package_still_exports_its_names_on_first_use():
    import engine
    import kv_transfer
    from engine import Engine, SamplingParams
    from engine.engine import Engine as engine_class
    assert Engine is engine_class and SamplingParams.__module__ == "engine.sampling_params"
    assert set(engine.__all__) <= set(dir(engine)) and kv_transfer.KVHandle.__module__ == "kv_transfer.handle"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        engine.Nope


def test_a_running_cluster_refuses_a_config_for_other_workers_naming_the_fields():
    running = ClusterConfig(model="/models/a")
    with pytest.raises(ConfigError, match=r"engine\.block_size, model differ.*refusing"):
        check_same_workers(running, ClusterConfig(model="/models/b", engine={"block_size": 32}))
    with pytest.raises(ConfigError, match=r"transfer\.backend"):
        check_same_workers(running, ClusterConfig(model="/models/a", transfer={"backend": "torch_dist"}))


def test_a_running_cluster_takes_router_key_and_autoscaler_changes():
    running = ClusterConfig(model="/models/a")
    check_same_workers(running, ClusterConfig(model="/models/a", router={"migration_limit": 1},
                                              api_keys={"k": "t"}, autoscaler={"enabled": True},
                                              decode={"replicas": 3}, ingress_replicas=2))


def test_the_ingress_gets_the_router_options_and_model_limits_of_the_config():
    config = ClusterConfig(model="/models/a", served_model_name="a", mode="colocated", api_keys={"k": "t"},
                           engine={"block_size": 32, "max_model_len": 512},
                           router={"max_local_prefill_length": 0, "migration_limit": 1, "max_queued_requests": 9})
    ingress = ingress_config(config)
    assert (ingress.model, ingress.model_name, ingress.block_size, ingress.max_model_len) == ("/models/a", "a", 32, 512)
    assert (ingress.disagg.max_local_prefill_length, ingress.migration_limit, ingress.max_queued_requests) == (0, 1, 9)
    assert ingress.colocated and ingress.api_keys == {"k": "t"}


def test_autoscaler_thresholds_and_ingress_replicas_come_from_the_config_file(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("autoscaler:\n  enabled: true\n  interval_s: 2\n  decode: {running_up: 16, running_down: 4}\n"
                    "ingress_replicas: 2\n")
    config = load_config(path)
    assert config.autoscaler.enabled and config.autoscaler.interval_s == 2
    assert (config.autoscaler.decode.running_up, config.autoscaler.decode.running_down) == (16, 4)
    assert config.ingress_replicas == 2
    path.write_text("autoscaler: {decode: {running_up: 4, running_down: 16}}\n")
    with pytest.raises(ConfigError, match="autoscaler"):
        load_config(path)


def test_placement_is_by_measured_cost_against_the_slos_unless_thresholds_are_chosen():
    ingress = ingress_config(ClusterConfig(model="/models/a", slo={"ttft_ms": 1500, "itl_ms": 100}))
    assert ingress.disagg.placement == "slo"
    assert (ingress.disagg.ttft_slo_s, ingress.disagg.itl_slo_s) == (1.5, 0.1)
    # A config written for the fixed thresholds keeps them; `placement` says which explicitly.
    assert ingress_config(ClusterConfig(router={"max_local_prefill_length": 0})).disagg.placement == "thresholds"
    explicit = ClusterConfig(router={"max_local_prefill_length": 0, "placement": "slo"})
    assert ingress_config(explicit).disagg.placement == "slo"
    # Decode workers chunk local prefills to the ITL SLO; prefill workers do not.
    config = ClusterConfig(slo={"itl_ms": 100})
    assert config.engine_config(config.decode, "decode").itl_slo_ms == 100
    assert config.engine_config(config.prefill, "prefill").itl_slo_ms is None


def test_round_robin_routing_is_a_router_option_the_ingress_gets():
    assert ingress_config(ClusterConfig()).routing == "prefix_aware"
    assert ingress_config(ClusterConfig(router={"routing": "round_robin"})).routing == "round_robin"
    with pytest.raises(ConfigError, match="router.routing"):
        load_config(None, **{"router.routing": "random"})
