"""The reasoning budget in the engine: the thinking between the markers is cut at max_reasoning_tokens
by forcing the end marker, exactly, also for a request resumed with tokens it produced elsewhere."""
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from engine.reasoning import ReasoningBudget, ReasoningMarkers


@pytest.fixture(scope="module")
def engine(tiny_agent_dir):
    return Engine(EngineConfig(model=tiny_agent_dir, num_kv_blocks=64, reasoning_markers=("<think>", "</think>")))


@pytest.fixture(scope="module")
def multi_token_engine(tiny_llama_dir):
    """Markers the tokenizer spells with several tokens each."""
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, reasoning_markers=("<think>", "</think>")))


def thinking_prompt(engine) -> list[int]:
    markers = engine.reasoning_markers
    return engine.tokenize("Why is the sky blue?") + list(markers.start_ids)


def between_markers(tokens: list[int], markers: ReasoningMarkers, prompt_opens: bool) -> int:
    """Tokens of the thinking: from the start marker (or the output's start) to the end marker."""
    end = markers.end_ids
    stop = next(i for i in range(len(tokens)) if tuple(tokens[i:i + len(end)]) == end)
    return stop if prompt_opens else stop - len(markers.start_ids)


@pytest.mark.parametrize("budget", [0, 1, 7])
@pytest.mark.parametrize("which", ["single", "multi"])
def test_thinking_stops_at_exactly_the_budget_then_the_end_marker(engine, multi_token_engine, which, budget):
    eng = engine if which == "single" else multi_token_engine
    params = SamplingParams(temperature=0.0, max_tokens=budget + 12, ignore_eos=True, max_reasoning_tokens=budget)
    out = eng.generate([thinking_prompt(eng)], params)[0]
    markers = eng.reasoning_markers
    assert between_markers(out.token_ids, markers, prompt_opens=True) == budget
    end = len(markers.end_ids)
    assert tuple(out.token_ids[budget:budget + end]) == markers.end_ids
    assert len(out.token_ids) == budget + 12  # generation goes on after the thinking


def test_without_a_budget_the_same_model_thinks_past_it(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = engine.generate([thinking_prompt(engine)], params)[0]
    assert tuple(engine.reasoning_markers.end_ids) not in {tuple(out.token_ids[i:i + 1]) for i in range(12)}


def test_a_seeded_sampled_request_also_obeys_the_budget(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, max_reasoning_tokens=4)
    out = engine.generate([thinking_prompt(engine)], params)[0]
    assert between_markers(out.token_ids, engine.reasoning_markers, prompt_opens=True) <= 4


def test_thinking_opened_by_the_model_is_counted_from_its_start_marker(engine):
    start = engine.reasoning_markers.start_ids[0]
    # The bias makes the model open its thinking at once; the budget counts from there.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, max_reasoning_tokens=3,
                            logit_bias={start: 100.0}, min_tokens=0)
    out = engine.generate([engine.tokenize("Hello")], params)[0]
    assert out.token_ids[0] == start
    assert between_markers(out.token_ids, engine.reasoning_markers, prompt_opens=False) == 3


@pytest.mark.parametrize("resume_after", [1, 3, 5, 6])
def test_a_resumed_request_keeps_the_budget_it_had_left(engine, resume_after):
    """Resumed as a migration or a remote prefill's decode is: with its output so far as output_token_ids."""
    prompt = thinking_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, max_reasoning_tokens=5)
    whole = engine.generate([prompt], params)[0].token_ids
    req = engine.make_request("resumed", prompt, params, output_token_ids=whole[:resume_after])
    engine.add(req)
    tokens = list(whole[:resume_after])
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == whole
    assert between_markers(tokens, engine.reasoning_markers, prompt_opens=True) == 5


def test_a_budget_replayed_from_tokens_equals_the_one_advanced_token_by_token():
    markers = ReasoningMarkers("<t>", "</t>", (1,), (2, 3))
    stepped = ReasoningBudget(markers, 5)
    output = [7, 1, 8, 2, 3, 9, 1, 4, 5, 2, 3, 6]  # thinks, closes itself; opens again (ignored: done)
    for token in output:
        stepped.advance(token)
    assert stepped == ReasoningBudget.replay(markers, 5, [5], output)
    assert (stepped.phase, stepped.num_reasoning_tokens) == ("done", 1)


def test_a_budget_without_configured_markers_is_refused_naming_the_field(tiny_engine):
    with pytest.raises(InvalidRequestError) as raised:
        tiny_engine.generate(["x"], SamplingParams(max_reasoning_tokens=4))
    assert raised.value.field == "max_reasoning_tokens"


def test_the_rigged_agent_model_writes_a_whole_hermes_call_once_it_opens_one(engine):
    """What the API tests of tool_choice auto rely on (tests/conftest.py)."""
    from tests.conftest import AGENT_CALL
    opener = engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    params = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={opener: 100.0})
    out = engine.generate([engine.tokenize("weather?")], params)[0]
    assert out.text == f"<tool_call>{AGENT_CALL}</tool_call>" and out.finish_reason == "stop"
