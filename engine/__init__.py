"""The shared model core: paged KV cache, packed-batch forward, scheduler, sampler, offline Engine.

The names below load on first use, so `from engine.config import ...` in the control plane (the cluster
controller, the metrics hub, config validation) does not load torch and the model code."""
from engine.lazy_exports import lazy_exports

_EXPORTS = {"CompletionOutput": "engine.outputs", "Engine": "engine.engine", "EngineConfig": "engine.config",
            "EngineError": "engine.errors", "InvalidRequestError": "engine.errors",
            "RequestOutput": "engine.outputs", "SamplingParams": "engine.sampling_params"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
