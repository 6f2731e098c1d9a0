"""What the caller of `Engine.step` tells one step: the cores it runs on, and who watches what it schedules."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
