"""One engine step's records: what its caller tells it (StepContext: the cores it runs on, who watches what
it schedules) and what its forward produced (StepBatch), handed from run to sample to postprocess."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.request import Request


@dataclass(slots=True)
class StepContext:
    """Owned by whoever drives the steps (worker_runtime/engine_loop.py). `borrowing`: the step's forward runs
    on borrowed cores as well (it carries only what the borrowed speed computes within `borrow_slice_ms`);
    `borrow_cut`: it gave them back midway, so it is measured as neither speed. `on_scheduled`: called on
    the step's thread with what it scheduled ((request, new tokens) pairs) before its forward runs (a prefill
    worker leases a layer-wise prompt's blocks as its last chunk starts). The engine only reads it."""
    borrowing: bool = False
    borrow_cut: bool = False
    on_scheduled: Callable[[list[tuple[Request, int]]], None] | None = None


OWN_CORES = StepContext()  # a step on the engine's own cores only (the offline engine, tests)


@dataclass(slots=True)
class StepBatch:
    """One step's forward: what ran, the requests whose rows were sampled, and what the step counts as."""
    scheduled: list[tuple[Request, int]]
    sampled: list[Request]
    logits: torch.Tensor
    num_logits: list[int] | None  # per row, when a row verifies a draft
    shape: tuple[int, int, int]  # step_shape, before the requests advance
    prefilling: list[Request]  # the requests whose prompt this forward computed (part of)
    started: float
