"""Several models behind one API, without Ray: the config's `models` become one cluster config each (the top
level's fields as defaults, names kept apart), requests go to the service their `model` names, and the CLI's
status prints each model."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from cluster.cli import format_status
from cluster.config import ClusterConfig
from router.api.auth import Authenticator
from router.api.openai_api import APIError
from router.api.openai_responses import ModelCard, ModelList
from router.api.served_models import ServedModels
from tests.test_cli import run_cli


def fake_service(name: str, aliases=(), adapters=()):
    async def completions(body, authorization, trace=None):
        return name

    def models(authorization):
        return ModelList(data=[ModelCard(id=n, created=0, max_model_len=1) for n in (name, *aliases, *adapters)])

    return SimpleNamespace(model=SimpleNamespace(names=(name, *aliases), name=name), adapters=lambda: dict.fromkeys(adapters),
                           auth=Authenticator({"key": "t"}), tokenizer=None, completions=completions, chat=completions,
                           models=models, check_model=lambda model: None)


def test_requests_go_to_the_model_alias_or_adapter_they_name():
    served = ServedModels([fake_service("llama", ["l"]), fake_service("qwen", adapters=["sql"])])
    call = lambda model: asyncio.run(served.completions(json.dumps({"model": model}).encode(), "Bearer key"))  # noqa: E731
    assert [call(m) for m in ("llama", "l", "qwen", "sql")] == ["llama", "llama", "qwen", "qwen"]
    with pytest.raises(APIError, match="`llama`, `l`, `qwen`, `sql`") as e:
        call("mistral")
    assert e.value.status == 404
    assert asyncio.run(served.completions(b"{not json", "Bearer key")) == "llama"  # its parser says why: 400
    with pytest.raises(APIError) as e:  # the key before anything: a stranger learns no model names
        asyncio.run(served.completions(b'{"model": "mistral"}', "Bearer nope"))
    assert e.value.status == 401
    assert [m.id for m in served.models("Bearer key").data] == ["llama", "l", "qwen", "sql"]


def test_each_model_is_a_cluster_config_of_its_own_over_the_top_levels_fields():
    config = ClusterConfig(name="t", admin_key="a-real-admin-key-here", engine={"num_kv_blocks": 64},
                           decode={"replicas": 2},
                           models=[{"key": "a", "model": "/m/a", "served_model_name": "A", "lora": {"max_loras": 2}},
                                   {"key": "b", "served_model_name": ["B", "b2"], "decode": {"replicas": 3},
                                    "mode": "colocated"}])
    a, b = config.model_configs()
    assert (a.name, a.model, a.model_names, a.decode.replicas, a.lora.max_loras) == ("t--a", "/m/a", ["A"], 2, 2)
    assert (b.name, b.model, b.model_names, b.decode.replicas, b.mode) == ("t--b", None, ["B", "b2"], 3, "colocated")
    assert a.engine.num_kv_blocks == b.engine.num_kv_blocks == 64 and a.admin_key == b.admin_key
    assert ClusterConfig(name="t").model_configs()[0].name == "t"


@pytest.mark.parametrize("models, message", [
    ([{"key": "a", "served_model_name": "x"}, {"key": "a", "served_model_name": "y"}], "a key of its own"),
    ([{"key": "a", "served_model_name": "x"}, {"key": "b", "served_model_name": ["y", "x"]}], "'x' names both"),
    ([{"key": "a"}, {"key": "b"}], "'smollm2-135m-instruct' names both"),
    ([{"key": "a", "served_model_name": "x"}, {"key": "b", "served_model_name": "y", "nope": 1}], "Extra inputs"),
    ([{"key": "A_b"}], "key"),
    ([{"key": "abcdefghijklmnop", "served_model_name": "x"}], "must fit 41 characters"),
])
def test_models_are_refused_unless_their_keys_and_names_are_apart(models, message):
    with pytest.raises(ValidationError, match=message):
        ClusterConfig(name="a-long-cluster-name-of-thirty-chars", models=models)


def test_serve_refuses_single_model_flags_with_several_models(capsys, tmp_path):
    config = tmp_path / "tandem.yaml"
    config.write_text("models:\n  - key: a\n    served_model_name: x\n  - key: b\n    served_model_name: y\n")
    code, _, err = run_cli(capsys, "serve", "--config", str(config), "--decode", "2", "--model", "/m")
    assert code == 1 and "--model, --decode would apply to none of them" in err


def test_status_prints_each_model():
    one = {"model": "{}", "mode": "disaggregated", "version": 3,
           "pools": {"decode": {"replicas": 1, "desired": 1, "min_replicas": 0, "max_replicas": 2,
                                "workers": [{"worker_id": "decode-0", "state": "starting"}]}}}
    text = format_status({"models": {"a": {**one, "model": "a"}, "b": {**one, "model": "b"}},
                          "flow": {"replica": "r", "models": {"a": {"max_in_flight": None, "in_flight": 0,
                                                                   "saturated": False, "shed": "off", "tenants": {}}}}},
                         "http://x")
    assert "model a, disaggregated" in text and "model b, disaggregated" in text
    assert text.count("decode-0") == 2 and "ingress queue of a (replica r)" in text
