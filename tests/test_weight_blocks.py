"""Weights as shipped: finding the Q4_1/Q8_0 blocks fp32 weights were decoded from, packing them, and the
C kernel that computes decode-sized linears from them (engine/weight_blocks.py, engine/csrc/block_linear.c)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, SamplingParams, cpu_kernels, weight_blocks
from engine.cpu_layers import BLOCK_ROWS, BlockLinear, OneDNNLinear

KINDS = {weight_blocks.Q4_1: GGMLQuantizationType.Q4_1, weight_blocks.Q8_0: GGMLQuantizationType.Q8_0}
needs_kernel = pytest.mark.skipif(not cpu_kernels.blocks_available(), reason="block_linear needs AVX-512")


def shipped(shape: tuple[int, int], kind: int, seed: int = 0) -> torch.Tensor:
    """fp32 weights as transformers decodes them from a GGUF file: ggml's quantizer, then gguf's decoder."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(x, KINDS[kind]), KINDS[kind]).copy())


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_decoded_gguf_weights_are_found_and_packed_exactly(kind):
    w = shipped((96, 160), kind)
    packed, found = weight_blocks.pack(w)
    assert found == kind
    assert torch.equal(weight_blocks.unpack(packed, kind, 96, 160), w)
    assert packed.numel() == 96 * 160 * (320 if kind == weight_blocks.Q4_1 else 544) // 512


@needs_kernel
def test_weights_that_are_not_exactly_blocks_stay_dense():
    w = shipped((64, 64), weight_blocks.Q4_1)
    off = w.clone()
    off[40, 17] = torch.nextafter(off[40, 17], torch.tensor(1.0))  # one weight one ulp off, past the probe rows
    assert weight_blocks.pack(off) is None
    assert weight_blocks.pack(torch.randn(64, 64)) is None  # plain fp32
    assert weight_blocks.pack(w.to(torch.bfloat16)) is None  # only fp32 models
    assert weight_blocks.pack(shipped((48, 64), weight_blocks.Q4_1)) is None  # outputs not a multiple of 32
    assert weight_blocks.pack(torch.zeros(64, 64))[1] == weight_blocks.Q4_1  # constant blocks: d = 0


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_a_float64_matmul(kind, threads):
    n, k = 128, 192
    w = shipped((n, k), kind, seed=kind)
    packed, _ = weight_blocks.pack(w)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (0, 1, 3, 8, 9, 17, BLOCK_ROWS):  # across the kernel's passes of 8 rows
            wide = torch.randn(rows, k + 32)
            x = wide[:, 16:16 + k]  # rows further apart than their length
            out = torch.full((rows, n), float("nan"))
            cpu_kernels.block_linear(out, x, packed, kind)
            reference = x.double() @ w.double().T
            assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5), rows
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_kernel_refuses_shapes_it_cannot_tile():
    packed, kind = weight_blocks.pack(shipped((64, 64), weight_blocks.Q4_1))
    with pytest.raises(ValueError):
        cpu_kernels.block_linear(torch.empty(2, 48), torch.randn(2, 64), packed, kind)


@needs_kernel
def test_block_linear_hands_long_inputs_to_onednn_and_adds_the_bias():
    w = shipped((64, 96), weight_blocks.Q4_1)
    linear = torch.nn.Linear(96, 64)
    with torch.no_grad():
        linear.weight.copy_(w)
    module = BlockLinear(linear, *weight_blocks.pack(w))
    for rows in (0, 1, BLOCK_ROWS, BLOCK_ROWS + 1, 100):  # 0: a prefill chunk that samples nothing
        x = torch.randn(2, rows, 96)
        expected = torch.nn.functional.linear(x.double(), w.double(), linear.bias.double())
        assert torch.allclose(module(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def shipped_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny llama with every linear of its layers as Q4_1 blocks decoded, as a GGUF model loads."""
    import shutil
    out = tmp_path_factory.mktemp("models") / "tiny-llama-q4"
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    state = load_file(out / "model.safetensors")
    for i, (name, value) in enumerate(sorted(state.items())):
        if name.startswith("model.layers.") and value.dim() == 2:
            state[name] = shipped(tuple(value.shape), weight_blocks.Q4_1, seed=i)
    save_file(state, out / "model.safetensors")
    return str(out)


@needs_kernel
def test_engine_decodes_from_the_blocks_and_gives_the_dense_tokens(shipped_llama_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Steps of at most 32 tokens: the 70-token prompt's first chunks sample nothing (an LM head of 0 rows).
    blocks = Engine(EngineConfig(model=shipped_llama_dir, num_kv_blocks=128, dtype="float32",
                                 max_num_batched_tokens=32))
    dense = Engine(EngineConfig(model=shipped_llama_dir, num_kv_blocks=128, dtype="float32", weight_blocks=False,
                                max_num_batched_tokens=32))
    block_modules = [m for m in blocks.runner.model.modules() if isinstance(m, BlockLinear)]
    assert len(block_modules) == 4 * len(blocks.runner.model.model.layers)  # qkv, o, gate-up, down per layer
    assert not any(isinstance(m, BlockLinear) for m in dense.runner.model.modules())
    assert any(isinstance(m, OneDNNLinear) for m in dense.runner.model.modules())
    assert ([o.token_ids for o in blocks.generate(prompts, params)]
            == [o.token_ids for o in dense.generate(prompts, params)])


def test_random_models_keep_their_dense_linears(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, dtype="float32"))
    assert not any(isinstance(m, BlockLinear) for m in engine.runner.model.modules())
