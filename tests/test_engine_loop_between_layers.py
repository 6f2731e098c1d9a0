"""Commands that need not wait for a step (a peer's prefix lease and a puller's reservation) run on the loop
thread before the running forward's next decoder layer; other commands still wait for the step's end, and the
step's outputs are unchanged."""
from __future__ import annotations

import threading

from engine import Engine, EngineConfig, SamplingParams
from engine.hashing import block_hashes
from engine.layer_progress import decoder_layers
from engine.request import RequestStatus
from tests.helpers import wait_for
from worker_runtime.engine_loop import EngineLoop

BLOCK = 16
PROMPT = list(range(5, 69))


def test_a_between_layers_command_runs_inside_the_forward_and_a_plain_one_after_it(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, dtype="float32", block_size=BLOCK))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = engine.generate([PROMPT], params)[0].token_ids
    prefix = list(range(100, 132))  # two blocks, cached by a request before the loop starts
    engine.generate([prefix + [7]], SamplingParams(temperature=0.0, max_tokens=1))
    chain = block_hashes(prefix, BLOCK)

    loop = EngineLoop(engine)
    assert loop.runs_between_layers
    layers = decoder_layers(engine.runner.model)
    forward = {"in": False, "layers": 0}
    seen: dict = {}

    def lease():  # what a peer's lease_prefix runs
        seen["lease"] = (forward["in"], forward["layers"], threading.current_thread() is loop.thread)
        return engine.block_manager.hold_prefix(chain, prefix)

    def plain():
        seen["plain"] = forward["in"]

    def first_layer(module, args):  # the forward has begun: a peer asks now (after the loop's own hook ran)
        forward["in"] = True
        if "held" not in seen:
            seen["held"] = loop.submit(lease, between_layers=True)
            loop.submit(plain)

    def layer_done(module, args, output):
        forward["layers"] += 1

    layers[0].register_forward_pre_hook(first_layer)
    for layer in layers:
        layer.register_forward_hook(layer_done)
    loop.on_step = lambda outputs: forward.update({"in": False, "layers": 0})

    req = engine.make_request("r", PROMPT, params)
    loop.submit(engine.add, req).result(timeout=30)
    assert wait_for(lambda: "held" in seen)
    held = seen["held"].result(timeout=30)
    assert seen["lease"] == (True, 1, True)  # inside the forward, after its first layer, on the loop thread
    assert len(held) == 2  # both cached blocks, leased
    assert wait_for(lambda: "plain" in seen) and seen["plain"] is False  # it waited for the step's end
    assert wait_for(lambda: req.status == RequestStatus.FINISHED)
    assert req.all_token_ids[len(PROMPT):] == expected  # the step's work is unchanged
    loop.submit(engine.block_manager.free_block_ids, held).result(timeout=30)
    loop.stop()


def test_a_stopped_loop_fails_between_layers_commands_too():
    class IdleEngine:
        def has_unfinished_requests(self) -> bool:
            return False

    loop = EngineLoop(IdleEngine())
    assert not loop.runs_between_layers  # no model: such commands run between steps
    assert loop.submit(lambda: "ran", between_layers=True).result(timeout=30) == "ran"
    loop.stop()
    failed = loop.submit(lambda: "never", between_layers=True)
    assert isinstance(failed.exception(timeout=30), RuntimeError)
