"""The `tandem` CLI: flag validation, the admin API behind status/scale/drain on a real controller, and
`tandem serve` end to end in its own process while a client keeps sending requests."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import ray
import uvicorn
from fastapi import FastAPI

from router.api.flow_control import FlowControl
from cluster.admin_api import build_admin_router
from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.controller import get_controller, start_controller
from worker_runtime.cpu_cores import node_cores
from tests.helpers import free_port, wait_for

ADMIN_KEY = "admin-secret"


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `tandem *argv` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors exit 2
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- flag validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["scale", "--decode", "two"], "'two' is not a worker count"),
    (["scale", "--prefill", "-1"], "'-1' is not a worker count"),
    (["scale", "--decode", "300"], "'300' is not a worker count"),
    (["scale"], "give --prefill N and/or --decode M"),
    (["scale", "--decode", "0"], "--decode must be at least 1"),
    (["drain", "worker7"], "'worker7' is not a worker id: give e.g. decode-1"),
    (["status", "--url", "127.0.0.1:8000"], "is not a server URL"),
    (["status", "--admin-key", "two words"], "a key must be non-empty and without spaces"),
    (["serve", "--port", "70000"], "'70000' is not a port"),
    (["serve", "--api-key", "k:"], "give KEY or KEY:TENANT"),
    (["serve", "--api-key", "a,b"], "give KEY or KEY:TENANT"),
    (["serve", "--config", "/nonexistent.yaml"], "no such file: /nonexistent.yaml"),
    (["serve", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["serve", "--colocated", "--prefill", "1"], "--prefill does not apply with --colocated"),
    (["serve", "--kv-host-gb", "-1"], "'-1' is not a size"),
    (["serve", "--kv-disk-gb", "nan"], "'nan' is not a size"),
])
def test_bad_flags_exit_2_with_a_message_naming_the_flag(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_a_config_file_error_names_the_field_and_exits_1(capsys, tmp_path):
    config = tmp_path / "tandem.yaml"
    config.write_text("decode:\n  replicas: 2\n  max_replicas: 1\nengine:\n  block_size: 0\n")
    code, _, err = run_cli(capsys, "serve", "--config", str(config))
    assert code == 1
    assert "invalid config field 'engine.block_size'" in err


def test_serve_refuses_more_replicas_than_max_replicas(capsys, tmp_path):
    config = tmp_path / "tandem.yaml"
    config.write_text("decode:\n  max_replicas: 2\n")
    code, _, err = run_cli(capsys, "serve", "--config", str(config), "--decode", "3")
    assert code == 1
    assert "decode: 3 replicas is above its max_replicas=2" in err


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "/no/such/template.jinja"], "invalid config field 'chat_template'"),
    (["--chat-template", "{% for m in messages %}"], "not valid Jinja"),
    (["--served-model-name", "a", "a"], "invalid config field 'served_model_name'"),
])
def test_bad_model_naming_and_template_flags_exit_1_naming_the_field(capsys, flags, message):
    code, _, err = run_cli(capsys, "serve", *flags)
    assert code == 1 and message in err and "Traceback" not in err


def test_served_model_names_and_a_template_file_reach_the_ingress_config(tmp_path):
    from cluster.app import ingress_config
    from cluster.cli import build_parser
    from cluster.config import load_config

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = build_parser().parse_args(["serve", "--served-model-name", "smol", "smol-v2",
                                      "--chat-template", str(template)])
    config = ingress_config(load_config(None, served_model_name=args.served_model_name,
                                        chat_template=args.chat_template))
    assert (config.model_name, config.model_aliases) == ("smol", ("smol-v2",))
    assert config.chat_template == template.read_text()


def test_admin_commands_without_a_server_say_how_to_start_one(capsys):
    code, _, err = run_cli(capsys, "status", "--url", f"http://127.0.0.1:{free_port()}")
    assert code == 1
    assert "no tandem server at http://127.0.0.1:" in err and "start one with `make run`" in err


@pytest.mark.parametrize("host, keys, warned", [
    ("0.0.0.0", {}, True),
    ("10.1.2.3", {}, True),
    ("::", {}, True),
    ("tandem.example", {}, True),
    ("0.0.0.0", {"key": "tenant"}, False),
    ("127.0.0.1", {}, False),
    ("127.0.0.2", {}, False),
    ("::1", {}, False),
    ("localhost", {}, False),
])
def test_only_a_non_loopback_host_without_api_keys_is_warned_about(host, keys, warned):
    from cluster.cli import open_host_warning

    warning = open_host_warning(host, 8000, keys)
    assert (warning is not None) == warned
    if warned:
        assert f"{host}:8000 without API keys" in warning and "prefix cache" in warning
        assert "TANDEM_API_KEYS" in warning


def test_serve_on_an_open_host_without_keys_prints_the_warning_before_starting(capsys, monkeypatch):
    import cluster.launcher

    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    started = []
    monkeypatch.setattr(cluster.launcher, "serve_until_stopped", lambda config, *_: started.append(config.host))
    code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0", "--port", "8123")
    assert (code, started) == (0, ["0.0.0.0"])
    assert "tandem: warning: serving on 0.0.0.0:8123 without API keys" in err
    code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0", "--api-key", "k:t")
    assert code == 0 and "warning" not in err


# ---- the admin API on a real controller -----------------------------------------------------------

@pytest.fixture(scope="module")
def admin_url(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, mode="colocated", name="admin", namespace="tandem-tests",
                           engine={"num_kv_blocks": 64}, decode={"max_replicas": 2})
    controller = start_controller(config, drain_grace_s=0.2)
    app = FastAPI()
    flow = FlowControl()  # an ingress replica's queue, as the ingress hands it to the admin routes
    app.include_router(build_admin_router(lambda: get_controller("admin", "tandem-tests"), ADMIN_KEY,
                                          flow_status=lambda: {"replica": "r0", **flow.snapshot()}))
    closed = FastAPI()
    closed.include_router(build_admin_router(lambda: controller, None))
    app.mount("/closed", closed)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started), "the admin API server never started"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def post(url, body, key=ADMIN_KEY):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_status_shows_pools_and_workers_as_a_table_and_as_json(capsys, admin_url):
    code, out, _ = run_cli(capsys, "status", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert code == 0
    assert "model " in out and "colocated" in out
    assert any(line.split()[:3] == ["decode-0", "decode", "healthy"] for line in out.splitlines())
    code, out, _ = run_cli(capsys, "status", "--url", admin_url, "--admin-key", ADMIN_KEY, "--json")
    status = json.loads(out)
    assert status["pools"]["decode"]["replicas"] == 1
    assert 0.0 <= status["pools"]["decode"]["workers"][0]["kv_usage"] <= 1.0
    assert status["pools"]["decode"]["workers"][0]["kv_transfer_failures"] == 0
    flow = status["flow"]  # the answering ingress replica's queue: nothing waits on an idle server
    assert flow["in_flight"] == 0 and flow["saturated"] is False and flow["shed"] == "off"
    assert all(t["queued"] == 0 for t in flow["tenants"].values())


def test_the_status_table_lists_each_decode_workers_kv_failures_by_reason():
    from cluster.cli import format_status

    row = {"state": "healthy", "running": 0, "waiting": 0, "queued_prefill_tokens": 0, "kv_usage": 0.1,
           "prefix_cache_queries": 4, "prefix_cache_hits": 2, "prefix_hit_rate": 0.5}
    status = {"model": "m", "mode": "disaggregated", "version": 1, "pools": {
        "prefill": {"replicas": 1, "desired": 1, "min_replicas": 0, "max_replicas": 2,
                    "workers": [{"worker_id": "prefill-0", **row}]},
        "decode": {"replicas": 2, "desired": 2, "min_replicas": 0, "max_replicas": 2, "workers": [
            {"worker_id": "decode-0", **row, "kv_transfer_failures": 3,
             "kv_transfer_failures_by_reason": {"timeout": 1, "unreachable": 2}},
            {"worker_id": "decode-1", **row, "kv_transfer_failures": 0, "kv_transfer_failures_by_reason": {}}]}}}
    lines = format_status(status, "http://127.0.0.1:8000").splitlines()
    header = next(line for line in lines if line.startswith("WORKER"))
    assert header.endswith("KV FAILURES")
    assert next(line for line in lines if line.startswith("decode-0")).endswith("3 (unreachable 2, timeout 1)")
    assert next(line for line in lines if line.startswith("decode-1")).endswith(" 0")
    assert next(line for line in lines if line.startswith("prefill-0")).endswith(" -")
    status["flow"] = {"replica": "r1", "in_flight": 3, "placing": 1, "max_in_flight": None, "saturated": True,
                      "shed": "on",
                      "tenants": {"batch": {"running": 1, "queued": 7, "weight": 1.0},
                                  "chat": {"running": 2, "queued": 0, "weight": 4.0}}}
    lines = format_status(status, "http://127.0.0.1:8000").splitlines()
    assert "ingress queue (replica r1): 3 let on (no cap), 1 of them being placed, saturated, shedding on" in lines
    assert next(line for line in lines if line.startswith("batch")).split() == ["batch", "1", "1", "7"]
    assert next(line for line in lines if line.startswith("chat")).split() == ["chat", "4", "2", "0"]
    # With several ingress replicas, the others' queues follow, as they last published them.
    status["flow_replicas"] = [{**status["flow"], "replica": "r2", "in_flight": 1, "placing": 0, "saturated": False,
                                "tenants": {"batch": {"running": 1, "queued": 2, "weight": 1.0}}, "age_s": 2.5}]
    lines = format_status(status, "http://127.0.0.1:8000").splitlines()
    assert "ingress queue (replica r2, 2.5s ago): 1 let on (no cap), not saturated, shedding on" in lines
    assert [line.split() for line in lines if line.startswith("batch")] == [["batch", "1", "1", "7"],
                                                                            ["batch", "1", "1", "2"]]


def test_the_admin_key_comes_from_the_environment_and_a_wrong_one_is_refused(capsys, admin_url, monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_KEY", ADMIN_KEY)
    assert run_cli(capsys, "status", "--url", admin_url)[0] == 0
    code, _, err = run_cli(capsys, "status", "--url", admin_url, "--admin-key", "wrong")
    assert code == 1 and "rejected the admin key" in err
    monkeypatch.delenv("TANDEM_ADMIN_KEY")
    assert post(admin_url + "/admin/drain", {"worker_id": "decode-0"}, key="")[0] == 401


def test_a_server_without_an_admin_key_has_the_admin_api_disabled(capsys, admin_url):
    code, _, err = run_cli(capsys, "status", "--url", admin_url + "/closed", "--admin-key", ADMIN_KEY)
    assert code == 1
    assert "admin API disabled: set TANDEM_ADMIN_KEY" in err and "restart the server with --admin-key" in err


def test_scale_up_then_drain_through_the_cli(capsys, admin_url):
    code, out, _ = run_cli(capsys, "scale", "--decode", "2", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert (code, out.strip()) == (0, "decode: 1 -> 2 workers (added decode-1)")
    code, out, _ = run_cli(capsys, "drain", "decode-1", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert (code, out.strip()) == (0, "decode-1 drained: its requests finished and it left the decode pool")
    code, out, _ = run_cli(capsys, "scale", "--decode", "1", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert (code, out.strip()) == (0, "decode: 1 -> 1 workers (unchanged)")
    with urllib.request.urlopen(urllib.request.Request(
            admin_url + "/admin/events", headers={"Authorization": f"Bearer {ADMIN_KEY}"})) as response:
        events = [(e["action"], e["worker_id"]) for e in json.loads(response.read())["events"]]
    assert events == [("scale_up", ""), ("add", "decode-1"), ("drain", "decode-1"), ("remove", "decode-1")]


def test_operator_errors_come_back_as_messages(capsys, admin_url):
    code, _, err = run_cli(capsys, "drain", "decode-9", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert code == 1 and "no worker 'decode-9'; `tandem status` lists them" in err
    code, _, err = run_cli(capsys, "scale", "--prefill", "1", "--decode", "2", "--url", admin_url,
                           "--admin-key", ADMIN_KEY)
    assert code == 1 and "no 'prefill' pool in colocated mode" in err
    code, out, _ = run_cli(capsys, "status", "--url", admin_url, "--admin-key", ADMIN_KEY, "--json")
    assert json.loads(out)["pools"]["decode"]["replicas"] == 1  # nothing changed: targets are checked first
    code, _, err = run_cli(capsys, "scale", "--decode", "3", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert code == 1 and "decode replicas must be in [0, 2]" in err
    code, _, err = run_cli(capsys, "drain", "decode-0", "--url", admin_url, "--admin-key", ADMIN_KEY)
    assert code == 1 and "last decode worker" in err


@pytest.mark.parametrize("body, param", [
    ({"pool": "decode"}, None),
    ({"pool": "gpu", "replicas": 1}, "pool"),
    ({"decode": -1}, "decode"),
    ({"decode": 1, "extra": True}, "extra"),
    ({}, None),
])
def test_bad_scale_bodies_are_400_naming_the_field(admin_url, body, param):
    status, error = post(admin_url + "/admin/scale", body)
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param


# ---- `tandem serve` end to end --------------------------------------------------------------------

@pytest.mark.slow
def test_serve_status_scale_drain_under_load_then_sigterm(tmp_path, tiny_llama_dir):
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TANDEM_ADMIN_KEY": ADMIN_KEY, "TANDEM_URL": url, "TANDEM_CPU_DIR": str(tmp_path / "cpu")}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "serve.log", "w+")
    (tmp_path / "cluster.yaml").write_text("cpu: {isolate_prefill: true}\n")
    server = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--model", tiny_llama_dir,
                               "--port", str(port), "--api-key", "test-key:tenant-a",
                               "--config", str(tmp_path / "cluster.yaml")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def tandem(*argv):
        done = subprocess.run([sys.executable, "-m", "cluster.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(1)
        isolation = ServingIsolation(server.pid, tmp_path) if len(node_cores()) >= 2 else None
        if isolation:
            isolation.check_serving_processes_are_off_the_prefill_cores()

        client = OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=120)
        results, stop = [], threading.Event()

        def load():
            i = 0
            while not stop.is_set() and i < 400:
                try:
                    r = client.completions.create(model=tiny_llama_dir, prompt=f"request {i}: the",
                                                  max_tokens=24, temperature=0)
                    results.append((r.choices[0].finish_reason, r.usage.completion_tokens, time.time()))
                except Exception as exc:  # noqa: BLE001 - counted as a failed request
                    results.append((f"{type(exc).__name__}: {exc}", 0, time.time()))
                i += 1

        clients = [threading.Thread(target=load) for _ in range(3)]
        for t in clients:
            t.start()
        marks = [time.time()]
        assert "decode-0" in tandem("status")
        assert tandem("scale", "--decode", "2").strip() == "decode: 1 -> 2 workers (added decode-1)"
        assert "decode-1" in tandem("status")
        if isolation:  # started from the confined raylet, it still claims a core or runs on the whole node
            isolation.check_decode_workers(2)
        marks.append(time.time())
        assert tandem("drain", "prefill-0").strip().startswith("prefill-0 drained")  # decode prefills alone now
        marks.append(time.time())
        scaled_down = tandem("scale", "--decode", "1").strip()
        marks.append(time.time())
        assert scaled_down.startswith("decode: 2 -> 1 workers (drained and removed decode-")
        status = json.loads(tandem("status", "--json"))
        assert status["pools"]["prefill"]["workers"] == []
        assert len(status["pools"]["decode"]["workers"]) == 1
        stop.set()
        for t in clients:
            t.join(timeout=180)
        failed = [r for r in results if r[0] not in ("length", "stop")]
        assert failed == [], failed[:5]
        assert all(n == 24 for reason, n, _ in results if reason == "length")
        for start, end in zip(marks, marks[1:]):  # the load ran through every step
            assert sum(start < t < end for *_, t in results) >= 2, marks
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
        log.seek(0)
        output = log.read()
    assert code == 0, output
    assert "tandem: stopped" in output and "Traceback" not in output


class ServingIsolation:
    """What `tandem serve` on CPU does with cores: once it serves, Ray's and Serve's own processes run on
    the CPUs it names, the prefill worker on others; each engine worker owns its cores or, unpinned, runs
    on the whole node."""

    def __init__(self, server_pid: int, tmp_path):
        self.server_pid, self.lock_dir = server_pid, str(tmp_path / "cpu")
        self.node = {cpu for core in node_cores() for cpu in core}
        log = tmp_path / "serve.log"
        assert wait_for(lambda: "now run on CPUs" in log.read_text(), interval_s=0.5), log.read_text()
        listed = log.read_text().split("now run on CPUs ")[1].split(", off")[0]
        self.serving = {int(cpu) for cpu in listed.split(",")}
        assert self.serving and self.serving < self.node

    def processes(self) -> dict[int, str]:
        from cluster.local_ray_watchdog import family
        found = {}
        for pid in family("no-marker", root=self.server_pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
        return found

    def affinity(self, pid: int) -> set[int]:
        """Every thread's; they must agree."""
        sets = {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}
        assert len(sets) == 1, (pid, sets)
        return set(sets.pop())

    def owns_cores(self, pid: int) -> bool:
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(self.lock_dir) for fd in fds)

    def check_serving_processes_are_off_the_prefill_cores(self) -> None:
        processes = self.processes()
        assert self.affinity(self.server_pid) == self.serving
        for name in ("gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor", "ingress",
                     "ray::ClusterController"):
            pids = [pid for pid, cmd in processes.items() if name in cmd]
            assert pids, (name, processes)
            assert all(self.affinity(pid) == self.serving for pid in pids), name
        prefill, = [pid for pid, cmd in processes.items() if "ray::PrefillWorker" in cmd]
        assert self.owns_cores(prefill) and not self.affinity(prefill) & self.serving
        decode, = [pid for pid, cmd in processes.items() if "ray::DecodeWorker" in cmd]
        assert self.owns_cores(decode) and self.affinity(decode) <= self.serving

    def check_decode_workers(self, count: int) -> None:
        decode = [pid for pid, cmd in self.processes().items() if "ray::DecodeWorker" in cmd]
        assert len(decode) == count
        for pid in decode:
            assert self.affinity(pid) <= self.serving if self.owns_cores(pid) else self.affinity(pid) == self.node
