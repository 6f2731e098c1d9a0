"""The warm-up a worker runs before serving: forwards that measure its step costs from the first request on."""
from __future__ import annotations

import time

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step_costs import StepCosts, step_shape


def warm_up(runner: ModelRunner, block_manager: BlockManager, step_costs: StepCosts, max_model_len: int,
            num_prompt_tokens: int = 256, num_decode_steps: int = 4) -> None:
    """Measure decode steps of one sequence, then a prompt's prefill (each after an unmeasured first run that
    pays for one-time setup). The request never enters a scheduler, the prefix cache or the counters, and
    its blocks go back to the pool."""
    bm = block_manager
    n = min(num_prompt_tokens, max_model_len - num_decode_steps - 1,
            (bm.num_free_blocks - 1) * bm.block_size - num_decode_steps - 1)
    if n < 1:
        return
    ids = torch.randint(3, runner.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    req = Request("warm-up", ids, SamplingParams(temperature=0.0), num_decode_steps + 1)
    if not bm.allocate_slots(req, n + num_decode_steps + 1):
        return

    def forward(num_new: int, measure: bool) -> int:
        scheduled = [(req, num_new)]
        shape = step_shape(scheduled)
        started = time.perf_counter()
        logits = runner.execute(scheduled, [True])
        if measure:
            step_costs.observe(*shape, time.perf_counter() - started)
        return int(logits.argmax())

    try:
        req.all_token_ids.append(forward(n, measure=False))
        req.num_computed_tokens = n
        for i in range(num_decode_steps + 1):
            req.all_token_ids.append(forward(1, measure=i > 0))
            req.num_computed_tokens += 1
        req.num_computed_tokens = 0
        forward(n, measure=True)
    finally:
        bm.free(req)
