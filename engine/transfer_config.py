"""How workers move KV between pools (shared by prefill and decode workers and the cluster config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(slots=True)
class TransferConfig:
    """`backend` grpc works on any network; torch_dist uses NCCL on GPUs and Gloo on CPUs.

    `layerwise`: the prefill worker leases a request's blocks when its last prompt chunk is scheduled and
    marks layers ready as the forward passes them, so decode pulls while prefill still runs."""
    backend: Literal["grpc", "torch_dist"] = "grpc"
    token: str = ""
    host: str = "127.0.0.1"
    lease_ttl_s: float = 30.0
    timeout_s: float = 30.0
    max_workers: int = 8
    layerwise: bool = False
