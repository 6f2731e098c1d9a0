"""`dtype: auto`, the default: bfloat16 on CUDA, float32 on CPU, resolved once in engine/config.py."""
from __future__ import annotations

import pytest
import torch

from cluster.cli import build_parser
from cluster.config import ClusterConfig, PoolConfig
from engine.config import EngineConfig, resolve_dtype


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_auto_is_float32_on_cpu(device):
    assert resolve_dtype("auto", device) == "float32"


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
