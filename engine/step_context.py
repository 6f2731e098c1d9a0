"""What the caller of `Engine.step` tells one step about the cores it runs on."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepContext:
    """Owned by whoever drives the steps (worker_runtime/engine_loop.py). `borrowing`: the step's forward runs
    on borrowed cores as well (it carries only what the borrowed speed computes within `borrow_slice_ms`);
    `borrow_cut`: it gave them back midway, so it is measured as neither speed. The engine only reads it."""
    borrowing: bool = False
    borrow_cut: bool = False


OWN_CORES = StepContext()  # a step on the engine's own cores only (the offline engine, tests)
