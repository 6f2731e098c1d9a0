"""The offline engine's public surface: generate() over strings or token ids, the step API
(add_request / step / abort) with incremental outputs, and EngineConfig validation."""
import pytest
import torch

import engine as engine_pkg
from engine import Engine, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_the_package_exports_the_engine_api():
    assert {"Engine", "EngineConfig", "SamplingParams", "InvalidRequestError", "RequestOutput",
            "CompletionOutput"} <= set(engine_pkg.__all__)


# ---- generate -----------------------------------------------------------------------------------

def test_generate_accepts_strings_and_token_id_lists_and_answers_in_order(tiny_engine):
    prompts = ["Hello there", [5, 6, 7]]
    outs = tiny_engine.generate(prompts, GREEDY)
    assert len(outs) == 2
    assert [o.num_prompt_tokens for o in outs] == [len(tiny_engine.tokenize("Hello there")), 3]
    for out in outs:
        assert len(out.token_ids) == 5 and out.finish_reason == "length"
        assert out.text == tiny_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_generate_gives_the_same_tokens_for_a_string_and_its_token_ids(tiny_engine):
    text = "Hello there"
    by_text, by_ids = tiny_engine.generate([text, tiny_engine.tokenize(text)], GREEDY)
    assert by_text.token_ids == by_ids.token_ids


def test_generate_wraps_a_single_prompt_in_a_list(tiny_engine):
    assert len(tiny_engine.generate("Hello", GREEDY)) == 1
    assert len(tiny_engine.generate([5, 6, 7], GREEDY)) == 1


def test_generate_takes_one_sampling_params_per_prompt(tiny_engine):
    outs = tiny_engine.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                             SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [2, 4]


def test_generate_defaults_to_sixteen_tokens(tiny_engine):
    eos = min(tiny_engine.eos_token_ids)
    out = tiny_engine.generate(["Hi"], SamplingParams(logit_bias={eos: -100.0}))[0]
    assert len(out.token_ids) == 16


# ---- step API -----------------------------------------------------------------------------------

def test_step_outputs_add_up_to_the_final_text_and_ids(tiny_engine):
    tiny_engine.add_request("inc-0", "The answer is", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tiny_engine.add_request("inc-1", [9, 10, 11], SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                                   ignore_eos=True))
    new_ids: dict[str, list[int]] = {}
    new_text: dict[str, str] = {}
    final = {}
    while tiny_engine.has_unfinished_requests():
        for out in tiny_engine.step():
            assert out.request_id not in final, "no output after the finished one"
            new_ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            new_text[out.request_id] = new_text.get(out.request_id, "") + out.new_text
            if out.finished:
                final[out.request_id] = out
    assert set(final) == {"inc-0", "inc-1"}
    whole = tiny_engine.generate(["The answer is", [9, 10, 11]], [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)])
    assert [new_ids["inc-0"], new_ids["inc-1"]] == [out.token_ids for out in whole]
    assert [new_text["inc-0"], new_text["inc-1"]] == [out.text for out in whole]
    assert len(new_ids["inc-0"]) == 8 and len(new_ids["inc-1"]) == 6


def test_step_without_requests_returns_nothing(tiny_engine):
    assert not tiny_engine.has_unfinished_requests()
    assert tiny_engine.step() == []


def test_abort_mid_flight_returns_true_frees_blocks_and_ends_outputs(tiny_engine):
    bm = tiny_engine.block_manager
    tiny_engine.add_request("abort-api", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    tiny_engine.add_request("keep-api", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    tiny_engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    assert tiny_engine.abort("abort-api") is True
    ids = set()
    while tiny_engine.has_unfinished_requests():
        ids.update(out.request_id for out in tiny_engine.step())
    assert ids == {"keep-api"}
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_of_an_unknown_or_finished_request_returns_false(tiny_engine):
    assert tiny_engine.abort("never-added") is False
    tiny_engine.add_request("done", "Hi", SamplingParams(max_tokens=1))
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    assert tiny_engine.abort("done") is False


# ---- EngineConfig -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"block_size": 12}, {"block_size": 0}, {"dtype": "int8"}, {"max_num_seqs": 0},
                                    {"max_num_batched_tokens": 0}, {"num_kv_blocks": 1},
                                    {"kv_cache_memory_gb": 0.0}],
                         ids=lambda k: next(iter(k)))
def test_engine_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        EngineConfig(**kwargs)


def test_engine_refuses_a_model_path_without_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine(EngineConfig(model=str(tmp_path)))


def test_engine_config_device_and_dtype_resolve_to_torch(tiny_engine):
    config = EngineConfig(device="cpu", dtype="bfloat16")
    assert (config.torch_device, config.torch_dtype) == (torch.device("cpu"), torch.bfloat16)
    assert tiny_engine.kv_cache.k[0].device.type == tiny_engine.config.torch_device.type


def test_max_model_len_is_capped_by_the_model(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=4, max_model_len=100_000))
    assert engine.max_model_len == engine.runner.max_position_embeddings == 512


# ---- migrated requests --------------------------------------------------------------------------

def stream_of(engine, request_id, prompt, params, output_token_ids=()):
    """(new token ids, new text) of each output of one request, run alone to the end."""
    engine.add(engine.make_request(request_id, prompt, params, output_token_ids=output_token_ids))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend((out.new_token_ids, out.new_text, out.finish_reason) for out in engine.step())
    return deltas


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_a_migrated_request_continues_with_the_tokens_and_text_it_would_have_streamed(tiny_engine, cut):
    # A stop string that never matches holds text back while streaming: the resumed worker must send it.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["never-said-here"])
    prompt = "The answer is"
    whole = stream_of(tiny_engine, "whole", prompt, params)
    streamed = [t for ids, _, _ in whole[:cut] for t in ids]
    sent_text = "".join(text for _, text, _ in whole[:cut])
    rest = stream_of(tiny_engine, "rest", prompt, params, output_token_ids=streamed)
    assert [ids for ids, _, _ in rest] == [ids for ids, _, _ in whole[cut:]]
    assert sent_text + "".join(text for _, text, _ in rest) == "".join(text for _, text, _ in whole)
    assert rest[-1][2] == "length" and len(rest) == 24 - cut
    assert tiny_engine.block_manager.num_free_blocks == tiny_engine.block_manager.num_blocks


@pytest.mark.parametrize("cut", [1, 9])
def test_a_migrated_seeded_request_draws_the_samples_it_would_have_drawn(tiny_engine, cut):
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    whole = stream_of(tiny_engine, "seeded-whole", [7, 8, 9], params)
    streamed = [t for ids, _, _ in whole[:cut] for t in ids]
    rest = stream_of(tiny_engine, "seeded-rest", [7, 8, 9], params, output_token_ids=streamed)
    assert [ids for ids, _, _ in rest] == [ids for ids, _, _ in whole[cut:]]
    assert len({t for ids, _, _ in whole for t in ids}) > 3  # really sampled, not one repeated token


@pytest.mark.parametrize("outputs", [[5] * 4, [5, 10**9], [-1]])
def test_migrated_output_tokens_must_be_fewer_than_max_tokens_and_in_the_vocabulary(tiny_engine, outputs):
    with pytest.raises(InvalidRequestError) as err:
        tiny_engine.make_request("bad-resume", [1, 2, 3], SamplingParams(max_tokens=4), output_token_ids=outputs)
    assert err.value.field == "output_token_ids"
