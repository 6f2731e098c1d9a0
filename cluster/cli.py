"""The `tandem` command.

    tandem serve [--config FILE] [--model DIR] [--prefill N] [--decode M] [--colocated] [--device D]
                 [--host H] [--port P] [--api-key KEY[:TENANT]]... [--admin-key KEY] [--address RAY]
                 [--autoscale]
    tandem status [--json]
    tandem scale [--prefill N] [--decode M]
    tandem drain WORKER
    tandem replay RECORDS [--request-id ID] [--prompt-file F | --messages-file F] [--url URL | --model DIR]
    tandem trace REQUEST_ID [--json]

`serve` runs the cluster in the foreground until Ctrl-C, SIGINT, SIGTERM or SIGHUP (a second one, or a stop over
30 s, ends it at once); a local Ray instance it started never outlives it, even after kill -9. `status`, `scale`, `drain` and `trace` talk
to a running server's admin API (--url, default http://127.0.0.1:8000) with its admin key (--admin-key
or TANDEM_ADMIN_KEY). Every failure prints what to do next, never a traceback.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import sys
from urllib.parse import urlparse

from cluster.admin_client import AdminClient, CLIError
from cluster.trace_view import format_trace

DEFAULT_URL = "http://127.0.0.1:8000"
WORKER_ID = re.compile(r"^(prefill|decode)-\d+$")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.command(args, parser)
    except CLIError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1


# ---- commands ---------------------------------------------------------------------------------------

def serve_command(args, parser) -> int:
    from cluster.config import ConfigError, load_config

    if args.colocated and args.prefill is not None:
        parser.error("--prefill does not apply with --colocated (there is no prefill pool)")
    overrides = {"model": args.model, "device": args.device, "dtype": args.dtype,
                 "mode": "colocated" if args.colocated else None, "prefill.replicas": args.prefill,
                 "decode.replicas": args.decode, "prefill.tensor_parallel_size": args.prefill_tp,
                 "decode.tensor_parallel_size": args.decode_tp, "kv_tiers.host_gb": args.kv_host_gb,
                 "kv_tiers.disk_gb": args.kv_disk_gb, "kv_tiers.disk_path": args.kv_disk_path, "host": args.host, "port": args.port, "admin_key": args.admin_key,
                 "api_keys": dict(args.api_key) if args.api_key else None,
                 "autoscaler.enabled": True if args.autoscale else None,
                 "served_model_name": args.served_model_name, "chat_template": args.chat_template,
                 "audit.sink": args.audit_sink, "audit.log_inputs": True if args.audit_log_inputs else None,
                 "lora.enabled": True if args.enable_lora else None, "lora.max_loras": args.max_loras,
                 "lora.max_lora_rank": args.max_lora_rank,
                 "lora.modules": dict(args.lora_modules) if args.lora_modules else None}
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        raise CLIError(f"{exc}; fix the flag or the config file") from None
    if config.models and (flagged := [flag for flag, value in (
            ("--model", args.model), ("--served-model-name", args.served_model_name), ("--prefill", args.prefill),
            ("--decode", args.decode), ("--colocated", args.colocated or None), ("--lora-modules", args.lora_modules),
            ("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)) if value is not None]):
        raise CLIError(f"the config serves several models (`models:`); {', '.join(flagged)} would apply to none "
                       f"of them: set them in each model's entry")
    for sub in config.model_configs():
        for name in ("prefill", "decode"):
            pool, where = getattr(sub, name), f"{sub.model_name} {name}" if config.models else name
            if pool.replicas > pool.max_replicas:
                raise CLIError(f"{where}: {pool.replicas} replicas is above its max_replicas={pool.max_replicas}; "
                               f"lower --{name} or raise {name}.max_replicas in the config file")
    if any(sub.decode.replicas < 1 for sub in config.model_configs()):
        raise CLIError("the decode pool needs at least one worker: --decode 1 or more")
    warning = open_host_warning(config.host, config.port, config.api_keys)
    if warning:
        print(f"tandem: warning: {warning}", file=sys.stderr, flush=True)
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        # A purely local instance: Ray on loopback only, no token prompt.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from cluster.launcher import serve_until_stopped

    try:
        serve_until_stopped(config, address, say)
    except CLIError:
        raise
    except Exception as exc:  # a failed start is reported, not dumped; Ray's logs have the details
        raise CLIError(f"the server failed: {type(exc).__name__}: {exc}; Ray's logs are under "
                       f"/tmp/ray/session_latest/logs") from None
    return 0


def status_command(args, parser) -> int:
    status = _client(args).status()
    print(json.dumps(status, indent=2) if args.json else format_status(status, args.url))
    return 0


def scale_command(args, parser) -> int:
    if args.prefill is None and args.decode is None:
        parser.error("give --prefill N and/or --decode M")
    if args.decode == 0:
        parser.error("--decode must be at least 1: the decode pool serves every request")
    targets = {pool: n for pool, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None}
    result = _client(args).scale(targets, args.model)
    for pool, r in result["pools"].items():
        change = f"added {', '.join(r['added'])}" if r["added"] else \
            f"drained and removed {', '.join(r['drained'])}" if r["drained"] else "unchanged"
        print(f"{pool}: {r['replicas_before']} -> {r['replicas']} workers ({change})")
    return 0


def drain_command(args, parser) -> int:
    result = _client(args).drain(args.worker, args.model)
    print(f"{result['worker_id']} drained: its requests finished and it left the {result['pool']} pool")
    return 0


def trace_command(args, parser) -> int:
    trace = _client(args).trace(args.request_id)
    print(json.dumps(trace, indent=2) if args.json else format_trace(trace))
    return 0


def open_host_warning(host: str, port: int, api_keys: dict[str, str]) -> str | None:
    """What an operator must know before serving on a non-loopback address without API keys; None when
    the address is loopback or keys are set."""
    if api_keys or _is_loopback(host):
        return None
    return (f"serving on {host}:{port} without API keys: the API, and the prefix cache all its clients "
            f"share, are open to anyone who can reach that address; set TANDEM_API_KEYS (or --api-key) to "
            f"require keys and give each tenant its own cache, or serve on --host 127.0.0.1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to any interface


def say(message: str) -> None:
    print(f"tandem: {message}", flush=True)


def _client(args) -> AdminClient:
    return AdminClient(args.url, args.admin_key or os.environ.get("TANDEM_ADMIN_KEY"))


def format_status(status: dict, url: str) -> str:
    """The readable form of GET /admin/status: a pools table and a workers table (per model, with several)."""
    if "models" in status:
        parts = [format_status({**one, "flow": None}, url) for one in status["models"].values()]
        return "\n\n".join(parts) + _all_flow_lines(status)
    return _format_one(status, url) + _all_flow_lines(status)


def _all_flow_lines(status: dict) -> str:
    """The answering replica's ingress queue, then the other replicas' (as they last published them)."""
    return _flow_lines(status.get("flow")) + "".join(
        _flow_lines(flow).replace(f"(replica {flow['replica']})", f"(replica {flow['replica']}, {flow['age_s']:g}s ago)",
                                  1) for flow in status.get("flow_replicas") or [])


def _format_one(status: dict, url: str) -> str:
    lines = [f"tandem at {url}: model {status['model']}, {status['mode']}, membership version {status['version']}",
             ""]
    pools = [["POOL", "WORKERS", "DESIRED", "MIN..MAX"]]
    workers = [["WORKER", "POOL", "STATE", "RANKS", "RUNNING", "WAITING", "QUEUED TOKENS", "KV USAGE", "PREFIX HITS",
                "KV FAILURES"]]
    for name, pool in status["pools"].items():
        pools.append([name, str(pool["replicas"]), str(pool["desired"]),
                      f"{pool['min_replicas']}..{pool['max_replicas']}"])
        for w in pool["workers"]:
            if "running" not in w:
                workers.append([w["worker_id"], name, w["state"], *["-"] * 7])
                continue
            hits = f"{w['prefix_hit_rate']:.1%} ({w['prefix_cache_hits']}/{w['prefix_cache_queries']} tokens)"
            size = w.get("tensor_parallel_size", 1)
            ranks = str(size) if w.get("tp_ranks_alive", size) == size else f"{w['tp_ranks_alive']}/{size} up"
            workers.append([w["worker_id"], name, w["state"], ranks, str(w["running"]), str(w["waiting"]),
                            str(w["queued_prefill_tokens"]), f"{w['kv_usage']:.1%}", hits, _kv_failures(w)])
    return "\n".join(lines + _table(pools) + [""] + _table(workers))


def _flow_lines(flow: dict | None) -> str:
    """The ingress queue by tenant (per model, with several)."""
    if not flow:
        return ""
    if "models" in flow:
        return "".join(_flow_lines({"replica": flow["replica"], **one}).replace(
            "ingress queue", f"ingress queue of {model}", 1) for model, one in flow["models"].items())
    limit = flow["max_in_flight"] if flow["max_in_flight"] is not None else "no cap"
    placing = f", {flow['placing']} of them being placed" if flow.get("placing") else ""
    out = ["", f"ingress queue (replica {flow['replica']}): {flow['in_flight']} let on ({limit}){placing}, "
               f"{'saturated' if flow['saturated'] else 'not saturated'}, shedding {flow['shed']}"]
    if flow["tenants"]:
        out += _table([["TENANT", "WEIGHT", "RUNNING", "QUEUED"]]
                      + [[t, f"{v['weight']:g}", str(v["running"]), str(v["queued"])] for t, v in flow["tenants"].items()])
    return "\n" + "\n".join(out)


def _kv_failures(worker: dict) -> str:
    """A decode worker's pulls that fell back to local recompute, e.g. "3 (unreachable 2, timeout 1)"."""
    if "kv_transfer_failures" not in worker:
        return "-"
    reasons = sorted(worker["kv_transfer_failures_by_reason"].items(), key=lambda item: -item[1])
    detail = ", ".join(f"{reason} {n}" for reason, n in reasons)
    return f"{worker['kv_transfer_failures']} ({detail})" if detail else str(worker["kv_transfer_failures"])


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# ---- flags ------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM inference on Ray.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the cluster and its OpenAI API until Ctrl-C",
                                description="Start Ray (local unless --address or RAY_ADDRESS), the prefill and "
                                            "decode pools and the OpenAI API; flags override --config.")
    serve.add_argument("--config", type=_existing_file, metavar="FILE", help="YAML file with ClusterConfig fields")
    serve.add_argument("--model", type=_non_empty, metavar="DIR",
                       help="HF model directory (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", type=_non_empty, nargs="+", metavar="NAME",
                       help="the model's name(s) in the API; responses carry the first (default: --model)")
    serve.add_argument("--chat-template", type=_non_empty, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (file or inline) instead of the tokenizer's own")
    serve.add_argument("--prefill", type=_count, metavar="N", help="prefill workers at start (default 1)")
    serve.add_argument("--decode", type=_count, metavar="M", help="decode workers at start (default 1)")
    serve.add_argument("--colocated", action="store_true", help="no prefill pool: decode workers prefill too")
    serve.add_argument("--prefill-tp", type=_count, metavar="N",
                       help="tensor-parallel ranks per prefill worker (default 1)")
    serve.add_argument("--decode-tp", type=_count, metavar="N",
                       help="tensor-parallel ranks per decode worker (default 1)")
    serve.add_argument("--kv-host-gb", type=_gib, metavar="GIB",
                       help="per worker, a host-memory tier below the KV cache for evicted prefixes (default 0: none)")
    serve.add_argument("--kv-disk-gb", type=_gib, metavar="GIB",
                       help="per worker, a disk tier below the host tier (needs --kv-host-gb and --kv-disk-path)")
    serve.add_argument("--kv-disk-path", type=_non_empty, metavar="DIR", help="where the disk tier's files go")
    serve.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (implied by --lora-modules): /v1/load_lora_adapter loads more")
    serve.add_argument("--lora-modules", type=_lora_module, nargs="+", metavar="NAME=DIR",
                       help="PEFT adapters served from the start; requests name one as `model`")
    serve.add_argument("--max-loras", type=_positive, metavar="N", help="adapters per worker at once (default 1)")
    serve.add_argument("--max-lora-rank", type=_positive, metavar="R", help="the largest adapter rank (default 16)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"],
                       help="where workers run (default auto: CUDA when present)")
    serve.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                       help="model precision (default auto: bfloat16 on CUDA, float32 on CPU)")
    serve.add_argument("--host", type=_non_empty, help="API address (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, help="API port (default 8000)")
    serve.add_argument("--api-key", type=_api_key, action="append", metavar="KEY[:TENANT]",
                       help="accept this API key (repeat for more; the tenant isolates prefix caches)")
    serve.add_argument("--admin-key", type=_secret, metavar="KEY",
                       help="enable the admin API with this key (or TANDEM_ADMIN_KEY)")
    serve.add_argument("--address", type=_non_empty, metavar="ADDR",
                       help="join this Ray cluster (or RAY_ADDRESS) instead of starting a local one")
    serve.add_argument("--autoscale", action="store_true",
                       help="resize the pools from their load within min_replicas..max_replicas "
                            "(the config's autoscaler section sets the thresholds)")
    serve.add_argument("--audit-sink", type=_audit_sink, metavar="SINK",
                       help="write an audit record per request: stdout or file:/absolute/path (default: off)")
    serve.add_argument("--audit-log-inputs", action="store_true",
                       help="audit records carry prompts and outputs as text, not only their SHA-256 digests")
    serve.set_defaults(command=serve_command)

    def admin_command(name: str, help: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("--url", type=_url, default=os.environ.get("TANDEM_URL", DEFAULT_URL),
                         help=f"the server (default {DEFAULT_URL}, or TANDEM_URL)")
        sub.add_argument("--admin-key", type=_secret, metavar="KEY",
                         help="the server's admin key (default TANDEM_ADMIN_KEY)")
        sub.set_defaults(command=run)
        return sub

    admin_command("status", "show pools, workers, health, load, KV usage and prefix hit rates",
                  status_command).add_argument("--json", action="store_true", help="print the raw JSON")
    scale = admin_command("scale", "resize the pools; returns once new workers serve or drained ones left",
                          scale_command)
    scale.add_argument("--prefill", type=_count, metavar="N", help="prefill workers wanted")
    scale.add_argument("--decode", type=_count, metavar="M", help="decode workers wanted")
    scale.add_argument("--model", type=_non_empty, metavar="NAME", help="whose pools, when several models are served")
    drain = admin_command("drain", "stop routing to a worker, let its requests finish, then remove it",
                          drain_command)
    drain.add_argument("worker", type=_worker_id, metavar="WORKER", help="worker id, e.g. decode-1 (see `tandem status`)")
    drain.add_argument("--model", type=_non_empty, metavar="NAME", help="whose worker, when several models are served")
    trace = admin_command("trace", "show where a recent request's time went, stage by stage", trace_command)
    trace.add_argument("request_id", type=_request_id, metavar="REQUEST_ID",
                       help="its id: the X-Request-Id the client sent or the response header carried")
    trace.add_argument("--json", action="store_true", help="print the raw JSON")
    add_replay_command(commands)
    return parser


def replay_command(args, parser) -> int:
    """Exit status 2 when the replay cannot run (1 is kept for outputs that differ)."""
    from cluster.replay import replay
    try:
        return replay(args)
    except CLIError as exc:
        print(f"tandem replay: {exc}", file=sys.stderr)
        return 2


def add_replay_command(commands) -> None:
    replay = commands.add_parser(
        "replay", help="run an audited request again and check its output against the record's digests",
        description="Re-run the request of an audit record (from the record's logged input, or the file given) "
                    "with its seed and sampling parameters, offline on the model directory or on a server "
                    "(--url), and say whether the outputs match. Exit status: 0 match, 1 mismatch, 2 cannot run.")
    replay.add_argument("record", metavar="RECORDS", help="a JSON-lines file of audit records, or - for stdin")
    replay.add_argument("--request-id", type=_non_empty, metavar="ID", help="which record (needed with several)")
    given = replay.add_mutually_exclusive_group()
    given.add_argument("--prompt-file", type=_existing_file, metavar="FILE",
                       help="a completion's prompt (the file's exact text), when the record holds digests only")
    given.add_argument("--messages-file", type=_existing_file, metavar="FILE",
                       help="a chat's messages (a JSON list), when the record holds digests only")
    where = replay.add_mutually_exclusive_group()
    where.add_argument("--url", type=_url, help="replay on this running server (its OpenAI API's base URL)")
    where.add_argument("--model", type=_non_empty, metavar="DIR",
                       help="offline: the model directory (default: the one the record's server used)")
    replay.add_argument("--device", choices=["auto", "cpu", "cuda"], help="offline: where the engine runs")
    replay.add_argument("--api-key", type=_secret, metavar="KEY", help="with --url: the API key (or TANDEM_API_KEY)")
    replay.add_argument("--ignore-revision", action="store_true",
                        help="run even when the model revision differs from the record's (then a warning)")
    replay.set_defaults(command=replay_command)


def _request_id(text: str) -> str:
    if not 0 < len(text) <= 128 or not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a request id: 1 to 128 printable ASCII characters")
    return text


def _count(text: str) -> int:
    if not text.isdigit() or int(text) > 256:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker count: give a whole number from 0 to 256")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 1 to 1024")
    return int(text)


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value <= 65536):  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give GiB as a number from 0 to 65536")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number from 1 to 65535")
    return int(text)


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _secret(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("a key must be non-empty and without spaces")
    return text


def _api_key(text: str) -> tuple[str, str]:
    key, sep, tenant = text.partition(":")
    if not key or any(c.isspace() or c == "," for c in text) or (sep and not tenant):
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY or KEY:TENANT, both non-empty, without spaces "
                                         f"or commas")
    from cluster.config import key_tenant
    return key, tenant or key_tenant(key)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=DIR (a PEFT adapter directory)")
    return name, path


def _audit_sink(text: str) -> str:
    from router.api.audit_sink import check_sink
    try:
        return check_sink(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _url(text: str) -> str:
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL: give e.g. {DEFAULT_URL}")
    return text.rstrip("/")


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _worker_id(text: str) -> str:
    if not WORKER_ID.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker id: give e.g. decode-1 "
                                         f"(`tandem status` lists them)")
    return text


if __name__ == "__main__":
    sys.exit(main())
