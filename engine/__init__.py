"""The shared model core: paged KV cache, packed-batch forward, scheduler, sampler, offline Engine."""
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError, InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "EngineError", "InvalidRequestError", "RequestOutput",
           "SamplingParams"]
