"""What the cluster controller hands out (to routers, the metrics hub and the CLI): membership, scaling events,
results and reports. Shared by router/ and cluster/, so neither reads the other's fields blind."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerEntry:
    """One ready worker as routers see it; `draining` ones take no new requests. The controller keeps each
    pool member as this entry extended by its own fields (cluster/pools.py `WorkerInfo`)."""
    worker_id: str
    pool: str
    actor: object
    healthy: bool = False
    draining: bool = False


@dataclass(slots=True)
class Membership:
    """The ready workers of both pools; `version` grows with every change that affects routing."""
    version: int
    workers: list[WorkerEntry] = field(default_factory=list)
    adapters: dict = field(default_factory=dict)  # LoRA adapters served, name -> engine.lora_request.LoRARequest


@dataclass(slots=True)
class ScalingEvent:
    """One scaling decision (worker_id empty) or worker change, with who asked and why."""
    time: float
    pool: str
    action: str  # "scale_up", "scale_down" (decisions); "add", "drain", "remove", "unhealthy", "recovered"
    worker_id: str
    reason: str = ""


@dataclass(slots=True)
class ScaleResult:
    """What one `scale` call did; it returns once added workers are registered and drained ones are gone."""
    pool: str
    replicas_before: int
    replicas: int
    added: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ScalingReport:
    """What /metrics exports about scaling: event counts since start, current and desired replicas."""
    events: dict[tuple[str, str], int]
    replicas: dict[str, int]
    desired: dict[str, int]
