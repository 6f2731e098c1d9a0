"""Incremental detokenization and finish reasons: streamed text equals the full decode, never half a
UTF-8 character, stop strings never leak, and every way a request ends is reported as vLLM does."""
import random

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, backend_decode
from engine.model_loader import load_tokenizer

MULTI_BYTE_TEXTS = ["Hello, world! 😀 こんにちは世界 🇫🇷 naïve café — ok",
                    "数学: ∀x ∈ ℝ, x² ≥ 0 🧮🧮 done", "emoji run 👩‍👩‍👧‍👦🎉 end"]
STORY = "The answer is 42. END of story, the END."
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(tokenizer, token_ids, params=SamplingParams(), prompt=(504,)):
    """Feeds tokens one at a time as the engine does; returns (deltas, final text, stop string or None)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas = []
    for i, token in enumerate(token_ids):
        stop = detok.append(token)
        deltas.append(detok.take_new_text(finished=stop is not None or i == len(token_ids) - 1))
        if stop is not None:
            return deltas, detok.text, stop
    return deltas, detok.text, None


# ---- incremental decoding -------------------------------------------------------------------------

@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_streamed_text_equals_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, final, _ = stream(tokenizer, ids)
    assert "".join(deltas) == final == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_no_delta_holds_half_a_utf8_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the text should split characters across tokens"
    deltas, _, _ = stream(tokenizer, ids)
    for delta in deltas:
        assert "\ufffd" not in delta
        assert delta.encode("utf-8").decode("utf-8") == delta


def test_a_character_is_released_once_its_last_byte_arrives(tokenizer):
    ids = tokenizer.encode(" 😀")
    assert len(ids) > 1
    deltas, _, _ = stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 😀"


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    assert stream(tokenizer, ids)[1] == "Hi"
    assert stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))[1] == "Hi" + tokenizer.eos_token


# ---- stop strings -------------------------------------------------------------------------------

def test_stop_string_split_across_tokens_never_leaks(tokenizer):
    ids = tokenizer.encode(STORY)
    stop = "42. EN"
    assert all(stop not in tokenizer.decode([t]) for t in ids)
    deltas, final, found = stream(tokenizer, ids, SamplingParams(stop=[stop]))
    assert found == stop
    assert final == "".join(deltas) == "The answer is "
    assert not any(stop in d or "42" in d for d in deltas)


def test_stop_string_inside_one_token_cuts_mid_token(tokenizer):
    deltas, final, found = stream(tokenizer, tokenizer.encode(STORY), SamplingParams(stop=["nswe"]))
    assert found == "nswe"
    assert final == "".join(deltas) == "The a"


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    deltas, final, found = stream(tokenizer, tokenizer.encode(STORY), params)
    assert found == "END"
    assert final == "".join(deltas) == "The answer is 42. END"


def test_the_first_occurrence_of_a_stop_string_ends_the_text(tokenizer):
    deltas, final, _ = stream(tokenizer, tokenizer.encode(STORY), SamplingParams(stop=["the END", "END"]))
    assert final == "".join(deltas) == "The answer is 42. "


def test_stop_strings_before_min_tokens_are_kept_in_the_text(tokenizer):
    ids = tokenizer.encode(STORY)
    first_end = ids.index(36588)
    params = SamplingParams(stop=["END"], min_tokens=first_end + 2, max_tokens=None)
    deltas, final, found = stream(tokenizer, ids, params)
    assert found == "END"
    assert final == "".join(deltas) == "The answer is 42. END of story, the "


def test_stop_token_text_stays_out_of_the_output(tokenizer):
    ids = tokenizer.encode(STORY)
    period = ids[6]
    assert tokenizer.decode([period]) == "."
    _, final, _ = stream(tokenizer, ids[:7], SamplingParams(stop_token_ids=[period]))
    assert final == "The answer is 42"
    _, kept, _ = stream(tokenizer, ids[:7], SamplingParams(stop_token_ids=[period], include_stop_str_in_output=True))
    assert kept == "The answer is 42."


# ---- through the engine: text and finish reasons ------------------------------------------------

def run_steps(engine: Engine, prompt, params: SamplingParams, request_id: str):
    """Runs one request by the step API; returns (deltas, last output)."""
    engine.add_request(request_id, prompt, params)
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.append(out.new_text)
                last = out
    return deltas, last


@pytest.fixture(scope="module")
def baseline(tiny_engine):
    """A greedy continuation of the tiny model, to pick stop strings and stop ids from."""
    out = tiny_engine.generate(["The answer is"], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    return out


def test_engine_text_equals_the_full_decode_of_its_ids(tiny_engine, baseline):
    full = tiny_engine.tokenizer.decode(baseline.token_ids, skip_special_tokens=True)
    # A trailing incomplete character is held back rather than shown as U+FFFD.
    assert full.startswith(baseline.text) and not full[len(baseline.text):].strip("\ufffd")


def test_engine_stop_string_split_across_tokens_ends_the_request(tiny_engine, baseline):
    tok = tiny_engine.tokenizer
    boundary = len(tok.decode(baseline.token_ids[:4]))
    stop = baseline.text[boundary - 2:boundary + 2]
    expected = baseline.text[:baseline.text.find(stop)]
    deltas, last = run_steps(tiny_engine, "The answer is", SamplingParams(temperature=0.0, max_tokens=12,
                                                                         ignore_eos=True, stop=[stop]), "stop-s")
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert "".join(deltas) == expected
    assert not any(stop in d for d in deltas)


def test_engine_include_stop_str_in_output(tiny_engine, baseline):
    stop = baseline.text[5:9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=True)
    out = tiny_engine.generate(["The answer is"], params)[0]
    assert out.text == baseline.text[:baseline.text.find(stop) + len(stop)]
    assert out.finish_reason == "stop"


def test_engine_stop_token_id_finishes_with_the_id_as_stop_reason(tiny_engine, baseline):
    stop_id = baseline.token_ids[3]
    k = baseline.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    out = tiny_engine.generate(["The answer is"], params)[0]
    assert out.token_ids == baseline.token_ids[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == tiny_engine.tokenizer.decode(baseline.token_ids[:k], skip_special_tokens=True)


def test_engine_eos_finishes_with_stop_and_no_stop_reason(tiny_engine):
    eos = min(tiny_engine.eos_token_ids)
    out = tiny_engine.generate(["Hi"], SamplingParams(temperature=0.0, logit_bias={eos: 100.0}))[0]
    assert out.token_ids == [eos]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", None, "")


@pytest.mark.parametrize("include", [False, True])
def test_engine_eos_text_stays_out_unless_asked_for_like_a_stop_token(tiny_engine, include):
    eos = min(tiny_engine.eos_token_ids)
    text = tiny_engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert text
    params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False,
                            include_stop_str_in_output=include)
    out = tiny_engine.generate(["Hi"], params)[0]
    assert (out.token_ids, out.finish_reason, out.text) == ([eos], "stop", text if include else "")
    # Ignored, EOS is an ordinary token: its text is output.
    params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False, ignore_eos=True,
                            max_tokens=2)
    assert tiny_engine.generate(["Hi"], params)[0].text == text * 2


def test_engine_ignore_eos_runs_to_max_tokens(tiny_engine):
    eos = min(tiny_engine.eos_token_ids)
    params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0}, ignore_eos=True, max_tokens=3)
    out = tiny_engine.generate(["Hi"], params)[0]
    assert out.token_ids == [eos] * 3
    assert out.finish_reason == "length"


def test_engine_max_tokens_finishes_with_length(tiny_engine, baseline):
    out = tiny_engine.generate(["The answer is"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == baseline.token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_engine_context_limit_finishes_with_length(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=8, max_model_len=24))
    prompt = list(range(100, 120))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) == 24
    assert out.finish_reason == "length"


def test_engine_abort_finishes_with_abort(tiny_engine):
    req = tiny_engine.add_request("abort-me", "Hi", SamplingParams(max_tokens=50, ignore_eos=True))
    tiny_engine.step()
    assert tiny_engine.abort("abort-me")
    assert req.finished and req.finish_reason == "abort"
    assert not tiny_engine.has_unfinished_requests()


def test_the_default_tokenizer_decodes_through_its_backend_with_the_wrappers_text(tokenizer):
    decode = backend_decode(tokenizer)
    assert decode == tokenizer._tokenizer.decode  # no wrapper per token: its conversions cost more than decoding
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
