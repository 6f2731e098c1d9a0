"""Where greedy output with speculation on parts from the output without it, per precision (issue 38).

    .venv/bin/python bench/spec_precision.py --dtype bfloat16 float32 [--max-tokens 200] [--k 4]

One chat prompt on the default model (SmolLM2), offline engine, prompt-lookup speculation. In fp32 the two
are equal token for token; in bf16 a verification of k+1 tokens rounds differently from k+1 single steps,
so they part at the first near-tie (README "Precision")."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.spec_decode import SpeculativeConfig  # noqa: E402

MESSAGES = [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}]


def first_difference(dtype: str, max_tokens: int, k: int) -> tuple[int | None, int]:
    """(index of the first token where the two outputs differ, or None; tokens compared)."""
    outputs = []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=k)):
        engine = Engine(EngineConfig(dtype=dtype, speculative_config=spec))
        prompt = engine.apply_chat_template(MESSAGES)
        outputs.append(engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].token_ids)
    plain, speculated = outputs
    return next((i for i, (a, b) in enumerate(zip(plain, speculated)) if a != b), None), min(map(len, outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args()
    for dtype in args.dtype:
        index, compared = first_difference(dtype, args.max_tokens, args.k)
        print(f"{dtype}: {compared} tokens compared; "
              + ("all equal" if index is None else f"first difference at token {index}"))


if __name__ == "__main__":
    main()
