"""Beam search in the engine: beams are forked requests sharing blocks, the search follows vLLM's (top
2 x beam_width continuations per beam, EOS ones completed, length-penalized score), the n best come back
in score order, and every block is free afterwards."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.beam_search import get_beam_search_score
from engine.errors import InvalidRequestError
from engine.sampling_params import candidate_id
from tests.hf_reference import hf_model

PROMPT = list(range(7, 43))  # 36 tokens: 2 full blocks and a partial one
BEAMS = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir):
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))


@torch.inference_mode()
def reference_beam_search(model_dir: str, prompt: list[int], beam_width: int, n: int, max_tokens: int,
                          length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """The search spelled out on plain HF forwards, each beam recomputed from its whole context."""
    model = hf_model(model_dir)
    beams, completed = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            logprobs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, -1].float(), dim=-1)
            values, ids = logprobs.topk(2 * beam_width)
            candidates += [(tokens + [t], cum + v) for v, t in zip(values.tolist(), ids.tolist())]
        beams = sorted(candidates, key=lambda c: c[1], reverse=True)[:beam_width]
    final = completed + beams
    return sorted(final, key=lambda s: s[1] / (len(prompt) + len(s[0])) ** length_penalty, reverse=True)[:n]


def test_beam_search_matches_a_reference_search_on_the_hf_model(engine, tiny_llama_dir):
    [out] = engine.generate(PROMPT, BEAMS)
    expected = reference_beam_search(tiny_llama_dir, PROMPT, beam_width=3, n=2, max_tokens=6)
    assert [c.token_ids for c in out.candidates] == [tokens for tokens, _ in expected]
    assert [c.cumulative_logprob for c in out.candidates] == pytest.approx([cum for _, cum in expected], abs=1e-3)
    assert all(c.finish_reason == "length" for c in out.candidates)


def test_beams_come_back_in_score_order(engine):
    [out] = engine.generate(PROMPT, SamplingParams(n=4, use_beam_search=True, max_tokens=5, ignore_eos=True,
                                                   length_penalty=0.5))
    scores = [get_beam_search_score(len(PROMPT) + len(c.token_ids), c.cumulative_logprob, False, 0.5)
              for c in out.candidates]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert out.candidates[0].text == engine.tokenizer.decode(out.candidates[0].token_ids, skip_special_tokens=True)


def test_beams_share_the_prompts_blocks(engine):
    engine.add_request("b", PROMPT, BEAMS)
    engine.step()  # prefill, then 3 beams fork from the prompt
    engine.step()
    search = engine.requests[candidate_id("b", 0)].beam_search
    tables = [beam.block_table for beam in search.beams]
    assert len(tables) == 3 and all(t[:2] == tables[0][:2] for t in tables)
    # The full prompt blocks once, and at most one partial block per beam (3 x 3 if nothing were shared).
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks <= 2 + 3


def test_every_block_is_free_after_the_search_and_after_an_abort(engine):
    engine.generate(PROMPT, BEAMS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("b", PROMPT, BEAMS)
    engine.step()
    engine.step()
    assert engine.abort(candidate_id("b", 1))
    assert not engine.has_unfinished_requests() and not engine.requests
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_the_score_divides_by_the_length_without_a_final_eos():
    assert get_beam_search_score(10, -5.0, ends_with_eos=True, length_penalty=1.0) == pytest.approx(-5.0 / 9)
    assert get_beam_search_score(10, -5.0, ends_with_eos=False, length_penalty=2.0) == pytest.approx(-5.0 / 100)


@pytest.mark.parametrize("field, extra", [("best_of", {"best_of": 1, "n": 2}), ("stop", {"stop": ["x"]}),
                                          ("logprobs", {"logprobs": 1}), ("best_of", {"best_of": 3, "n": 1,
                                                                                      "use_beam_search": False})])
def test_beam_search_refuses_what_it_does_not_support(field, extra):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{"use_beam_search": True, **extra})
    assert err.value.field == field
