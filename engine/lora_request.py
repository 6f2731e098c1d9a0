"""Naming a LoRA adapter: what a request carries (LoRARequest) and how an adapter directory is identified,
light enough for the control plane (no torch); engine/lora.py serves adapters."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRAError(ValueError):
    """An adapter that cannot be served on this model: unreadable, or asking for what the engine lacks."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with: its served `name`, the PEFT directory it loads from, and `digest`, the
    sha256 of its files (adapter_digest), which identifies it in prefix hashes and across processes."""
    name: str
    path: str
    digest: str

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest[:32]}"

    @classmethod
    def from_dir(cls, name: str, path: str | Path) -> LoRARequest:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise LoRAError(f"adapter name {name!r} must be 1-128 characters of letters, digits and ._:/-")
        return cls(name, str(Path(path).resolve()), adapter_digest(path))


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """The adapter's config and weight file, or LoRAError naming what is missing."""
    path = Path(path)
    config = path / "adapter_config.json"
    if not config.is_file():
        raise LoRAError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
    for name in ADAPTER_FILES:
        if (path / name).is_file():
            return config, path / name
    raise LoRAError(f"{path} holds no adapter weights ({' or '.join(ADAPTER_FILES)})")


def adapter_digest(path: str | Path) -> str:
    """sha256 over the adapter's config and weights: a changed file is a different adapter."""
    digest = hashlib.sha256()
    for file in adapter_files(path):
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
