"""What vLLM users find beside the OpenAI endpoints, through the real ingress: /v1/models/{id}, /version,
/tokenize, /detokenize, several served model names, a chat template from the config, fields the API
accepts and ignores, the chat template controls, continuous usage stats and prompt truncation."""
import json

import openai
import pytest
import requests

from tests.ingress.conftest import ALIAS, MODEL

CHAT = [{"role": "user", "content": "Name a color."}]
GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_404(main_app):
    card = main_app.client().models.retrieve(MODEL)
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (MODEL, "model", 512)
    with pytest.raises(openai.NotFoundError):
        main_app.client().models.retrieve("no-such-model")
    with pytest.raises(openai.AuthenticationError):
        main_app.client(key="not-a-key").models.retrieve(MODEL)


def test_every_served_name_is_listed_and_answers_and_responses_carry_the_first(pair_app):
    client = pair_app.client(key=None)
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    by_alias = client.completions.create(model=ALIAS, prompt="Colors", **GREEDY)
    by_name = client.completions.create(model=MODEL, prompt="Colors", **GREEDY)
    assert by_alias.model == MODEL and by_alias.choices[0].text == by_name.choices[0].text


def test_version_follows_the_api_key_rule(main_app):
    assert main_app.get("/version").status_code == 401
    answer = requests.get(f"{main_app.base_url}/version", headers={"Authorization": "Bearer key-a"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["version"] not in ("", None)


def test_tokenize_gives_the_ids_a_completion_runs_and_detokenize_inverts_it(main_app, tokenizer):
    prompt = "The quick brown fox"
    out = main_app.post("/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode(prompt) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    used = main_app.client().completions.create(model=MODEL, prompt=prompt, **GREEDY).usage.prompt_tokens
    assert used == out["count"]
    back = main_app.post("/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json()
    assert back == {"prompt": prompt}


def test_tokenize_renders_messages_as_chat_completions_do(main_app):
    out = main_app.post("/tokenize", {"model": MODEL, "messages": CHAT}).json()
    used = main_app.client().chat.completions.create(model=MODEL, messages=CHAT, **GREEDY).usage.prompt_tokens
    assert out["count"] == used
    bare = main_app.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < out["count"] and out["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
    ("/tokenize", {"prompt": "a", "no_such_field": 1}, "no_such_field"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_bodies_get_openai_errors_naming_the_field(main_app, path, body, param):
    response = main_app.post(path, body)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param
    assert main_app.post(path, body, key="not-a-key").status_code == 401


def test_the_configured_chat_template_renders_the_conversation(pair_app, tokenizer):
    rendered = f"[user] {CHAT[0]['content']}\n[assistant]"
    out = pair_app.post("/tokenize", {"model": MODEL, "messages": CHAT}, key=None).json()
    assert out["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    used = pair_app.client(key=None).chat.completions.create(model=MODEL, messages=CHAT, **GREEDY).usage
    assert used.prompt_tokens == out["count"]


def test_continue_final_message_and_template_kwargs_reach_the_template(main_app):
    partial = [*CHAT, {"role": "assistant", "content": "The color is"}]
    controls = {"add_generation_prompt": False, "continue_final_message": True}
    continued = main_app.post("/tokenize", {"messages": partial, **controls}).json()
    closed = main_app.post("/tokenize", {"messages": partial, "add_generation_prompt": False}).json()
    assert continued["count"] < closed["count"]  # no end-of-turn after the assistant's text
    chat = main_app.client().chat.completions.create(model=MODEL, messages=partial, **GREEDY,
                                                     extra_body={"ignore_eos": True, **controls,
                                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.usage.prompt_tokens == continued["count"]


def test_fields_the_api_does_not_act_on_are_accepted_and_change_nothing(main_app):
    client = main_app.client()
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    lenient = client.chat.completions.create(
        model=MODEL, messages=CHAT, **GREEDY, metadata={"team": "search"}, store=False, user="u-1",
        parallel_tool_calls=True, service_tier="auto",
        extra_body={"ignore_eos": True, "priority": 3, "request_id": "r-1", "prompt_cache_key": "k"})
    assert lenient.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("field, value", [("prediction", {"type": "content", "content": "x"}),
                                          ("audio", {"voice": "alloy", "format": "wav"}),
                                          ("modalities", ["text", "audio"]), ("functions", [{"name": "f"}]),
                                          ("allowed_token_ids", [1, 2]), ("spaces_between_special_tokens", False)])
def test_fields_that_would_change_the_output_and_are_not_supported_are_400_naming_them(main_app, field, value):
    response = main_app.post("/v1/chat/completions", {"model": MODEL, "messages": CHAT, field: value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(main_app):
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = main_app.post("/v1/completions", body, stream=True)
    events = [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and all(e["usage"] for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(main_app):
    client = main_app.client()
    prompt = list(range(100, 160))
    cut = client.completions.create(model=MODEL, prompt=prompt, **GREEDY,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 10})
    tail = client.completions.create(model=MODEL, prompt=prompt[-10:], **GREEDY)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == tail.choices[0].text
