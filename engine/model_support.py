"""What the engine cannot run exactly yet, read from a model's HF config before any weight is loaded.

The paged attention (engine/attention.py and the C kernels) computes causal attention over every earlier
token, or over a sliding window of them where a layer has one (Mistral, Qwen2's optional window, Gemma's
local layers), with the model's scaling and Gemma 2's logit soft-capping. A model whose attention differs
otherwise — chunked attention (Llama 4) — would run and answer, but wrongly. Such a model is refused at start,
naming the feature, as vLLM refuses what its backends lack. Features the model's own forward applies
outside attention (final logit soft-capping, QK-norm, biases, tied heads) need nothing here.
"""
from __future__ import annotations

from pathlib import Path


class UnsupportedModelError(ValueError):
    """The model needs an attention feature the engine does not implement."""


def unsupported_features(hf_config) -> list[str]:
    """Each attention feature of this config that the engine would silently ignore, described for a user."""
    features = []
    chunk = getattr(hf_config, "attention_chunk_size", None)
    if chunk is not None:
        features.append(f"chunked local attention ({chunk} tokens)")
    return features


def every_layer_window(hf_config) -> int | None:
    """The sliding window when every layer has one (Mistral; Qwen2 with all layers windowed): tokens that fall
    out of it are never attended again, so their blocks can be given back. None when some layer attends
    everything (Llama; Gemma's and Qwen2's global layers)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return window if all(t == "sliding_attention" for t in types) else None
    return None if getattr(hf_config, "use_sliding_window", True) is False else window


def check_supported(hf_config, name: str) -> None:
    """Raise UnsupportedModelError naming every feature of `hf_config` the engine cannot run exactly."""
    features = unsupported_features(hf_config)
    if features:
        arch = ", ".join(getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])
        raise UnsupportedModelError(
            f"model {name} ({arch}) uses {' and '.join(features)}, which tandem's paged attention does not "
            f"implement yet; refusing to serve it rather than answer wrongly")


def check_model_dir(model_dir: str | Path) -> None:
    """check_supported on a model directory's config.json (no weights read)."""
    from transformers import AutoConfig
    check_supported(AutoConfig.from_pretrained(model_dir), str(model_dir))
