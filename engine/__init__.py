"""The shared model core: paged KV cache, packed-batch forward, scheduler, sampler, offline Engine.

The names below load on first use (PEP 562), so `from engine.config import ...` in the control plane (the
cluster controller, the metrics hub, config validation) does not load torch and the model code."""
import importlib

_EXPORTS = {"CompletionOutput": "engine.outputs", "Engine": "engine.engine", "EngineConfig": "engine.config",
            "EngineError": "engine.errors", "InvalidRequestError": "engine.errors",
            "RequestOutput": "engine.outputs", "SamplingParams": "engine.sampling_params"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
