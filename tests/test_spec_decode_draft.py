"""Speculative decoding with a draft model (a tiny random model of the same tokenizer): outputs are the
target's own, whatever the draft proposes."""
import pytest

from engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode import SpeculativeConfig

PROMPTS = [[33280] * 8 + [5, 6, 7, 8], [100, 200, 300, 400, 500], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def draft_engine(target: str, draft: str, **kwargs) -> Engine:
    config = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=3, adaptive=False)
    return Engine(EngineConfig(model=target, num_kv_blocks=kwargs.pop("num_kv_blocks", 128),
                               speculative_config=config, **kwargs))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    plain = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_greedy_output_with_a_draft_model_equals_output_without(tiny_llama_dir, expected):
    """The draft here has the target's weights, so its drafts are accepted."""
    engine = draft_engine(tiny_llama_dir, tiny_llama_dir)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens_per_pos[2] > 0 and stats.num_accepted_tokens > stats.num_draft_tokens // 2


def test_a_draft_model_that_guesses_wrong_changes_nothing(tiny_llama_dir, tiny_qwen2_dir, expected):
    engine = draft_engine(tiny_llama_dir, tiny_qwen2_dir)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.speculator.stats.num_draft_tokens > engine.speculator.stats.num_accepted_tokens


def test_draft_sequences_and_their_blocks_go_when_their_requests_do(tiny_llama_dir, expected):
    engine = draft_engine(tiny_llama_dir, tiny_llama_dir, num_kv_blocks=8)  # preempts: the three need 12 blocks
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.scheduler.num_preemptions > 0
    engine.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    proposer = engine.speculator.proposer
    assert not proposer.sequences or all(s.seq.request_id.startswith("gen-3") for s in proposer.sequences.values())
    held = sum(len(s.seq.block_table) for s in proposer.sequences.values())
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks - held


def test_draft_model_needs_a_model():
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig(method="draft_model")
