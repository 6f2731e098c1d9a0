"""The typed cluster configuration: from YAML, CLI flags or Serve args, validated at the edge."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Literal

import jinja2
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import CpuBinding, EngineConfig
from engine.errors import first_field_error
from engine.kv_tiers_config import KVTiersConfig
from engine.lora_request import NAME_PATTERN, LoRAError, adapter_files
from engine.spec_decode import SpeculativeConfig
from cluster.scaling_policy import Thresholds
from kv_transfer.config import TLSFiles, TransferConfig
from kv_transfer.addresses import check_host
from kv_transfer.tls import check_files
from router.api.audit_sink import check_sink
from router.api.flow_control import FlowConfig, TenantPolicy
from router.api.reasoning_parser import ReasoningOptions
from router.api.request_limits import RequestLimits
from router.api.tool_parsers import TOOL_PARSERS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolConfig(_Strict):
    """One actor pool. `num_gpus=None` means one GPU per worker when CUDA is present, else none."""
    replicas: int = Field(1, ge=0, le=256)
    min_replicas: int = Field(0, ge=0)
    max_replicas: int = Field(8, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    num_threads: int | None = Field(None, ge=1)
    max_restarts: int = Field(3, ge=-1)  # Ray restarts a crashed worker in place this often
    replace_dead: bool = True  # then, or once killed, the controller starts a new worker in its place
    # A worker whose engine loop stays in one step for longer is stuck (a hung forward or collective):
    # the controller restarts it, and its streams migrate. None: never.
    stall_timeout_s: float | None = Field(120.0, gt=0)
    # Ranks per worker (engine/parallel/): each holds 1/N of the model and of its KV heads, on a GPU of its own
    # (the worker asks Ray for N times num_gpus) or on CPU a share of the worker's num_cpus cores.
    tensor_parallel_size: int = Field(1, ge=1, le=64)


class EngineOptions(_Strict):
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory_gb: float = Field(1.0, gt=0)
    num_kv_blocks: int | None = Field(None, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    # On CPU in fp32, linears whose weights are exactly the 4- or 8-bit blocks the model shipped as (the
    # default SmolLM2's GGUF) compute decode steps from those blocks (engine/weight_blocks.py).
    weight_blocks: bool = True
    # A step that computes a prompt takes another's only within this many prompt tokens; null: 256 on CPU, where
    # a bigger forward is no faster per token and the first prompt's first token would only wait, and no limit on
    # GPUs; 0: no limit (EngineConfig.prefill_batch_tokens).
    prefill_batch_tokens: int | None = Field(None, ge=0, le=1_000_000)


class KVTiersOptions(_Strict):
    """Tiers below each worker's KV cache (engine/kv_tiers.py): evicted prefix blocks wait in `host_gb` GiB of
    host memory (pinned on CUDA; shared memory on CPU, beyond `engine.kv_cache_memory_gb`), then in `disk_gb`
    GiB of a memory-mapped file in `disk_path`, and come back on a prefix hit instead of being recomputed;
    `remote_url` (redis:// or rediss://) adds a store every worker shares below them."""
    host_gb: float = Field(0.0, ge=0, le=4096, allow_inf_nan=False)
    disk_path: str | None = None
    disk_gb: float = Field(0.0, ge=0, le=65536, allow_inf_nan=False)
    # A Redis or Valkey server all workers share below their own tiers (needs the `store` extra: redis-py).
    remote_url: str | None = Field(None, max_length=2048)

    @model_validator(mode="after")
    def _consistent(self) -> KVTiersOptions:
        self.engine_config()
        if self.disk_path is not None:
            path = Path(self.disk_path)
            if path.exists() and not path.is_dir():
                raise ValueError(f"kv_tiers.disk_path {self.disk_path} is not a directory")
        return self

    def engine_config(self) -> KVTiersConfig | None:
        try:
            config = KVTiersConfig(self.host_gb, self.disk_path, self.disk_gb, self.remote_url)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("kv_tiers.")) from None
        return config if config.enabled else None


class LoRAOptions(_Strict):
    """LoRA adapters on the base model (engine/lora.py), vLLM's --enable-lora family: each worker holds up to
    `max_loras` adapters of rank up to `max_lora_rank` at once (host copies of `max_cpu_loras`); `modules`
    (name -> PEFT directory, on a filesystem every worker reads) are served from the start, and more can be
    loaded through /v1/load_lora_adapter once `enabled`. Requests name an adapter as their `model`."""
    enabled: bool = False  # turned on by `modules`
    max_loras: int = Field(1, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=1024)
    max_cpu_loras: int | None = Field(None, ge=1)
    modules: dict[str, str] = Field(default_factory=dict, description="adapter name -> PEFT directory")

    @field_validator("modules")
    @classmethod
    def _adapters(cls, modules: dict[str, str]) -> dict[str, str]:
        for name, path in modules.items():
            if not NAME_PATTERN.match(name):
                raise ValueError(f"adapter name {name!r} must be 1-128 characters of letters, digits and ._:/-")
            try:
                adapter_files(path)
            except LoRAError as exc:
                raise ValueError(f"adapter {name}: {exc}") from None
        return {name: str(Path(path).resolve()) for name, path in modules.items()}

    @model_validator(mode="after")
    def _on_with_modules(self) -> LoRAOptions:
        if self.modules:
            self.enabled = True
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self


class SpeculativeOptions(_Strict):
    """Speculative decoding in the decode pool (vLLM's `speculative_config`): requests that do not opt out
    (`"speculative": false` in the body) draft up to `num_speculative_tokens` by prompt lookup (`ngram`), or
    with `draft_model` by `model`, a smaller HF model directory of the same tokenizer, or with `suffix` from
    suffix trees over the request's tokens and earlier outputs of its cache salt (`suffix_decoding_*`)."""
    method: Literal["ngram", "draft_model", "suffix"] = "ngram"
    model: str | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    prompt_lookup_min: int = Field(2, ge=1, le=16)
    prompt_lookup_max: int = Field(4, ge=1, le=16)
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int = Field(24, ge=2, le=64)
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)
    suffix_decoding_max_tree_nodes: int = Field(500_000, ge=1)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeOptions:
        self.engine_config()  # the engine's own checks across fields (a ValueError names the fields)
        return self

    def engine_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(**self.model_dump())


class TLSOptions(_Strict):
    """TLS on the KV servers' gRPC channel (kv_transfer/tls.py): every worker's certificate and key (PEM
    files, e.g. mounted from a Kubernetes Secret) and the CA that signed them; `mutual` makes servers
    require client certificates too; `server_name` is the name the certificates carry when it is not the
    address dialled. The torch.distributed data plane stays unencrypted."""
    cert_file: str
    key_file: str
    ca_file: str | None = None
    mutual: bool = False
    server_name: str | None = None

    @model_validator(mode="after")
    def _files_readable(self) -> TLSOptions:
        try:
            check_files(self.files())
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("transfer.tls.")) from None
        return self

    def files(self) -> TLSFiles:
        return TLSFiles(self.cert_file, self.key_file, self.ca_file, self.mutual, self.server_name)


class TransferOptions(_Strict):
    backend: Literal["grpc", "torch_dist"] = "grpc"
    token: str | None = None
    lease_ttl_s: float = Field(30.0, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    layerwise: bool = False
    # grpc on CPU: a decode worker on its prefill worker's host copies the KV from its shared cache
    shared_memory: bool = True
    # A decode worker pulls the prefix blocks another worker holds (its cache or tiers) instead of computing
    # them, when the router's cost model says the pull is faster; every worker serves its own to peers.
    peer_prefix_pulls: bool = True
    # A drained (or scaled-down) decode worker hands its most used prefixes to the decode workers that stay,
    # for at most this long, before it leaves (with peer_prefix_pulls; 0: it does not).
    handoff_budget_s: float = Field(10.0, ge=0, le=600)
    # Per node, TANDEM_KV_ADVERTISE_HOST / TANDEM_KV_BIND_HOST in a worker's environment win over these.
    advertise_host: str | None = None  # None: the node's IP as Ray sees it
    bind_host: str | None = None  # None: the advertised address itself; "0.0.0.0": every interface
    tls: TLSOptions | None = None  # None: plaintext gRPC (authenticated by the shared token)

    @field_validator("token")
    @classmethod
    def _token_not_placeholder(cls, token: str | None) -> str | None:
        return refuse_placeholder(token, "transfer.token")

    @field_validator("advertise_host", "bind_host")
    @classmethod
    def _host(cls, value: str | None, info) -> str | None:
        if value is None:
            return None
        return check_host(value, f"transfer.{info.field_name}", wildcard_ok=info.field_name == "bind_host")


THRESHOLD_FIELDS = ("max_local_prefill_length", "max_remote_prefill_cache_hit_ratio")


class RouterOptions(_Strict):
    """`placement: slo` (the default) places each prefill by the workers' measured costs against `slo`;
    `placement: thresholds` by Dynamo's fixed token rules below. A config that sets a threshold and no
    `placement` means the thresholds. `max_prefill_queue_size` bounds the prefill queue either way."""
    placement: Literal["slo", "thresholds"] = "slo"
    max_local_prefill_length: int = Field(2048, ge=0)
    max_remote_prefill_cache_hit_ratio: float = Field(0.7, ge=0, le=1)
    max_prefill_queue_size: int = Field(2, ge=1)
    max_queued_requests: int = Field(256, ge=1)
    migration_limit: int = Field(3, ge=0)  # moves of one request after its decode worker died mid-stream
    # How long a request (arriving, or migrating mid-stream) waits for a decode worker while none is
    # schedulable but the pool can heal: Ray restarting a crashed worker, the controller replacing a dead one.
    decode_wait_s: float = Field(60.0, ge=0)
    routing: Literal["prefix_aware", "round_robin"] = "prefix_aware"  # round_robin: a baseline to compare with

    @model_validator(mode="after")
    def _thresholds_set_means_thresholds(self) -> RouterOptions:
        if "placement" not in self.model_fields_set and self.model_fields_set & set(THRESHOLD_FIELDS):
            self.placement = "thresholds"
        return self


class TracingOptions(_Strict):
    """Request traces. `otlp_endpoint`: an OTLP/HTTP collector's base URL (spans go to <url>/v1/traces);
    unset (and no OTEL_EXPORTER_OTLP_ENDPOINT), no span is made or sent. `recent_requests`: how many
    finished requests' stage timelines each ingress replica keeps for `tandem trace` (0: none)."""
    otlp_endpoint: str | None = Field(None, pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)
    service_name: str = Field("tandem", min_length=1, max_length=128)
    recent_requests: int = Field(1000, ge=0, le=1_000_000)


class SloConfig(_Strict):
    """Latency targets of the placement policy and of stall-free local prefill: time to first token,
    and inter-token latency (a decode worker's step time while prompts join its batch). `stall_ratio`
    bounds that step relative to the worker's plain decode step as well, so a local prefill never
    makes the running streams' ITL tail more than that many times their median, however loose itl_ms."""
    ttft_ms: float = Field(2000.0, gt=0)
    itl_ms: float = Field(250.0, gt=0)
    stall_ratio: float = Field(2.0, ge=1)


class PrefillScaling(_Strict):
    """Per prefill worker: prompt tokens accepted but not yet computed; TTFT quantile over the window."""
    queued_tokens_up: float = Field(4096, gt=0)
    queued_tokens_down: float = Field(512, ge=0)
    ttft_up_s: float = Field(2.0, gt=0)
    ttft_down_s: float = Field(0.5, ge=0)


class DecodeScaling(_Strict):
    """Per decode worker: KV cache usage and running sequences (means over the pool); ITL quantile."""
    kv_usage_up: float = Field(0.85, gt=0, le=1)
    kv_usage_down: float = Field(0.4, ge=0, lt=1)
    running_up: float = Field(48, gt=0)
    running_down: float = Field(8, ge=0)
    itl_up_s: float = Field(0.15, gt=0)
    itl_down_s: float = Field(0.05, ge=0)


class AutoscalerConfig(_Strict):
    """`enabled` starts the autoscaler with the cluster. Thresholds come in up/down pairs (up must be above
    down); cooldowns are in seconds."""
    enabled: bool = False
    interval_s: float = Field(5.0, gt=0)
    upscale_cooldown_s: float = Field(30.0, ge=0)
    downscale_cooldown_s: float = Field(120.0, ge=0)
    latency_window_s: float = Field(60.0, gt=0)
    latency_quantile: float = Field(0.9, gt=0, le=1)
    prefill: PrefillScaling = Field(default_factory=PrefillScaling)
    decode: DecodeScaling = Field(default_factory=DecodeScaling)

    @model_validator(mode="after")
    def _up_above_down(self) -> AutoscalerConfig:
        for pool in ("prefill", "decode"):
            try:
                self.thresholds(pool)
            except ValueError as exc:
                raise ValueError(f"{pool}: {exc}") from None
        return self

    def thresholds(self, pool: str) -> dict[str, Thresholds]:
        if pool == "prefill":
            p = self.prefill
            return {"queued_prefill_tokens": Thresholds(p.queued_tokens_up, p.queued_tokens_down),
                    "ttft_s": Thresholds(p.ttft_up_s, p.ttft_down_s, per_worker=False)}
        d = self.decode
        return {"kv_usage": Thresholds(d.kv_usage_up, d.kv_usage_down),
                "num_running": Thresholds(d.running_up, d.running_down),
                "itl_s": Thresholds(d.itl_up_s, d.itl_down_s, per_worker=False)}


class AuditOptions(_Strict):
    """Audit records (router/api/audit.py): one JSON line per finished request to `sink`, "stdout" or
    "file:/absolute/path" (None: off). Prompts and outputs are SHA-256 digests unless `log_inputs`, which
    adds their text and token ids. `max_queue` bounds the records waiting for the writer thread; beyond it
    records are dropped and counted (tandem:audit_records_dropped)."""
    sink: str | None = None
    log_inputs: bool = False
    max_queue: int = Field(10000, ge=1, le=1_000_000)

    @field_validator("sink")
    @classmethod
    def _sink(cls, sink: str | None) -> str | None:
        return check_sink(sink)


class TenantOptions(_Strict):
    """One tenant's share of the ingress under saturation and its quotas (router/api/flow_control.py);
    null: no limit. `max_priority`: the most urgent priority (the smallest number) its requests may ask for.
    `max_concurrent` and `tokens_per_minute` are the cluster's, whatever the ingress replicas; `max_queued` is
    per replica."""
    weight: float = Field(1.0, gt=0, le=1e6)
    max_concurrent: int | None = Field(None, ge=1)
    max_queued: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)

    def policy(self) -> TenantPolicy:
        return TenantPolicy(self.weight, self.max_concurrent, self.max_queued, self.tokens_per_minute,
                            self.max_priority)


class FlowOptions(_Strict):
    """The ingress queue (router/api/flow_control.py). Requests queue there while the router is saturated
    (requests wait for a prefill slot, or every worker already has prompts queued) or `max_in_flight` requests
    are placed (per ingress replica; null: no cap), and leave it by priority (aging one band per `aging_s`),
    then by tenant weight on predicted tokens (start-time fair queueing). `default_tenant` applies to requests
    without a key and to tenants `tenants:` does not name."""
    max_in_flight: int | None = Field(None, ge=1)
    aging_s: float = Field(10.0, gt=0, le=86400)
    default_tenant: TenantOptions = Field(default_factory=TenantOptions)
    # SLO-aware shedding: 503 + Retry-After for a request whose predicted first token comes after its
    # deadline (X-Tandem-Deadline-Ms, else slo.ttft_ms); "low_priority": only requests of priority > 0.
    shed: Literal["off", "on", "low_priority"] = "off"
    # The share of the requests shedding admits that it means to be in time: a prediction is scaled by this
    # quantile of the admitted requests' measured first token over its prediction; null: taken as is.
    shed_quantile: float | None = Field(0.9, ge=0.5, lt=1)
    # On the workers, a prompt less urgent than one queued there within `yield_window_s` (another tenant's that
    # went ahead, or a lower priority) is computed in chunks of about `yield_slice_ms`, so that the urgent
    # prompt waits for one chunk, not a whole prompt (engine/scheduler.py, "Yielding"); null: never.
    yield_slice_ms: float | None = Field(250.0, gt=0, le=60_000)
    yield_window_s: float = Field(30.0, gt=0, le=86400)

    @field_validator("shed", mode="before")
    @classmethod
    def _yaml_switch(cls, value):
        """YAML 1.1 reads a bare `on` / `off` as a boolean: take it as the word the operator wrote."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CpuOptions(_Strict):
    """On CPU, `pin` gives each worker int(num_cpus) physical cores of its own (threads: one per core
    unless the pool's num_threads says otherwise); `borrow` lets a prefill forward also use the cores of
    a decode worker on its node while that one is idle, and `decode_borrows` (off by default) a decode step
    the cores of a prefill worker while that one has no prompt: on a machine without a core to spare for the
    serving processes, their wakeups then stall a decode step on two cores, and it ran slower than on one
    (bench/HISTORY.md, "Decode steps on borrowed prefill cores"). A forward on borrowed cores carries at most the prompt
    tokens that take `borrow_slice_ms` at the borrowed speed (default: the ITL SLO; 0: no cap), since a
    lender that turns busy shares its core until that forward ends. `isolate_prefill` (with `pin`; off by
    default) moves a local `tandem serve`'s own Ray and Serve processes off the prefill workers' cores once
    it serves: on the 2-core box their wakeups took a fifth of a served prefill's time, and at 0.5 req/s
    isolation cut TTFT by a fifth, but near saturation the decode core cannot spare their CPU and request
    throughput fell by a tenth (bench/HISTORY.md, "Serving processes off the prefill core").
    `lend_busy_ms` (with `borrow`): while a prefill worker on its node computes a prompt, a busy decode worker
    lends its cores between its steps too, starting a step at most every `lend_busy_ms` (0: decode lends
    only while idle); the prefill forward takes and gives back the lent cores between its decoder layers.
    Ignored by workers on GPUs."""
    pin: bool = True
    borrow: bool = True
    decode_borrows: bool = False
    isolate_prefill: bool = False
    borrow_slice_ms: float | None = Field(None, ge=0)
    lend_busy_ms: float = Field(100.0, ge=0, le=10_000)

    def binding(self, role: str, pool: PoolConfig) -> CpuBinding | None:
        cores = int(pool.num_cpus)
        if not self.pin or cores < 1:  # a fractional worker shares cores by design
            return None
        if pool.tensor_parallel_size > 1:  # its ranks split its cores (engine/parallel/ranks.py): none to lend
            return CpuBinding(cores)
        both_ways = self.borrow and self.decode_borrows
        if role == "prefill":
            return CpuBinding(cores, lend=both_ways, borrow=self.borrow)
        return CpuBinding(cores, lend=self.borrow, borrow=both_ways, top=True,
                          lend_busy_ms=self.lend_busy_ms if self.borrow else 0.0)


class ModelEntry(_Strict):
    """One model of a cluster serving several (`models:`): its own prefill and decode pools, engine, adapters and
    autoscaling. Fields it leaves out are the top level's. `key` names its workers (cluster `<name>--<key>`)."""
    key: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,15}$")
    model: str | None = None
    served_model_name: str | list[str] | None = None
    chat_template: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    kv_tiers: KVTiersOptions = Field(default_factory=KVTiersOptions)
    lora: LoRAOptions = Field(default_factory=LoRAOptions)
    speculative_config: SpeculativeOptions | None = None
    reasoning: ReasoningOptions | None = None
    autoscaler: AutoscalerConfig = Field(default_factory=AutoscalerConfig)


class ClusterConfig(_Strict):
    """Everything `tandem serve` needs; every field has a working default for a laptop."""
    model: str | None = None
    # Names requests may give as `model`; responses carry the first (vLLM's --served-model-name).
    served_model_name: str | list[str] | None = None
    # A Jinja chat template (a file's path, or the template itself) instead of the tokenizer's own;
    # a file is read when the config is validated, so the ingress gets the text wherever it runs.
    chat_template: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    seed: int = 0
    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    kv_tiers: KVTiersOptions = Field(default_factory=KVTiersOptions)  # below each worker's cache; off by default
    lora: LoRAOptions = Field(default_factory=LoRAOptions)  # adapters on the base model; off by default
    # Several models in one cluster, each with its own pools (ModelEntry); empty: the one model above. The
    # fields above are then every model's defaults, and requests go to the model their `model` names.
    models: list[ModelEntry] = Field(default_factory=list, max_length=16)
    speculative_config: SpeculativeOptions | None = None  # the decode pool's default; None: requests opt in
    transfer: TransferOptions = Field(default_factory=TransferOptions)
    router: RouterOptions = Field(default_factory=RouterOptions)
    slo: SloConfig = Field(default_factory=SloConfig)
    autoscaler: AutoscalerConfig = Field(default_factory=AutoscalerConfig)
    cpu: CpuOptions = Field(default_factory=CpuOptions)
    audit: AuditOptions = Field(default_factory=AuditOptions)
    flow: FlowOptions = Field(default_factory=FlowOptions)
    tenants: dict[str, TenantOptions] = Field(default_factory=dict, description="tenant -> share and quotas")
    ingress_replicas: int = Field(1, ge=1, le=64)  # Serve replicas of the HTTP ingress
    limits: RequestLimits = Field(default_factory=RequestLimits)  # what one request may ask of the ingress
    tracing: TracingOptions = Field(default_factory=TracingOptions)
    # The model thinks between these markers: max_reasoning_tokens / reasoning_effort cap it, and the
    # thinking comes back as reasoning_content. None: the model does not think between markers.
    reasoning: ReasoningOptions | None = None
    tool_call_parser: str | None = "hermes"  # how tool_choice auto reads calls; None refuses auto
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant")
    admin_key: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    namespace: str = "tandem"
    name: str = Field("tandem", pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")

    @field_validator("api_keys")
    @classmethod
    def _keys_not_empty(cls, keys: dict[str, str]) -> dict[str, str]:
        if any(not k or not t for k, t in keys.items()):
            raise ValueError("API keys and tenant names must be non-empty")
        for key in keys:
            refuse_placeholder(key, "api_keys")
        return keys

    def has_quotas(self) -> bool:
        """Whether any tenant (or the default one) has a quota several ingress replicas must count together."""
        return any(t.tokens_per_minute is not None or t.max_concurrent is not None
                   for t in [*self.tenants.values(), self.flow.default_tenant])

    def flow_config(self) -> FlowConfig:
        f = self.flow
        return FlowConfig(f.max_in_flight, f.aging_s,
                          {name: t.policy() for name, t in self.tenants.items()}, f.default_tenant.policy(),
                          f.shed, self.slo.ttft_ms / 1000, f.shed_quantile)

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, names: str | list[str] | None) -> str | list[str] | None:
        listed = [names] if isinstance(names, str) else names or []
        if names is not None and (not listed or not all(n.strip() for n in listed) or len(set(listed)) < len(listed)):
            raise ValueError("served model names must be non-empty and distinct")
        return names

    @model_validator(mode="after")
    def _models_apart(self) -> ClusterConfig:
        if not self.models:
            return self
        keys = [m.key for m in self.models]
        if len(set(keys)) < len(keys):
            raise ValueError("models: every model needs a key of its own")
        if len(self.name) + 2 + max(map(len, keys)) > 41:
            raise ValueError(f"models: name {self.name!r} plus `--<key>` must fit 41 characters (the clusters of "
                             f"the models are named so); shorten the name or the keys")
        served: dict[str, str] = {}
        for sub in self.model_configs():
            for name in [*sub.model_names, *sub.lora.modules]:
                if name in served:
                    raise ValueError(f"models: {name!r} names both {served[name]} and {sub.name}; every model "
                                     f"and adapter name must be distinct")
                served[name] = sub.name
        return self

    def model_configs(self) -> list[ClusterConfig]:
        """One config per model: this one when it serves one model, else each entry of `models` over the top
        level's fields, as a cluster of its own named `<name>--<key>` (its controller, pools and autoscaler)."""
        if not self.models:
            return [self]
        base = self.model_dump(exclude={"models"}, exclude_unset=True)
        configs = []
        for entry in self.models:
            data = {**base, **entry.model_dump(exclude={"key"}, exclude_unset=True),
                    "name": f"{self.name}--{entry.key}"}
            configs.append(ClusterConfig.model_validate(data))
        return configs

    @model_validator(mode="after")
    def _adapters_fit(self) -> ClusterConfig:
        if taken := sorted(set(self.lora.modules) & set(self.model_names)):
            raise ValueError(f"lora.modules: {', '.join(taken)} is the base model's served name; name the adapter "
                             f"otherwise")
        if self.lora.enabled and (self.prefill.tensor_parallel_size > 1 or self.decode.tensor_parallel_size > 1):
            raise ValueError("lora: adapters with tensor_parallel_size > 1 are not supported yet")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template(cls, template: str | None) -> str | None:
        return None if template is None else load_chat_template(template)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
        return name

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_placeholder(cls, key: str | None) -> str | None:
        return refuse_placeholder(key, "admin_key")

    @property
    def model_names(self) -> list[str]:
        if self.served_model_name:
            return [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        return [self.model or "smollm2-135m-instruct"]

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def engine_config(self, pool: PoolConfig, role: str | None = None) -> EngineConfig:
        """The engine of a `role` ("prefill" or "decode") worker; with a role it is pinned as `cpu` says,
        and its threads follow the cores it gets unless the pool sets num_threads."""
        binding = self.cpu.binding(role, pool) if role else None
        threads = pool.num_threads or (None if binding else max(1, int(pool.num_cpus)))
        itl_slo_ms = self.slo.itl_ms if role == "decode" else None
        slice_ms = self.slo.itl_ms if self.cpu.borrow_slice_ms is None else self.cpu.borrow_slice_ms
        speculative = self.speculative_config.engine_config() if role == "decode" and self.speculative_config else None
        shared_cache = (role == "prefill" or self.transfer.peer_prefix_pulls) and self.transfer.backend == "grpc" \
            and self.transfer.shared_memory
        return EngineConfig(model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
                            tensor_parallel_size=pool.tensor_parallel_size,
                            num_threads=threads, cpu_binding=binding, itl_slo_ms=itl_slo_ms,
                            borrow_slice_ms=slice_ms if binding is not None and binding.borrow else None,
                            stall_ratio=self.slo.stall_ratio, speculative_config=speculative,
                            kv_cache_shared=shared_cache, kv_tiers=self.kv_tiers.engine_config(),
                            reasoning_markers=(self.reasoning.start, self.reasoning.end) if self.reasoning else None,
                            enable_lora=self.lora.enabled, max_loras=self.lora.max_loras,
                            max_lora_rank=self.lora.max_lora_rank, max_cpu_loras=self.lora.max_cpu_loras,
                            priority_aging_s=self.flow.aging_s, yield_slice_ms=self.flow.yield_slice_ms,
                            yield_window_s=self.flow.yield_window_s, **self.engine.model_dump())

    def transfer_config(self) -> TransferConfig:
        token = self.transfer.token or os.environ.get("TANDEM_KV_TOKEN", "")
        return TransferConfig(backend=self.transfer.backend, token=token, lease_ttl_s=self.transfer.lease_ttl_s,
                              timeout_s=self.transfer.timeout_s, layerwise=self.transfer.layerwise,
                              shared_memory=self.transfer.shared_memory,
                              peer_prefix_pulls=self.transfer.peer_prefix_pulls, advertise_host=self.transfer.advertise_host,
                              bind_host=self.transfer.bind_host,
                              tls=self.transfer.tls.files() if self.transfer.tls else None)

    def with_env(self) -> ClusterConfig:
        """Fill keys from the environment: TANDEM_API_KEYS ("key:tenant,key2:tenant2") and TANDEM_ADMIN_KEY.
        Raises ConfigError for a published placeholder in them or in TANDEM_KV_TOKEN (which the controller
        reads), so a deployment that kept k8s/base/secrets.yaml fails where it starts."""
        update = {}
        if not self.api_keys and os.environ.get("TANDEM_API_KEYS"):
            update["api_keys"] = parse_api_keys(os.environ["TANDEM_API_KEYS"])
            for key in update["api_keys"]:
                refuse_placeholder(key, "TANDEM_API_KEYS")
        if not self.admin_key and os.environ.get("TANDEM_ADMIN_KEY"):
            update["admin_key"] = refuse_placeholder(os.environ["TANDEM_ADMIN_KEY"], "TANDEM_ADMIN_KEY")
        if not self.transfer.token:
            refuse_placeholder(os.environ.get("TANDEM_KV_TOKEN"), "TANDEM_KV_TOKEN")
        if not self.tracing.otlp_endpoint and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            try:
                update["tracing"] = TracingOptions(**{**self.tracing.model_dump(),
                                                      "otlp_endpoint": os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]})
            except ValidationError:
                raise ConfigError("OTEL_EXPORTER_OTLP_ENDPOINT must be an http(s) URL") from None
        return self.model_copy(update=update) if update else self


def parse_api_keys(text: str) -> dict[str, str]:
    """"key:tenant,key2:tenant2"; a bare key's tenant is named after its digest (`key_tenant`)."""
    keys = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, tenant = item.partition(":")
        keys[key] = tenant or key_tenant(key)
    return keys


def key_tenant(key: str) -> str:
    """The tenant of an API key given without one: named after a digest of the key, never the key itself,
    which would then show wherever a tenant does (logs, the cache salt in KV events and worker state)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """A config file or flag that cannot be used; the message says which field and why."""


# The form of every value k8s/base/secrets.yaml publishes: anyone who has read the repository knows them.
PLACEHOLDER = re.compile(r"placeholder-[a-z-]+-replace-me")
# Each secret setting and the environment variable a real value goes in.
SECRET_ENV = {"api_keys": "TANDEM_API_KEYS", "admin_key": "TANDEM_ADMIN_KEY", "transfer.token": "TANDEM_KV_TOKEN"}


def refuse_placeholder(value: str | None, setting: str) -> str | None:
    """`value`, unless it is a published placeholder: then a ConfigError naming `setting` (a config field or
    its environment variable) and where a real secret goes. A cluster started with one is open to anyone."""
    if not value or not PLACEHOLDER.fullmatch(value):
        return value
    env = SECRET_ENV.get(setting, setting)
    where = (f"{env}, or leave it unset and the controller makes a random one" if env == "TANDEM_KV_TOKEN"
             else f"{env} (on Kubernetes, the Secret it is read from: k8s/README.md shows how)")
    raise ConfigError(f"{setting} is the published placeholder {value!r} from k8s/base/secrets.yaml, which protects "
                      f"nothing; refusing to start. Set a real secret (for instance the output of "
                      f"`openssl rand -hex 32`) in {where}")


def load_chat_template(template: str) -> str:
    """A chat template from a file's path or given inline, checked to be valid Jinja."""
    path = Path(template)
    looks_inline = "{{" in template or "{%" in template
    if not looks_inline:
        try:
            template = path.read_text()
        except OSError as exc:
            raise ValueError(f"{template!r} is neither a readable file nor a Jinja template ({exc.strerror})") from None
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None
    return template


def load_config(path: str | Path | None = None, **overrides) -> ClusterConfig:
    """Read a YAML config (optional) and apply overrides; raises ConfigError with the bad field."""
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a YAML mapping")
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return ClusterConfig.model_validate(data).with_env()
    except ValidationError as exc:
        first = first_field_error(exc)
        raise ConfigError(f"invalid config field {first.path!r}: {first.message}") from None
