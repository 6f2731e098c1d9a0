"""The sizes of the KV tiers below the device cache (engine/kv_tiers.py), light enough for the control plane."""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(slots=True)
class KVTiersConfig:
    """Sizes of the tiers below the device cache (`kv_tiers:` in the cluster config). `host_gb` 0: no tiers."""
    host_gb: float = 0.0
    disk_path: str | None = None
    disk_gb: float = 0.0
    # A Redis or Valkey server every worker shares as the tier below its own (engine/kv_remote.py); None: none.
    remote_url: str | None = None

    def __post_init__(self):
        for name in ("host_gb", "disk_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"kv_tiers.{name} must be a finite number of GiB >= 0, got {value!r}")
        if self.disk_gb and not self.disk_path:
            raise ValueError("kv_tiers.disk_gb needs kv_tiers.disk_path (the directory of the disk tier's file)")
        if self.disk_gb and not self.host_gb:
            raise ValueError("kv_tiers.disk_gb needs kv_tiers.host_gb: the disk tier sits below the host tier")
        if self.remote_url is not None:
            if not isinstance(self.remote_url, str) or not self.remote_url.startswith(REMOTE_SCHEMES):
                raise ValueError(f"kv_tiers.remote_url must be a {', '.join(REMOTE_SCHEMES)} URL, got {self.remote_url!r}")
            if not self.host_gb:
                raise ValueError("kv_tiers.remote_url needs kv_tiers.host_gb: blocks reach the store through the host tier")

    @property
    def enabled(self) -> bool:
        return self.host_gb > 0
