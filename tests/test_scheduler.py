"""Scheduler: continuous batching under a token budget, with chunked prefill, prefix-cache hits and preemption
by recompute, on a real BlockManager. `step` plays the engine's part after each schedule: the scheduled
tokens get their KV, and a request whose every token is computed samples one more."""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BLOCK = 4
SAMPLED = 0  # the token every step "samples"


def scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
              prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return Scheduler(config, BlockManager(num_blocks, BLOCK, prefix_caching))


def request(request_id: str, num_prompt_tokens: int, first_token: int = 1, cache_salt: str | None = None) -> Request:
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(temperature=0.0), max_tokens=64, cache_salt=cache_salt)


def step(sched: Scheduler, token_cap: int | None = None,
         yield_cap: tuple[float, int] | None = None) -> list[tuple[str, int]]:
    scheduled = sched.schedule(token_cap, yield_cap)
    for req, n in scheduled:
        req.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(SAMPLED)
    return [(req.request_id, n) for req, n in scheduled]


def test_a_prompt_within_the_budget_runs_whole_then_decodes_a_token_a_step():
    sched = scheduler()
    sched.add(request("a", 10))
    assert step(sched) == [("a", 10)]
    assert step(sched) == [("a", 1)]
    assert step(sched) == [("a", 1)]


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks():
    sched = scheduler(max_num_batched_tokens=8)
    a = request("a", 20)
    sched.add(a)
    assert [step(sched) for _ in range(4)] == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)]]
    assert a.num_output_tokens == 2  # sampled only once its whole prompt was computed


def test_running_requests_get_their_tokens_before_waiting_prompts_are_admitted():
    sched = scheduler(max_num_batched_tokens=8)
    sched.add(request("a", 5))
    sched.add(request("b", 5, first_token=100))
    assert step(sched) == [("a", 5), ("b", 3)]  # b's first chunk takes what the budget has left
    sched.add(request("c", 6, first_token=200))
    assert step(sched) == [("a", 1), ("b", 2), ("c", 5)]


def test_max_num_seqs_caps_the_running_requests():
    sched = scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(request(f"r{i}", 4, first_token=10 * i + 1))
    assert step(sched) == [("r0", 4), ("r1", 4)]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    sched.finish(sched.running[0])
    assert step(sched) == [("r1", 1), ("r2", 4)]


def test_a_cached_prefix_is_not_computed_again():
    sched = scheduler()
    first = request("first", 12)
    sched.add(first)
    step(sched)
    sched.finish(first)  # its full blocks stay in the prefix cache
    again = request("again", 12)
    sched.add(again)
    # Two of its three full blocks come from the cache: the last block is left to compute, so that the step
    # has a token to sample from.
    assert step(sched) == [("again", 4)]
    assert again.num_cached_tokens == 8


def test_a_prompt_waiting_for_free_blocks_is_counted_in_the_prefix_cache_queries_once_when_admitted():
    """vllm:prefix_cache_queries counts prompt tokens looked up: a prompt that waits several steps for blocks is
    looked up at each, but counted once, when admitted (it counted at every step, several times its length)."""
    sched = scheduler(num_blocks=8)
    first = request("first", 12)
    sched.add(first)
    step(sched)
    second = request("second", 20, first_token=100)  # 5 blocks: waits until the first frees its 4
    sched.add(second)
    for _ in range(3):
        assert step(sched) == [("first", 1)]
    assert sched.block_manager.prefix_cache_queries == 12
    sched.finish(first)
    assert step(sched) == [("second", 20)]
    assert sched.block_manager.prefix_cache_queries == 12 + 20


def test_a_prefix_cached_under_another_cache_salt_is_not_reused():
    sched = scheduler()
    first = request("first", 12, cache_salt="tenant-a")
    sched.add(first)
    step(sched)
    sched.finish(first)
    other = request("other", 12, cache_salt="tenant-b")
    sched.add(other)
    assert step(sched) == [("other", 12)]
    assert other.num_cached_tokens == 0


def test_without_prefix_caching_every_prompt_is_computed_whole():
    sched = scheduler(prefix_caching=False)
    first = request("first", 12)
    sched.add(first)
    step(sched)
    sched.finish(first)
    sched.add(request("again", 12))
    assert step(sched) == [("again", 12)]


def test_a_request_short_of_a_block_preempts_the_latest_admitted_one():
    sched = scheduler(num_blocks=6, prefix_caching=False)
    a, b, c = request("a", 7), request("b", 7, first_token=100), request("c", 7, first_token=200)
    for req in (a, b, c):
        sched.add(req)
    assert step(sched) == [("a", 7), ("b", 7), ("c", 7)]  # 2 blocks each: the pool is full
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1)]  # the 8th token still fits their second block
    # The 9th needs a third block: c, admitted last, gives up its two for a and b.
    assert step(sched) == [("a", 1), ("b", 1)]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, sched.num_preemptions) == (0, 0, 1, 1)
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table


def full_pool() -> tuple[Scheduler, Request, Request]:
    """Two running requests of 8 tokens filling a pool of four blocks: the next step needs a fifth."""
    sched = scheduler(num_blocks=4, prefix_caching=False)
    a, b = request("a", 7), request("b", 7, first_token=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    return sched, a, b


def test_a_preempted_request_is_recomputed_with_the_tokens_it_generated():
    sched, a, b = full_pool()
    assert step(sched) == [("a", 1)]  # b preempted for a's third block
    assert b.num_tokens == 9
    sched.finish(a)
    assert step(sched) == [("b", 9)]  # its prompt and its two sampled tokens, in one forward
    assert b.num_output_tokens == 3


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched, _, _ = full_pool()
    sched.add(request("small", 1, first_token=200))  # would fit the block a leaves free after this step
    assert step(sched) == [("a", 1)]
    assert [r.request_id for r in sched.waiting] == ["b", "small"]


def test_a_prefill_budget_caps_prompt_tokens_beside_decodes_by_where_the_chunk_starts():
    sched = scheduler()
    calls = []
    sched.prefill_budget = lambda num_decodes, start: calls.append((num_decodes, start)) or 5
    sched.add(request("a", 3))
    step(sched)  # a now decodes
    sched.add(request("b", 12, first_token=100))
    assert step(sched) == [("a", 1), ("b", 5)]
    assert step(sched) == [("a", 1), ("b", 5)]
    assert calls[-2:] == [(1, 0), (1, 5)]


def test_a_token_cap_shrinks_only_the_step_it_is_given_to():
    sched = scheduler()
    sched.add(request("a", 20))
    assert step(sched, token_cap=6) == [("a", 6)]
    assert step(sched) == [("a", 14)]


def test_an_imported_request_decodes_while_a_prompt_waits_for_prefill_room():
    sched = scheduler()
    sched.prefill_budget = lambda num_decodes, start: 4
    sched.add(request("long", 12))
    step(sched)  # its first chunk: the next one takes the step's prefill room again
    sched.add(request("prompt", 6, first_token=100))
    imported = request("imported", 6, first_token=200)
    assert sched.block_manager.reserve_for_import(imported) is not None
    imported.num_computed_tokens = imported.num_prompt_tokens  # its prompt KV was pulled
    imported.all_token_ids.append(SAMPLED)  # and its first token sampled by the prefill worker
    sched.add(imported)
    assert step(sched) == [("long", 4), ("imported", 1)]
    assert [r.request_id for r in sched.waiting] == ["prompt"]


def test_forked_requests_join_the_next_step_before_waiting_ones():
    sched = scheduler()
    parent = request("parent", 4)
    sched.add(parent)
    step(sched)
    sched.add(request("waiting", 4, first_token=100))
    child = request("child", 4)
    child.take_state(parent)
    sched.block_manager.fork(parent, child)
    sched.add_forked([child])
    assert [r.request_id for r in sched.waiting] == ["child", "waiting"]
    assert step(sched) == [("parent", 1), ("child", 1), ("waiting", 4)]


def test_finish_frees_the_blocks_unless_they_are_handed_to_the_caller():
    sched = scheduler(num_blocks=8)
    kept, freed = request("kept", 8), request("freed", 8, first_token=100)
    sched.add(kept)
    sched.add(freed)
    step(sched)
    sched.finish(freed)
    sched.finish(kept, free_blocks=False)  # a prefill worker leasing them to decode
    assert not sched.has_unfinished()
    assert kept.finished and freed.finished and not freed.block_table
    assert sched.block_manager.num_free_blocks == 8 - len(kept.block_table)


def test_a_draft_is_verified_as_one_plus_k_tokens_cut_to_the_budget():
    sched = scheduler(max_num_batched_tokens=3)
    a = request("a", 3)
    sched.add(a)
    step(sched)
    a.spec_token_ids = [5, 6, 7]
    assert sched.schedule() == [(a, 3)]  # the decode token and two of the three drafts
    assert a.spec_token_ids == [5, 6]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = scheduler(max_num_seqs=1)
    reqs = {name: request(name, 3, first_token=10 * i) for i, name in enumerate(("late", "urgent", "later", "bg"))}
    for name, priority in (("late", 0), ("urgent", -1), ("later", 0), ("bg", 5)):
        reqs[name].priority = priority
        sched.add(reqs[name])
    assert [r.request_id for r in sched.waiting] == ["urgent", "late", "later", "bg"]


def test_the_least_urgent_running_request_is_preempted_and_resumes_first_in_its_band():
    sched = scheduler(num_blocks=6, prefix_caching=False)
    a, b, c = request("a", 7), request("b", 7, first_token=100), request("c", 7, first_token=200)
    b.priority = 3  # admitted before c, but less urgent
    for req in (a, b, c):
        sched.add(req)
    assert [r.request_id for r in sched.waiting] == ["a", "c", "b"]
    step(sched)
    step(sched)
    assert step(sched) == [("a", 1), ("c", 1)]  # b, not c (the latest admitted), gives up its blocks
    assert [r.request_id for r in sched.waiting] == ["b"]
    late = request("d", 3, first_token=300)
    late.priority = 3
    sched.add(late)
    assert [r.request_id for r in sched.waiting] == ["b", "d"]  # the preempted one resumes first in its band


def test_a_step_that_computes_an_urgent_prompt_leaves_less_urgent_prompts_for_the_next():
    """A prompt batched beside the urgent one would only delay its first token (on CPU a bigger prefill step is
    no faster per token); requests whose KV was imported still decode in that step."""
    sched = scheduler()
    urgent, bulk, other = request("urgent", 40), request("bulk", 40, first_token=100), request("other", 40, 200)
    urgent.priority = -0.5  # ahead of its band (GenerateRequest.queue_priority)
    for r in (bulk, urgent, other):
        sched.add(r)
    assert step(sched) == [("urgent", 40)]
    assert sorted(step(sched)) == [("bulk", 40), ("other", 40), ("urgent", 1)]


def test_prompts_of_one_band_still_share_a_step():
    sched = scheduler()
    for i in range(3):
        sched.add(request(f"r{i}", 40, first_token=100 * i))
    assert [n for _, n in step(sched)] == [40, 40, 40]


def bulk_running(sched: Scheduler, first_token: int = 100) -> None:
    """A 48-token prompt `bulk` admitted and one 16-token chunk into it."""
    sched.add(request("bulk", 48, first_token=first_token))
    assert step(sched) == [("bulk", 16)]


def test_a_running_prompts_chunks_wait_while_a_more_urgent_prompt_computes_and_never_for_one_that_cannot():
    sched = scheduler(max_num_batched_tokens=16)
    bulk_running(sched)
    urgent = request("urgent", 32)
    urgent.priority = -0.5
    sched.add(urgent)
    assert step(sched) == [("urgent", 16)]  # bulk's next chunk waits
    assert step(sched) == [("urgent", 16)]
    assert ("bulk", 16) in step(sched)  # urgent only decodes now: bulk's chunks go on
    # A prompt that cannot be admitted (4 blocks free, 5 needed) does not stop the running one.
    tight = scheduler(num_blocks=8, max_num_batched_tokens=16)
    bulk_running(tight)
    big = request("big", 70)
    big.priority = -1
    tight.add(big)
    assert step(tight) == [("bulk", 16)]


def test_an_urgent_prompt_that_waits_for_its_prefix_lets_the_prompt_computing_it_go_on():
    """Otherwise neither would move: the urgent one waits for the prefix, the one computing it for the urgent."""
    sched = scheduler(max_num_batched_tokens=16)
    bulk_running(sched, first_token=1)
    urgent = request("urgent", 40)  # the same first tokens: its second block is the one bulk computes next
    urgent.priority = -1
    sched.add(urgent)
    assert step(sched) == [("bulk", 16)]


def test_a_waiting_request_ages_one_band_per_aging_s_so_a_stream_of_urgent_ones_delays_it_a_bounded_time():
    """max_num_seqs=1 and a new urgent request every step: without aging, `bg` (priority 2) would wait for ever.
    It moves up one band per aging_s of waiting and is admitted once it is as urgent as they (at 2 x aging_s),
    ahead of the urgent ones that came after it; it keeps that priority while running."""
    sched = Scheduler(EngineConfig(max_num_seqs=1, priority_aging_s=10.0), BlockManager(64, BLOCK, True))
    now = [0.0]
    sched.clock = lambda: now[0]
    bg = request("bg", 3, first_token=500)
    bg.priority = 2
    sched.add(bg)
    admitted = []
    for i in range(30):  # one step a second
        urgent = request(f"u{i}", 3, first_token=10 * i)
        sched.add(urgent)
        sched.schedule()
        admitted += [r.request_id for r in sched.running]
        sched.running.clear()  # each finishes within its step: the seat is free again
        now[0] += 1.0
    assert "bg" in admitted
    start = admitted.index("bg")
    assert 19 <= start <= 21, admitted  # priority 2 -> 0 after 20 s
    assert bg.priority == 0 and bg.base_priority == 2
    # Without aging the same stream starves it.
    sched = Scheduler(EngineConfig(max_num_seqs=1, priority_aging_s=None), BlockManager(64, BLOCK, True))
    sched.clock = lambda: now[0]
    bg = request("bg", 3, first_token=500)
    bg.priority = 2
    sched.add(bg)
    for i in range(30):
        sched.add(request(f"u{i}", 3, first_token=10 * i))
        sched.schedule()
        assert [r.request_id for r in sched.running] != ["bg"]
        sched.running.clear()
        now[0] += 1.0


def test_with_a_prefill_batch_limit_a_long_prompt_computes_alone_and_short_ones_share_a_step():
    """prefill_batch_tokens (on CPU by default): a second prompt joins a step only within the limit, so the
    first one's first token does not wait for it; requests whose KV was imported still decode beside it."""
    sched = Scheduler(EngineConfig(), BlockManager(64, BLOCK, True), prefill_batch_tokens=16)
    a, b, c = request("a", 12), request("b", 8, first_token=100), request("c", 3, first_token=200)
    for r in (a, b, c):
        sched.add(r)
    assert step(sched) == [("a", 12), ("c", 3)]  # b's 8 would make 20: it goes next
    assert step(sched) == [("a", 1), ("c", 1), ("b", 8)]
    # A running prompt's next chunk is the first prompt of its step; another running one's waits.
    chunked = Scheduler(EngineConfig(max_num_batched_tokens=16), BlockManager(64, BLOCK, True), prefill_batch_tokens=12)
    x, y = request("x", 20), request("y", 20, first_token=100)
    chunked.add(x)
    chunked.add(y)
    assert step(chunked) == [("x", 16)]
    assert step(chunked) == [("x", 4)]  # y's 12 beside x's 4 would pass 12 tokens
    assert step(chunked) == [("x", 1), ("y", 15)]


def yielding_scheduler(window_s: float = 30.0) -> tuple[Scheduler, list[float]]:
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, yield_window_s=window_s), BlockManager(64, BLOCK, True))
    now = [0.0]
    sched.clock = lambda: now[0]
    return sched, now


def yielding_step(sched: Scheduler, cap: int = 8) -> list[tuple[str, int]]:
    """What the engine does with yield_slice_ms: a cap for the prompts that yield."""
    above = sched.yields()
    return step(sched, None, None if above is None else (above, cap))


def test_a_prompt_less_urgent_than_one_queued_lately_yields_in_small_chunks_so_the_next_urgent_one_waits_one_chunk():
    sched, now = yielding_scheduler()
    # Alone at one priority, a prompt is computed whole: nobody pays for yielding.
    sched.add(request("solo", 24, first_token=900))
    assert sched.yields() is None and yielding_step(sched) == [("solo", 24)]
    sched.finish(sched.running[0])
    quiet = request("quiet", 8, first_token=700)
    quiet.priority = -0.5  # a tenant below its share (GenerateRequest.queue_priority)
    sched.add(quiet)
    assert yielding_step(sched) == [("quiet", 8)]
    sched.finish(quiet)
    now[0] = 5.0
    flood = request("flood", 40, first_token=100)
    sched.add(flood)
    sched.add(request("flood2", 40, first_token=200))
    assert sched.yields() == -0.5
    assert yielding_step(sched) == [("flood", 8)]  # it yields: a slice a step, for all yielding prompts together
    assert yielding_step(sched) == [("flood", 8)]
    urgent = request("quiet2", 16, first_token=300)
    urgent.priority = -0.5
    sched.add(urgent)
    assert yielding_step(sched) == [("quiet2", 16)]  # waited one slice, not the flood's whole prompt
    assert sorted(yielding_step(sched)) == [("flood", 8), ("quiet2", 1)]
    assert sched.yield_chunks == 3


def test_prompts_stop_yielding_once_no_more_urgent_one_came_within_the_window():
    sched, now = yielding_scheduler(window_s=10.0)
    urgent = request("urgent", 4)
    urgent.priority = -1
    sched.add(urgent)
    yielding_step(sched)
    sched.finish(urgent)
    bulk = request("bulk", 40, first_token=100)
    sched.add(bulk)
    assert yielding_step(sched) == [("bulk", 8)]
    now[0] = 10.5
    assert sched.yields() is None
    assert yielding_step(sched) == [("bulk", 32)]
