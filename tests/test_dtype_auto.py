"""`dtype: auto`, the default: bfloat16 on CUDA; on CPU bfloat16 where the CPU multiplies it natively, else
float32 (TANDEM_CPU_AUTO_DTYPE overrides; the suite pins float32), resolved once in engine/config.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.cli import build_parser
from cluster.config import ClusterConfig, PoolConfig
from engine import Engine, SamplingParams, cpu_kernels
from engine import config as engine_config
from engine.config import CPU_AUTO_DTYPE_ENV, EngineConfig, resolve_dtype
from engine.model_loader import load_model
from engine.cpu_layers import OneDNNLinear


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_auto_is_float32_on_cpu_as_the_suite_pins_it(device):
    assert resolve_dtype("auto", device) == "float32"


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_cpu_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch, native, expected):
    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == "float32"  # an explicit dtype wins
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "half")
    with pytest.raises(ValueError, match=CPU_AUTO_DTYPE_ENV):
        resolve_dtype("auto", "cpu")


def test_an_engine_runs_bfloat16_on_cpu(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, dtype="bfloat16", device="cpu"))
    assert engine.runner.layout.dtype == "bfloat16" and engine.kv_cache.k[0].dtype == torch.bfloat16
    assert engine.runner.paged_kernel  # the C decode kernel reads the bf16 cache in place
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(5, 40)), list(range(50, 61))]
    if not cpu_kernels.onednn_packs_bf16():  # e.g. AVX2 only: torch's own bf16 linears, HF's layers
        assert engine.runner.fused_layers == 0
        first = [out.token_ids for out in engine.generate(prompts, params)]
        assert [len(ids) for ids in first] == [12, 12]
        return
    # Its linears are oneDNN's with prepacked bf16 weights, computing what torch's own bf16 linear does.
    packed = engine.runner.model.model.layers[0].down_proj
    assert isinstance(packed, OneDNNLinear)
    hf = load_model(Path(tiny_llama_dir), torch.bfloat16, torch.device("cpu"), "sdpa")
    x = torch.randn(5, packed.in_features, dtype=torch.bfloat16)
    reference = hf.model.layers[0].mlp.down_proj(x)
    assert engine.runner.fused_layers == len(hf.model.layers)
    assert packed(x).dtype == torch.bfloat16
    assert torch.allclose(packed(x).float(), reference.float(), rtol=0.02, atol=0.02)
    first = [out.token_ids for out in engine.generate(prompts, params)]
    assert [len(ids) for ids in first] == [12, 12]
    assert [out.token_ids for out in engine.generate(prompts, params)] == first  # prefix-cached rerun


def test_a_bfloat16_engine_on_a_cpu_without_onednn_bf16_keeps_torchs_linears(tiny_llama_dir, monkeypatch):
    """oneDNN's bf16 linears need AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU packing them raised at
    load time. There the model keeps torch's own bf16 linears and HF's layers, and serves."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma", "f16c"}))
    assert not cpu_kernels.onednn_packs_bf16()
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, dtype="bfloat16", device="cpu"))
    assert engine.runner.fused_layers == 0
    assert type(engine.runner.model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    out = engine.generate([list(range(5, 40))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_auto_is_bfloat16_on_cuda(device):
    assert resolve_dtype("auto", device) == "bfloat16"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_every_device(dtype, device):
    assert resolve_dtype(dtype, device) == dtype


def test_engine_and_cluster_configs_default_to_auto():
    assert EngineConfig().dtype == "auto"
    config = ClusterConfig()
    assert config.dtype == "auto"
    assert config.engine_config(PoolConfig()).dtype == "auto"


def test_engine_config_resolves_auto_on_cpu_to_float32():
    config = EngineConfig(device="cpu")
    assert (config.resolved_dtype, config.torch_dtype) == ("float32", torch.float32)


def test_engine_runs_and_reports_the_resolved_dtype_by_default(tiny_engine):
    expected = {"cpu": "float32", "cuda": "bfloat16"}[tiny_engine.runner.device.type]
    assert tiny_engine.config.dtype == "auto"
    assert tiny_engine.runner.layout.dtype == expected
    assert tiny_engine.kv_cache.k[0].dtype == next(tiny_engine.runner.model.parameters()).dtype == getattr(torch, expected)


def test_serve_accepts_dtype_auto():
    assert build_parser().parse_args(["serve", "--dtype", "auto"]).dtype == "auto"
