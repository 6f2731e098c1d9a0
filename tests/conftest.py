"""Shared fixtures: tiny random-weight models built once per session, and the default model."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TANDEM_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from engine.model_loader import build_random_model
    return str(build_random_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from engine.model_loader import build_random_model
    return str(build_random_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=1))


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.model_loader import default_model_dir
    return str(default_model_dir())


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    from engine import Engine, EngineConfig
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=256))
