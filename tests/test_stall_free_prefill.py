"""Stall-free batching: beside running decodes a step carries only as many prompt tokens as its budget
allows, so a long prompt never stops the batch; outputs stay equal to HF's. And the engine measures
what its steps cost."""
import random

from engine import Engine, EngineConfig, SamplingParams
from engine.step_context import StepContext
from engine.step_costs import MIN_CHUNK_TOKENS, StepCosts, stall_free_budget, step_shape
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BUDGET = 24  # prompt tokens per step beside running decodes


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def recorded_steps(engine: Engine) -> list[tuple[int, int, int]]:
    """(decodes, prompt tokens, context) of every step the engine's scheduler hands out from now on."""
    steps, schedule = [], engine.scheduler.schedule

    def recording(token_cap=None, yield_cap=None):
        scheduled = schedule(token_cap, yield_cap)
        steps.append(step_shape(scheduled))
        return scheduled

    engine.scheduler.schedule = recording
    return steps


def test_a_long_prompt_joining_running_streams_never_makes_a_step_exceed_its_prefill_budget(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    starts = []  # where each budgeted chunk starts in its prompt
    engine.scheduler.prefill_budget = lambda num_decodes, start: (starts.append(start) or BUDGET) if num_decodes else 512
    steps = recorded_steps(engine)
    short_a, short_b, long = prompts(engine.runner.vocab_size, (5, 9, 300), seed=1)
    streams = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # outlive the long prompt
    engine.add_request("a", short_a, streams)
    engine.add_request("b", short_b, streams)
    outs = engine.step() + engine.step()  # both prompts done: two streams decoding
    engine.add_request("long", long, GREEDY)
    while engine.has_unfinished_requests():
        outs += engine.step()
    beside_decodes = [prefill for decodes, prefill, _ in steps if decodes]
    assert max(beside_decodes) == BUDGET  # the prompt went in budget-sized chunks beside the streams
    assert sum(1 for decodes, prefill, _ in steps if decodes and prefill) >= 300 // BUDGET
    assert starts == list(range(0, 300, BUDGET))  # asked once a step, at the long prompt's progress
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, p, n in [("a", short_a, 40), ("b", short_b, 40), ("long", long, GREEDY.max_tokens)]:
        assert tokens[rid] == hf_greedy(tiny_llama_dir, p, n), rid


def test_a_short_prompt_goes_before_a_long_prompts_next_chunk_beside_running_streams(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    engine.scheduler.prefill_budget = lambda num_decodes, start: BUDGET if num_decodes else 512
    steps = recorded_steps(engine)
    stream, long, short, too_long = prompts(engine.runner.vocab_size, (5, 300, BUDGET, BUDGET + 1), seed=2)
    engine.add_request("stream", stream, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    outs = engine.step()
    engine.add_request("long", long, GREEDY)
    outs += engine.step() + engine.step()  # two of the long prompt's chunks
    engine.add_request("short", short, GREEDY)
    assert engine.has_prompt_work()  # what a decode worker's loop asks before lending its cores
    first = {}
    while engine.has_unfinished_requests():
        assert engine.has_prompt_work() == any(r.num_tokens - r.num_computed_tokens > 1
                                               for r in (*engine.scheduler.running, *engine.scheduler.waiting))
        step_outs = engine.step()
        for out in step_outs:
            first.setdefault(out.request_id, len(steps))
        outs += step_outs
    # The short prompt took the next step's room whole; the long one went on after it.
    assert steps[3] == (1, BUDGET, steps[3][2]) and first["short"] == 4 and first["long"] > 6
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, p, n in [("stream", stream, 60), ("long", long, GREEDY.max_tokens), ("short", short, GREEDY.max_tokens)]:
        assert tokens[rid] == hf_greedy(tiny_llama_dir, p, n), rid
    # A prompt one token over the room waits for the long prompt, as before.
    engine.add_request("stream2", stream[::-1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.add_request("long2", long[::-1], GREEDY)
    engine.step()
    engine.add_request("too-long", too_long, GREEDY)
    engine.step()
    assert [req.request_id for req in engine.scheduler.waiting] == ["too-long"]


def test_a_prompt_waits_for_another_computing_its_prefix_instead_of_computing_it_beside_it(tiny_llama_dir):
    """A prefill worker's step admits every waiting prompt its budget holds: two arriving together with the
    same 64-token prefix both computed it. Now the second waits one step and finds it cached."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, block_size=16))
    prefix, a, b = prompts(engine.runner.vocab_size, (64, 10, 12), seed=3)
    engine.add_request("a", prefix + a, GREEDY)
    engine.add_request("b", prefix + b, GREEDY)
    outs = engine.step()
    assert [out.request_id for out in outs] == ["a"] and engine.scheduler.prefix_waits == 1
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, p in (("a", prefix + a), ("b", prefix + b)):
        assert tokens[rid] == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens), rid
    assert engine.block_manager.prefix_cache_hits >= 64


def test_a_short_prompt_waiting_for_a_long_prompts_prefix_does_not_hold_up_that_prompt(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    engine.scheduler.prefill_budget = lambda num_decodes, start: BUDGET if num_decodes else 512
    stream, long = prompts(engine.runner.vocab_size, (5, 160), seed=4)
    engine.add_request("stream", stream, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    engine.step()
    engine.add_request("long", long, GREEDY)
    engine.step()  # its first chunk
    # 32 tokens, the long prompt's first two blocks: the second is not computed yet, and its 16-token rest
    # would fit the step's room. Were the long prompt to yield the room to it, neither would ever go on.
    engine.add_request("short", long[:32], GREEDY)
    firsts, step = {}, 2
    while engine.has_unfinished_requests() and step < 40:
        step += 1
        for out in engine.step():
            firsts.setdefault(out.request_id, step)
    assert engine.scheduler.prefix_waits >= 1  # step 3: the short prompt waited for the long one's chunk
    assert firsts["short"] == 4  # then found its prefix cached and took step 4's room
    assert firsts["long"] == 1 + -(-160 // BUDGET) + 1  # chunks from step 2 on, in every step but that one


def test_a_decode_workers_budget_keeps_every_step_within_the_itl_slo_with_or_without_streams():
    costs = StepCosts({b: 500.0 for b in (64, 256, 1024)}, {1: 0.02, 8: 0.04, 32: 0.3})
    budget = stall_free_budget(costs, itl_slo_s=0.25, stall_ratio=2.0)
    assert budget(0, 0) == int((0.25 - 0.02) * 500)  # no streams: the ITL SLO alone (a joining one waits)
    assert budget(8, 0) == int((2 * 0.04 - 0.04) * 500)  # streams: two plain decode steps at most
    assert budget(32, 0) == MIN_CHUNK_TOKENS  # 32 streams already past the SLO: the smallest chunk, never none


def test_without_running_decodes_a_prompt_gets_the_whole_token_budget(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    engine.scheduler.prefill_budget = lambda num_decodes, start: BUDGET if num_decodes else 512
    engine.add_request("long", prompts(engine.runner.vocab_size, (300,))[0], GREEDY)
    assert step_shape(engine.scheduler.schedule()) == (0, 300, 300)


def test_a_mixed_batch_under_a_prefill_budget_matches_hf(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    engine.scheduler.prefill_budget = lambda num_decodes, start: 16 if num_decodes else 512
    batch = prompts(engine.runner.vocab_size, (1, 5, 16, 17, 33, 48, 70, 100), seed=2)
    outs = []
    for i, p in enumerate(batch):  # staggered, so later prompts join running streams
        engine.add_request(f"r{i}", p, GREEDY)
        outs += engine.step()
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, p in enumerate(batch):
        assert tokens[f"r{i}"] == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens), f"prompt of {len(p)} tokens"


def test_the_engine_measures_prefill_speed_and_decode_step_time_from_its_warm_up_and_its_steps(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    engine.warm_up(num_prompt_tokens=128)
    costs = engine.step_costs
    assert set(costs.prefill_tokens_per_s) == {128} and set(costs.decode_step_s) == {1}
    stats = engine.stats()
    assert stats["prompt_tokens"] == stats["generation_tokens"] == 0  # the warm-up is not traffic
    assert engine.block_manager.num_free_blocks == 64 and not engine.block_manager.take_events()
    engine.generate(prompts(engine.runner.vocab_size, (40, 50, 60)), GREEDY)
    assert {64, 128} <= set(costs.prefill_tokens_per_s) and {1, 4} <= set(costs.decode_step_s)
    assert stats["step_costs"] is not costs and stats["kv_bytes_per_token"] == engine.kv_cache.layout.bytes_per_token


def test_a_forward_on_borrowed_cores_carries_only_what_the_borrow_slice_computes(tiny_llama_dir):
    """A lender that turns busy shares its core until the borrowed forward ends: such forwards are cut to
    borrow_slice_ms at the borrowed speed; forwards on the worker's own cores are not, and the cap goes
    with the borrowing. Outputs stay HF's."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512,
                                 borrow_slice_ms=100))
    engine.step_costs.prefill_tokens_per_s = {b: 1000.0 for b in (16, 64, 256, 512)}  # 100 ms: ~100 tokens
    engine.step_costs.borrowed_prefill_tokens_per_s = {b: 1600.0 for b in (16, 64, 256, 512)}
    engine.step_costs.decode_step_s = {1: 0.02}  # a forward's fixed cost: 80 ms are left for prompt tokens
    steps = recorded_steps(engine)
    long = prompts(engine.runner.vocab_size, (300,), seed=3)[0]
    engine.add_request("long", long, GREEDY)
    outs = engine.step(StepContext(borrowing=True))  # (its own time then updates the measured speeds)
    assert [prefill for _, prefill, _ in steps] == [128]  # 0.08 s x 1600 tok/s
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert steps[1][1] == 300 - 128  # the rest in one forward on its own core
    assert [t for out in outs for t in out.new_token_ids] == hf_greedy(tiny_llama_dir, long, GREEDY.max_tokens)
    uncapped = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    uncapped_steps = recorded_steps(uncapped)
    uncapped.add_request("long", long, GREEDY)
    uncapped.step(StepContext(borrowing=True))
    assert uncapped_steps == [(0, 300, 300)]


def test_a_request_with_imported_kv_joins_while_a_prompt_waits_for_prefill_room(tiny_llama_dir):
    """Decode workers: a request whose prompt KV was pulled only decodes, so a prompt queued before it that
    this step has no prefill room for (a running prompt's chunk took it) must not hold it back."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    engine.scheduler.prefill_budget = lambda num_decodes, start: BUDGET if num_decodes else 512
    short, first, second, pulled = prompts(engine.runner.vocab_size, (5, 300, 200, 40), seed=2)
    engine.add_request("stream", short, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    engine.step()  # prefilled: decoding from now on
    engine.add_request("long-1", first, GREEDY)
    engine.add_request("long-2", second, GREEDY)
    engine.step()  # long-1's first chunk; long-2 waits for prefill room
    req = engine.make_request("imported", pulled, GREEDY)
    req.all_token_ids.append(7)  # its first token, sampled where the prompt was computed
    assert engine.reserve_for_import(req) is not None
    engine.add_imported(req)
    steps = recorded_steps(engine)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["stream", "long-1", "imported"]
    assert steps[-1][:2] == (2, BUDGET)  # two decodes (the stream and the imported request), one chunk
    assert [r.request_id for r in engine.scheduler.waiting] == ["long-2"]  # prompts keep their order
    while engine.has_unfinished_requests():
        engine.step()


def test_on_cpu_a_step_computes_one_long_prompt_and_short_prompts_share_one(tiny_llama_dir):
    """EngineConfig.prefill_batch_tokens on CPU (256 by default): two long prompts go one forward each, so the
    first one's first token does not wait for the second; short ones still share a forward; 0 lifts the limit."""
    vocab = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=8)).runner.vocab_size
    batch = prompts(vocab, (200, 180, 30, 20), seed=4)
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    assert engine.scheduler.prefill_batch_tokens == 256
    steps = recorded_steps(engine)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, GREEDY)
    first = engine.step()
    assert steps[0][:2] == (0, 200 + 30 + 20) and {o.request_id for o in first} == {"r0", "r2", "r3"}
    outs = first
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert steps[1][1] == 180
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(tokens[f"r{i}"] == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens) for i, p in enumerate(batch))
    unlimited = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, prefill_batch_tokens=0))
    unlimited_steps = recorded_steps(unlimited)
    for i, p in enumerate(batch):
        unlimited.add_request(f"r{i}", p, GREEDY)
    unlimited.step()
    assert [shape[:2] for shape in unlimited_steps] == [(0, 430)]


def test_a_prompt_less_urgent_than_a_recent_one_is_computed_in_yield_slices(tiny_llama_dir):
    """yield_slice_ms: once a more urgent prompt came lately, a less urgent one goes in chunks of about that long
    at the measured speed, and the next urgent prompt computes in the step after the current chunk; the
    outputs stay HF's."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=512,
                                 yield_slice_ms=100))
    engine.step_costs.prefill_tokens_per_s = {b: 1000.0 for b in (16, 64, 256, 512)}
    engine.step_costs.decode_step_s = {1: 0.02}  # 80 ms left for prompt tokens: 80 at 1,000 tok/s
    steps = recorded_steps(engine)
    vocab = engine.runner.vocab_size
    quiet, flood, quiet2 = prompts(vocab, (20, 300, 40), seed=5)
    urgent = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("quiet", quiet, urgent, priority=-1)
    outs = engine.step()
    engine.add_request("flood", flood, GREEDY)
    engine.step_costs.prefill_tokens_per_s = {b: 1000.0 for b in (16, 64, 256, 512)}  # (the steps update it)
    outs += engine.step()
    assert steps[-1][1] == 80
    engine.add_request("quiet2", quiet2, urgent, priority=-1)
    outs += engine.step()
    assert steps[-1] == (0, 40, 40)  # after one slice of the flood's prompt, not all of it
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens["flood"] == hf_greedy(tiny_llama_dir, flood, GREEDY.max_tokens)
    assert tokens["quiet2"] == hf_greedy(tiny_llama_dir, quiet2, 1)


def test_the_queued_prompt_tokens_a_worker_reports_leave_out_the_prefix_hits_waiting_prompts_will_find(tiny_llama_dir):
    """The router predicts a worker's queue from them: hits on a cached prefix count their uncached suffix, a
    cold prompt all of itself."""
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    prefix, = prompts(engine.runner.vocab_size, (96,), seed=3)
    engine.generate([prefix + [5, 6, 7, 8]], GREEDY)
    cold, tail = prompts(engine.runner.vocab_size, (50, 20), seed=4)
    engine.add_request("hit", prefix + tail, GREEDY)
    engine.add_request("cold", cold, GREEDY)
    queries = engine.block_manager.prefix_cache_queries
    assert engine.stats()["queued_prefill_tokens"] == 20 + 50
    assert engine.block_manager.prefix_cache_queries == queries  # a look, not a lookup the hit rate counts
