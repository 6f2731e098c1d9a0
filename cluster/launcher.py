"""`tandem serve`: Ray (a local instance, or an existing cluster), the tandem Serve application on it, and
a clean stop on Ctrl-C, SIGINT, SIGTERM or SIGHUP, bounded by STOP_DEADLINE_S. A local Ray instance dies
with `tandem serve` however it ends (cluster/local_ray_watchdog.py). Ray is imported only here, after the
CLI has set Ray's environment."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from cluster.admin_client import CLIError
from cluster.config import ClusterConfig
from cluster.local_ray_watchdog import kill_marked, start_watchdog

# Logical CPUs beyond the pools' own for the Serve controller, HTTP proxy, ingress replica and autoscaler.
SERVE_CPUS = 4
# A clean stop (Serve, the pools, Ray) that takes longer is cut short: the local Ray's processes are killed.
STOP_DEADLINE_S = 30.0
# A restart right after a stop or a kill waits this long for the old HTTP proxy to let go of the port.
PORT_WAIT_S = 15.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def serve_until_stopped(config: ClusterConfig, address: str | None, say: Callable[[str], None]) -> None:
    """Start everything, print where the API is, block until a signal, then stop everything within
    STOP_DEADLINE_S."""
    stop = _StopOnSignal(say)
    started = time.monotonic()
    serving_cpus: set[int] = set()
    try:
        if address is None:
            wait_for_port(config.host, config.port, say)
            prepare_model(config, say)
            config = fit_pools_to_node(config, say)
            serving_cpus = isolate_prefill(config, say)
            stop.marker = start_watchdog()
        import ray

        if address is None:
            num_cpus = max(os.cpu_count() or 1, local_cpus(config))
            say(f"starting a local Ray instance on 127.0.0.1 ({num_cpus} logical CPUs)")
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=config.namespace,
                     logging_level=logging.WARNING)
        else:
            say(f"joining the Ray cluster at {address}")
            ray.init(address=address, namespace=config.namespace, logging_level=logging.WARNING)
        stop.install()  # again: ray.init puts in its own SIGTERM handler, which exits without stopping
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        _run_app(config, say)
        if serving_cpus:
            confine_local_ray(serving_cpus, stop.marker, say)
        say(f"ready in {time.monotonic() - started:.0f} s: OpenAI API at http://{config.host}:{config.port}/v1, "
            f"metrics at /metrics, admin API at /admin ({'on' if config.admin_key else 'off: no admin key'}); "
            f"Ctrl-C stops")
        while True:
            # Short sleeps: a signal delivered to one of Ray's threads runs our handler only once the
            # main thread wakes up.
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("stopping")
    finally:
        stop.begin(STOP_DEADLINE_S)
        _stop(config, say)
        stop.done()


class _StopOnSignal:
    """SIGINT, SIGTERM and SIGHUP stop `tandem serve` cleanly from its main thread, whatever dispositions
    it inherited (a job started in the background by a script starts with SIGINT ignored, and Python then
    leaves it ignored). A second signal while stopping, or a stop that overruns its deadline, ends the
    process at once, killing the local Ray's processes (those carrying `marker`)."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.marker = say, None
        self.stopping = False
        self.finished = threading.Event()
        # SIGHUP stays ignored under nohup; SIGINT is taken back from a background job's SIG_IGN.
        self.signals = [s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]
        self.install()

    def install(self) -> None:
        for signum in self.signals:
            signal.signal(signum, self._handle)

    def begin(self, deadline_s: float) -> None:
        self.stopping = True
        threading.Thread(target=self._enforce, args=(deadline_s,), daemon=True).start()

    def done(self) -> None:
        self.finished.set()

    def _handle(self, signum, frame) -> None:
        if not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt
        self._force(f"{signal.Signals(signum).name} while stopping")

    def _enforce(self, deadline_s: float) -> None:
        if not self.finished.wait(deadline_s):
            self._force(f"the clean stop took over {deadline_s:.0f} s")

    def _force(self, reason: str) -> None:
        self.say(f"stopping now ({reason}): killing the local Ray instance" if self.marker else
                 f"stopping now ({reason}); the application may still run on the Ray cluster")
        if self.marker:
            kill_marked(self.marker, root=os.getpid())
        os._exit(1)


def _run_app(config: ClusterConfig, say: Callable[[str], None]) -> None:
    from ray import serve

    from cluster.app import build_app

    for sub in config.model_configs():
        pools = f"{sub.decode.replicas} decode" if sub.mode == "colocated" else \
            f"{sub.prefill.replicas} prefill + {sub.decode.replicas} decode"
        say(f"starting the API and {pools} worker(s) on {sub.model_name} (device {sub.device})")
    with _Ticker("still starting: loading the model in the workers", say):
        # The cluster controller (and with it the workers, which take longest) starts first; Serve's
        # controller and proxy start while the workers load.
        app = build_app(config)
        serve.start(http_options={"host": config.host, "port": config.port}, proxy_location="HeadOnly",
                    logging_config={"log_level": "WARNING"})
        serve.run(app, name=config.name, route_prefix="/",
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
    for sub in config.model_configs():
        if sub.autoscaler.enabled:
            say(f"autoscaler on for {sub.model_name}: prefill {sub.prefill.min_replicas}..{sub.prefill.max_replicas}, "
                f"decode {max(sub.decode.min_replicas, 1)}..{sub.decode.max_replicas} workers")


def _stop(config: ClusterConfig, say: Callable[[str], None]) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    serve.shutdown()  # lets the ingress finish the requests it is serving
    from cluster.app import shutdown_cluster
    shutdown_cluster(config.name, config.namespace)
    ray.shutdown()
    say("stopped")


def prepare_model(config: ClusterConfig, say: Callable[[str], None]) -> None:
    """Convert the default model once (before any worker starts, so they do not all convert it), or check
    that a model directory exists and that its attention is one the engine runs exactly; also that CUDA is
    there when asked for. Every model's, with several."""
    if getattr(config, "models", None):
        for sub in config.model_configs():
            prepare_model(sub, say)
        return
    from engine.config import DEFAULT_MODEL
    from engine.model_loader import cache_dir, resolve_model_dir
    from engine.model_support import UnsupportedModelError, check_model_dir

    if config.model in (None, DEFAULT_MODEL) and not (cache_dir() / "models" / DEFAULT_MODEL).exists():
        say("converting the default model from GGUF to safetensors (once, about 20 s)")
    try:
        path = resolve_model_dir(config.model)
    except FileNotFoundError as exc:
        raise CLIError(f"{exc}; pass --model DIR with a Hugging Face model directory") from None
    try:
        check_model_dir(path)
    except UnsupportedModelError as exc:
        raise CLIError(str(exc)) from None
    say(f"model {config.model_name} from {path}")
    if config.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise CLIError("--device cuda, but torch sees no CUDA device here; use --device cpu (or auto)")


def wait_for_port(host: str, port: int, say: Callable[[str], None], wait_s: float = PORT_WAIT_S) -> None:
    """Return once host:port can be listened on; a server stopped or killed a moment ago gets `wait_s` to
    let go of it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return check_port_free(host, port)
        except CLIError:
            if time.monotonic() >= deadline:
                raise
        say(f"{host}:{port} is still taken; waiting up to {wait_s:.0f} s for it")
        time.sleep(1.0)


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CLIError(f"cannot listen on {host}:{port} ({exc.strerror}); is a tandem server already "
                           f"running there (`tandem status --url http://{host}:{port}`)? Otherwise pick "
                           f"another --port") from None


def local_cpus(config: ClusterConfig) -> int:
    """Logical CPUs a local Ray needs so that both pools (of every model) can grow to max_replicas."""
    if config.models:
        return sum(local_cpus(sub) - SERVE_CPUS for sub in config.model_configs()) + SERVE_CPUS
    pools = [config.decode] if config.mode == "colocated" else [config.prefill, config.decode]
    return int(sum(p.max_replicas * p.num_cpus for p in pools)) + SERVE_CPUS


def fit_pools_to_node(config: ClusterConfig, say: Callable[[str], None]) -> ClusterConfig:
    """On a local CPU cluster, split this machine's cores between the starting workers (pools whose
    num_cpus the config leaves unset); each worker is then pinned to that many cores of its own."""
    from engine.config import resolve_device
    from worker_runtime.cpu_cores import node_cores

    if resolve_device(config.device).type != "cpu":
        return config
    if config.models:
        return fit_models_to_cores(config, len(node_cores()), say)
    fitted = fit_pools_to_cores(config, len(node_cores()))
    if fitted is not config:
        pools = [("prefill", fitted.prefill)] if fitted.mode == "disaggregated" else []
        say("cores per worker: " + ", ".join(f"{name} {int(p.num_cpus)}" for name, p in
                                              [*pools, ("decode", fitted.decode)]) +
            _lending_note(fitted.cpu))
    return fitted


def _lending_note(cpu) -> str:
    if not (cpu.pin and cpu.borrow):
        return ""
    return " (pinned; prefill borrows idle decode cores" + (", decode idle prefill cores)" if cpu.decode_borrows else ")")


def fit_pools_to_cores(config: ClusterConfig, cores: int) -> ClusterConfig:
    """Equal shares of `cores` for the starting prefill workers, the rest for the decode workers (they
    lend theirs when idle), so no core idles; from 8 cores on, one is left to the Serve proxy, the
    ingress and the controller. Pools with num_cpus set in the config keep it."""
    prefill = config.prefill.replicas if config.mode == "disaggregated" else 0
    decode = config.decode.replicas
    usable = cores - (1 if cores >= 8 else 0)
    if decode < 1 or not config.cpu.pin:
        return config
    share = max(1, usable // (prefill + decode))
    update = {}
    if prefill and "num_cpus" not in config.prefill.model_fields_set:
        update["prefill"] = config.prefill.model_copy(
            update={"num_cpus": float(max(share, config.prefill.tensor_parallel_size))})  # a core per rank at least
    if "num_cpus" not in config.decode.model_fields_set:
        taken = prefill * int(update["prefill"].num_cpus if "prefill" in update else config.prefill.num_cpus)
        update["decode"] = config.decode.model_copy(update={"num_cpus": float(max(
            1, config.decode.tensor_parallel_size, (usable - taken) // decode))})
    return config.model_copy(update=update) if update else config


def fit_models_to_cores(config: ClusterConfig, cores: int, say: Callable[[str], None]) -> ClusterConfig:
    """Several models: each gets a share of `cores` by its starting workers, split among them as for one
    model (fit_pools_to_cores); the shares go into the models' entries."""
    subs = config.model_configs()
    workers = [s.decode.replicas + (s.prefill.replicas if s.mode == "disaggregated" else 0) for s in subs]
    usable = cores - (1 if cores >= 8 else 0)
    entries = []
    for entry, sub, n in zip(config.models, subs, workers):
        fitted = fit_pools_to_cores(sub, max(n, usable * n // max(sum(workers), 1)) + (1 if cores >= 8 else 0))
        update = {pool: getattr(fitted, pool) for pool in ("prefill", "decode")
                  if getattr(fitted, pool) is not getattr(sub, pool)}
        if update:
            say(f"cores per worker of {sub.model_name}: " + ", ".join(
                f"{pool} {int(p.num_cpus)}" for pool, p in update.items()))
        entries.append(entry.model_copy(update=update) if update else entry)
    return config.model_copy(update={"models": entries})


def isolate_prefill(config: ClusterConfig, say: Callable[[str], None]) -> set[int]:
    """The CPUs a local Ray's own processes are to run on once it serves (`confine_local_ray`): those the
    starting prefill workers will not take (they take the lowest cores, decode workers the highest:
    worker_runtime/cpu_cores.py); empty when nothing is to be isolated. Sets TANDEM_NODE_CPUS for Ray's processes
    to inherit, so an engine worker started from a confined one still claims, or runs unpinned, on the
    whole node."""
    from engine.config import resolve_device
    from worker_runtime.cpu_cores import NODE_CPUS_ENV, cpu_quota, format_cpu_list, node_cores, node_cpus, pinning_is_safe

    if config.models:
        return set()  # each model's workers take their cores; Ray's own processes are not confined
    cores = node_cores()
    serving = serving_cores(config, cores)
    if resolve_device(config.device).type != "cpu" or not serving or not pinning_is_safe(cores, cpu_quota()):
        return set()
    os.environ[NODE_CPUS_ENV] = format_cpu_list(node_cpus())
    return {cpu for core in serving for cpu in core}


def confine_local_ray(cpus: set[int], marker: str, say: Callable[[str], None]) -> None:
    """Move this process and every process of its local Ray instance but the engine workers (GCS, the
    raylet, Ray's agents and idle workers, the Serve controller and proxy, the ingress, the cluster
    controller) to `cpus`, so their wakeups never take a prefill worker's core: they took a fifth of a
    served prefill's time (bench/HISTORY.md, "Who takes the prefill core"). Done once the application
    serves, since Ray and the workers start up faster with the whole machine; processes Ray starts later
    inherit the raylet's affinity."""
    from cluster.local_ray_watchdog import family
    from worker_runtime.cpu_cores import confine, format_cpu_list, pin_threads

    pin_threads(cpus)
    moved = confine(family(marker, root=os.getpid()), cpus)
    say(f"Ray's and Serve's processes ({moved}) now run on CPUs {format_cpu_list(cpus)}, off the prefill "
        f"workers' cores")


def serving_cores(config: ClusterConfig, cores: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The cores the starting prefill workers leave (they take the lowest); none when nothing is to be
    isolated: no pinning, no prefill pool, fractional prefill workers, or no core left over."""
    prefill = config.prefill
    if not (config.cpu.pin and config.cpu.isolate_prefill) or config.mode != "disaggregated" or \
            prefill.replicas < 1 or int(prefill.num_cpus) < 1:
        return []
    return cores[prefill.replicas * int(prefill.num_cpus):]


class _Ticker:
    """Says `message` with the elapsed time every `every_s` while a slow step runs."""

    def __init__(self, message: str, say: Callable[[str], None], every_s: float = 10.0):
        self.message, self.say, self.every_s = message, say, every_s
        self.done = threading.Event()

    def __enter__(self):
        started = time.monotonic()

        def tick():
            while not self.done.wait(self.every_s):
                self.say(f"{self.message} ({time.monotonic() - started:.0f} s)")

        threading.Thread(target=tick, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()
