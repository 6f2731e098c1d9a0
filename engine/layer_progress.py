"""Reports, during a forward pass, how many of the model's decoder layers have written their KV.

Layer-wise KV transfer lets decode pull layer i of a request's blocks while the prefill forward still
computes layer i + 1. A forward hook on every HF decoder layer drives it: on CPU a layer's work is done
when its hook runs, so the layer is reported at once; on CUDA the hook only enqueues, so it records an
event on the current stream and a watcher thread reports the layer once the event has completed. The
main path never synchronizes the device.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# (request ids whose KV the forward writes, number of layers now final for them)
OnLayersReady = Callable[[list[str], int], None]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM, in execution order."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != model.config.num_hidden_layers:
        raise ValueError(f"cannot find the {model.config.num_hidden_layers} decoder layers of {type(model).__name__}")
    return layers


class LayerProgress:
    """Calls `on_ready(request_ids, n)` as layers [0, n) of the current forward finish writing KV.

    `watch(request_ids)` names the requests of the next forward (called once per step, before it runs);
    steps without watched requests cost one attribute check per layer."""

    def __init__(self, model: torch.nn.Module, device: torch.device, on_ready: OnLayersReady):
        self.on_ready = on_ready
        self.watched: list[str] = []
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        self._events: queue.SimpleQueue | None = None
        if device.type == "cuda":
            self._events = queue.SimpleQueue()
            threading.Thread(target=self._watch_events, name="kv-layer-events", daemon=True).start()
        self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def watch(self, request_ids: list[str]) -> None:
        self.watched = request_ids

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._events is not None:
            self._events.put(None)

    def _hook(self, index: int):
        def hook(module, args, output):
            ids = self.watched
            if not ids:
                return
            if index == self.num_layers - 1:
                self.watched = []  # the forward is done with them
            if self._events is None:
                self.on_ready(ids, index + 1)
            else:
                event = torch.cuda.Event()
                event.record()
                self._events.put((event, ids, index + 1))
        return hook

    def _watch_events(self) -> None:
        while (item := self._events.get()) is not None:
            event, ids, num_ready = item
            event.synchronize()
            try:
                self.on_ready(ids, num_ready)
            except Exception:  # a reporting failure must not stop the reports of later layers
                logger.exception("marking %d KV layers ready failed", num_ready)
