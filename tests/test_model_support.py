"""Models whose attention the engine cannot compute exactly are refused at start, naming the feature; the
ones it can (Mistral without a binding window, Qwen2 without its optional window) run and match HF."""
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from cluster.admin_client import CLIError
from cluster.launcher import prepare_model
from engine import Engine, EngineConfig
from engine.model_loader import build_random_model
from engine.model_support import UnsupportedModelError, check_supported, unsupported_features
from tests.test_engine_reference import assert_matches_hf, mixed_prompts

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("arch, overrides, expected", [
    ("llama", {}, []),
    ("qwen2", {}, []),  # its window is off unless use_sliding_window
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
     ["sliding-window attention (64 tokens) on 2 of 2 layers"]),
    ("mistral", {"sliding_window": 64}, ["sliding-window attention (64 tokens, context 512)"]),
    ("mistral", {"sliding_window": 4096}, []),  # a window past the context never hides a token
    ("mistral", {"sliding_window": None}, []),
    ("gemma2", {"sliding_window": 32}, ["sliding-window attention (32 tokens) on 1 of 2 layers",
                                        "attention logit soft-capping (50.0)"]),
    ("llama", {"attention_chunk_size": 128}, ["chunked local attention (128 tokens)"]),
])
def test_unsupported_features_are_read_from_the_config(arch, overrides, expected):
    config = AutoConfig.for_model(arch, **SMALL, **overrides)
    assert unsupported_features(config) == expected


def test_the_refusal_names_the_model_the_architecture_and_every_feature():
    config = AutoConfig.for_model("gemma2", **SMALL, sliding_window=32, architectures=["Gemma2ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"model g \(Gemma2ForCausalLM\) uses sliding-window attention "
                                                    r".* and attention logit soft-capping \(50.0\).*rather than "
                                                    r"answer wrongly"):
        check_supported(config, "g")


@pytest.fixture(scope="module")
def windowed_mistral_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("models") / "mistral-window", "mistral",
                                  sliding_window=16))


def test_the_engine_refuses_a_binding_window_before_loading_weights(windowed_mistral_dir):
    with pytest.raises(UnsupportedModelError, match=r"sliding-window attention \(16 tokens, context 512\)"):
        Engine(EngineConfig(model=windowed_mistral_dir, num_kv_blocks=64))


def test_tandem_serve_refuses_it_at_start_with_the_same_message(windowed_mistral_dir):
    said = []
    with pytest.raises(CLIError, match="sliding-window attention"):
        prepare_model(SimpleNamespace(model=windowed_mistral_dir, model_name="m", device="cpu"), said.append)
    assert not said  # refused before announcing the model


def test_mistral_without_a_binding_window_runs_and_matches_hf(tmp_path):
    model_dir = str(build_random_model(tmp_path / "mistral", "mistral", sliding_window=4096))
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=128))
    assert_matches_hf(engine, model_dir, mixed_prompts(engine.runner.vocab_size))
