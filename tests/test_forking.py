"""n > 1 candidates on shared blocks: the prompt is computed once, the candidates fork from it (full blocks
shared by reference count, the partly filled last block copied on write), each draws from its own seed."""
from dataclasses import replace

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.sampling_params import candidate_id, candidate_seed
from engine.step_context import OWN_CORES, StepContext
from tests.hf_reference import hf_greedy

PROMPT = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 and a partial one
SAMPLED = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir):
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))


def run(engine: Engine, context: StepContext = OWN_CORES) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(context):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def active_blocks(engine: Engine) -> int:
    return engine.block_manager.num_blocks - engine.block_manager.num_free_blocks


def test_n_candidates_allocate_the_prompts_blocks_once(engine):
    engine.add_request("r", PROMPT, SAMPLED)
    engine.step()  # the prompt's prefill, and the fork
    tables = [engine.requests[candidate_id("r", i)].block_table for i in range(4)]
    assert active_blocks(engine) == 3
    assert all(t == tables[0] for t in tables)
    engine.step()  # each candidate writes its first token into the shared partial block: copy on write
    tables = [engine.requests[candidate_id("r", i)].block_table for i in range(4)]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert active_blocks(engine) == 2 + 4


def test_n_separate_requests_of_one_prompt_compute_it_once_then_share_its_full_blocks(engine):
    for i in range(4):
        engine.add_request(f"r{i}", PROMPT, SamplingParams(seed=11 + i, max_tokens=6, ignore_eos=True))
    engine.step()  # the first computes the prompt; the others wait for its blocks instead of computing them too
    assert active_blocks(engine) == 3 and engine.scheduler.prefix_waits == 3
    engine.step()  # they find its two full blocks cached, and each computes its own last (partial) one
    assert active_blocks(engine) == 3 + 3


def test_candidates_equal_separate_requests_with_the_candidate_seeds(engine):
    [together] = engine.generate(PROMPT, SAMPLED)
    separate = engine.generate([PROMPT] * 4, [SamplingParams(seed=candidate_seed(11, i), max_tokens=6, ignore_eos=True)
                                              for i in range(4)])
    assert [c.token_ids for c in together.candidates] == [s.token_ids for s in separate]
    assert len({tuple(c.token_ids) for c in together.candidates}) == 4
    assert [c.token_ids for c in engine.generate(PROMPT, SAMPLED)[0].candidates] == \
        [c.token_ids for c in together.candidates]


def test_greedy_candidates_read_the_copied_block_as_the_reference_does(engine, tiny_llama_dir):
    [out] = engine.generate(PROMPT, SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))
    expected = hf_greedy(tiny_llama_dir, PROMPT, 8)
    assert [c.token_ids for c in out.candidates] == [expected] * 3


def test_every_block_is_free_after_the_candidates_finish(engine):
    engine.generate(PROMPT, SAMPLED)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_aborting_one_candidate_frees_only_its_own_blocks(engine):
    expected = run_sampled(engine)
    engine.add_request("r", PROMPT, SAMPLED)
    engine.step()
    engine.step()
    own = engine.requests[candidate_id("r", 1)].block_table[2:]
    before = active_blocks(engine)
    assert engine.abort(candidate_id("r", 1))
    assert active_blocks(engine) == before - len(own)
    tokens = run(engine)
    for i in (0, 2, 3):
        assert expected[candidate_id("r", i)][2:] == tokens[candidate_id("r", i)]


def test_aborting_the_first_candidate_before_the_fork_leaves_the_others_running(engine):
    expected = run_sampled(engine)
    engine.add_request("r", PROMPT, SAMPLED)
    assert engine.abort(candidate_id("r", 0))
    tokens = run(engine)
    assert candidate_id("r", 0) not in tokens
    assert all(tokens[candidate_id("r", i)] == expected[candidate_id("r", i)] for i in (1, 2, 3))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preempted_candidates_recompute_to_the_same_tokens(tiny_llama_dir):
    roomy = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    long = SamplingParams(n=4, seed=3, max_tokens=40, ignore_eos=True)
    expected = [c.token_ids for c in roomy.generate(PROMPT, long)[0].candidates]
    tight = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=12))
    got = [c.token_ids for c in tight.generate(PROMPT, long)[0].candidates]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def run_sampled(engine: Engine) -> dict[str, list[int]]:
    engine.add_request("r", PROMPT, SAMPLED)
    return run(engine)


def test_candidates_fork_from_an_imported_prompt_and_recompute_only_its_last_token(tiny_llama_dir):
    prefill, decode = (Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64)) for _ in range(2))
    first = prefill.make_request("r", PROMPT, replace(SAMPLED, n=1, seed=candidate_seed(11, 0)))
    first.do_remote_decode = True
    prefill.add(first)
    while (params := next((o.kv_transfer_params for o in prefill.step()), None)) is None:
        pass
    group = decode.make_request("r", PROMPT, SAMPLED)
    group.all_token_ids.append(first.output_token_ids[0])
    indices = decode.reserve_for_import(group)
    src, dst = params["block_ids"], [group.block_table[i] for i in indices]
    decode.kv_cache.kv[:, :, dst] = prefill.kv_cache.kv[:, :, [src[i] for i in indices]]
    decode.add_imported(group)
    scheduled = []
    tokens = run(decode, StepContext(on_scheduled=scheduled.append))
    assert [n for _, n in scheduled[0]] == [1, 1, 1, 1]  # the parent's decode, and each fork's last prompt token
    assert active_blocks(decode) == 0
    expected = run_sampled(Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64)))
    assert tokens[candidate_id("r", 0)] == expected[candidate_id("r", 0)][1:]
    assert all(tokens[candidate_id("r", i)] == expected[candidate_id("r", i)] for i in (1, 2, 3))


def test_copy_on_write_gives_the_writer_a_copy_of_the_shared_block_in_every_layer():
    import torch

    from engine.block_manager import BlockManager
    from engine.kv_cache import KVCache, KVLayout
    from engine.request import Request

    bm = BlockManager(8, 4)
    cache = KVCache(KVLayout("m", "float32", 4, 2, 1, 2), 8)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), 4)
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    cache.kv[:, :, parent.block_table[1]] = torch.arange(32.0).view(2, 2, 4, 1, 2)
    child = Request("c", parent.prompt_token_ids, SamplingParams(), 4)
    child.take_state(parent)
    bm.fork(parent, child)
    assert bm.allocate_slots(child, 1)  # writes position 6, inside the shared second block
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    [(src, dst)] = bm.take_copies()
    cache.copy_blocks([(src, dst)])
    assert torch.equal(cache.kv[:, :, dst], cache.kv[:, :, src])
    assert [bm.blocks[b].ref_count for b in (parent.block_table[0], src, dst)] == [2, 1, 1]
    assert bm.allocate_slots(parent, 1) and not bm.take_copies()  # the parent now holds its block alone


def test_candidates_and_a_beam_search_in_one_batch_each_sample_from_their_own_row(engine):
    pair = replace(SAMPLED, n=2, temperature=0.0)  # 2 candidates beside 1 beam: as many rows as were sampled
    [alone] = engine.generate(PROMPT, pair)
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True)
    [expected_beams] = engine.generate(list(range(60, 80)), beams)
    searched, together = engine.generate([list(range(60, 80)), PROMPT], [beams, pair])
    assert [c.token_ids for c in together.candidates] == [c.token_ids for c in alone.candidates]
    assert [c.token_ids for c in searched.candidates] == [c.token_ids for c in expected_beams.candidates]


def test_the_next_candidate_stands_in_for_a_first_one_that_finished_elsewhere(engine):
    expected = run_sampled(engine)
    group = engine.make_request("r", PROMPT, SAMPLED)
    engine.add(group.pending_forks[0].take_pending(group))  # as decode does when the prefill token ended it
    tokens = run(engine)
    assert sorted(tokens) == [candidate_id("r", i) for i in (1, 2, 3)]
    assert all(tokens[candidate_id("r", i)] == expected[candidate_id("r", i)] for i in (1, 2, 3))
