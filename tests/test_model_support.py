"""Sliding-window and soft-capped models run exactly (Mistral, Qwen2's optional window, Gemma 2 and 3): prefill,
chunked prefill, prefix hits and decode on the C kernels and on the SDPA paths match HF generate. Models whose
attention the engine cannot compute (chunked attention) are refused at start, naming the feature."""
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from cluster.admin_client import CLIError
from cluster.launcher import prepare_model
from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import build_random_model
from engine.model_support import UnsupportedModelError, check_supported, unsupported_features
from tests.test_engine_reference import assert_matches_hf, mixed_prompts

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("arch, overrides, expected", [
    ("llama", {}, []),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, []),
    ("mistral", {"sliding_window": 64}, []),
    ("gemma2", {"sliding_window": 32}, []),
    ("llama", {"attention_chunk_size": 128}, ["chunked local attention (128 tokens)"]),
])
def test_unsupported_features_are_read_from_the_config(arch, overrides, expected):
    config = AutoConfig.for_model(arch, **SMALL, **overrides)
    assert unsupported_features(config) == expected


def test_the_refusal_names_the_model_the_architecture_and_the_feature():
    config = AutoConfig.for_model("llama", **SMALL, attention_chunk_size=8, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"model g \(LlamaForCausalLM\) uses chunked local attention "
                                                    r"\(8 tokens\).*rather than answer wrongly"):
        check_supported(config, "g")


@pytest.fixture(scope="module")
def chunked_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("models") / "chunked", "llama", attention_chunk_size=8))


def test_the_engine_refuses_chunked_attention_before_loading_weights(chunked_dir):
    with pytest.raises(UnsupportedModelError, match=r"chunked local attention \(8 tokens\)"):
        Engine(EngineConfig(model=chunked_dir, num_kv_blocks=64))


def test_tandem_serve_refuses_it_at_start_with_the_same_message(chunked_dir):
    said = []
    with pytest.raises(CLIError, match="chunked local attention"):
        prepare_model(SimpleNamespace(model=chunked_dir, model_name="m", device="cpu"), said.append)
    assert not said  # refused before announcing the model


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    """A window of 16 tokens: every prompt of mixed_prompts but the shortest runs past it."""
    root = tmp_path_factory.mktemp("windowed")
    return {"mistral": str(build_random_model(root / "mistral", "mistral", sliding_window=16)),
            "qwen2": str(build_random_model(root / "qwen2", "qwen2", seed=3, use_sliding_window=True,
                                            sliding_window=16, max_window_layers=1)),  # layer 1 windowed, 0 full
            # QK-norm, scaled embeddings, its own query scale, local and global rotary; layers 0-4 local, 5 global
            "gemma3": str(build_random_model(root / "gemma3", "gemma3_text", seed=4, num_layers=6, head_dim=16,
                                             sliding_window=16)),
            # soft-capping that binds (this random model's scores reach well past 2) on local and global layers
            "gemma2": str(build_random_model(root / "gemma2", "gemma2", seed=5, head_dim=16, sliding_window=16,
                                             attn_logit_softcapping=2.0, final_logit_softcapping=5.0))}


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3", "gemma2"])
@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "sdpa"])
def test_sliding_window_models_match_hf(windowed_dirs, arch, kernels):
    model_dir = windowed_dirs[arch]
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=20))  # the batch needs 33 blocks: it preempts
    if not kernels:
        engine.runner.paged_kernel = engine.runner.prefill_kernel = False
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # decodes run past the window too
    assert_matches_hf(engine, model_dir, mixed_prompts(engine.runner.vocab_size), params)
    assert engine.scheduler.num_preemptions > 0 or engine.block_manager.window_released > 0


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "sdpa"])
def test_a_windowed_model_chunked_and_hitting_its_prefix_matches_hf(windowed_dirs, kernels):
    model_dir = windowed_dirs["mistral"]
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=128, max_num_batched_tokens=24))
    if not kernels:
        engine.runner.paged_kernel = engine.runner.prefill_kernel = False
    prompts = mixed_prompts(engine.runner.vocab_size, seed=4)
    shared = prompts[-1]
    assert_matches_hf(engine, model_dir, [shared + [5, 6, 7]])
    assert_matches_hf(engine, model_dir, [shared + [9] * 20, prompts[3]])  # a 96-token prefix hit, chunked
    assert engine.block_manager.prefix_cache_hits >= 96


ARCHITECTURES = {  # HF model type and config: each differs from Llama where the engine could go wrong
    "qwen3": ("qwen3", dict(head_dim=16)),  # QK-norm, a head size of its own
    "phi3": ("phi3", {}),  # fused qkv and gate_up projections
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # MoE blocks (HF's expert layers)
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64)),  # MoE with a shared expert, qkv biases
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "llama_tied_biased": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_more_architectures_match_hf(tmp_path, name):
    arch, overrides = ARCHITECTURES[name]
    model_dir = str(build_random_model(tmp_path / name, arch, seed=7, **overrides))
    # 48-token steps chunk the longer prompts; 20 blocks cannot hold the batch's 8 sequences at once: it preempts
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=20, max_num_batched_tokens=48))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = mixed_prompts(engine.runner.vocab_size, seed=8)
    assert_matches_hf(engine, model_dir, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    hits = engine.block_manager.prefix_cache_hits
    assert_matches_hf(engine, model_dir, [prompts[-1] + [7, 8, 9]], params)  # the 100-token prompt's blocks hit
    assert engine.block_manager.prefix_cache_hits - hits >= 96


@pytest.mark.parametrize("arch, overrides, expected", [
    ("mistral", {"sliding_window": 16}, 16),
    ("mistral", {"sliding_window": None}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, None),  # a global layer
    ("qwen2", {}, None),
    ("gemma2", {"sliding_window": 16}, None),  # alternating local and global layers
    ("gemma3_text", {"sliding_window": 16, "num_hidden_layers": 6}, None),
    ("llama", {}, None),
])
def test_blocks_are_given_back_only_when_every_layer_has_a_window(arch, overrides, expected):
    from engine.model_support import every_layer_window
    config = AutoConfig.for_model(arch, **{**SMALL, **overrides})
    assert every_layer_window(config) == expected


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "sdpa"])
def test_blocks_out_of_every_layers_window_are_given_back_and_outputs_stay_exact(windowed_dirs, kernels):
    """A Mistral-style model (window 16) decoding past its window holds ~3 blocks per sequence instead of all of
    them: a pool that preempts without it runs the batch without preempting, and every output equals HF's.
    Forked candidates (n=2) share the kept blocks; at the end every block is free."""
    model_dir = windowed_dirs["mistral"]

    def run(release: bool):
        engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=28, max_num_batched_tokens=32))
        if not kernels:
            engine.runner.paged_kernel = engine.runner.prefill_kernel = False
        if not release:
            engine.runner.release_window = None
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompts = mixed_prompts(engine.runner.vocab_size, seed=9)[1:7]  # 5..70 tokens, each past the window
        assert_matches_hf(engine, model_dir, prompts, params)
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return engine

    kept, released = run(False), run(True)
    assert kept.block_manager.window_released == 0 and released.block_manager.window_released >= 12
    assert kept.scheduler.num_preemptions > 0 and released.scheduler.num_preemptions < kept.scheduler.num_preemptions
    # n = 2 candidates fork from a prompt whose first blocks are given back already
    forks = Engine(EngineConfig(model=model_dir, num_kv_blocks=28))
    out = forks.generate([list(range(100, 160))], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=30))
    assert len(out) == 1 and forks.block_manager.window_released > 0
    assert forks.block_manager.num_free_blocks == forks.block_manager.num_blocks
