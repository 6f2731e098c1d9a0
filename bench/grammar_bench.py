"""Per-token cost of grammar enforcement on this CPU: xgrammar, llguidance and outlines-core against
unconstrained sampling, at batch 1 and 32, on the default model's tokenizer and one JSON schema.

Each library runs the same valid JSON token sequence through one matcher per row; a step is matcher
advance + bitmask fill + bitmask apply on [batch, vocab] logits, and the baseline in the same run is
the engine's Sampler on the same logits. `--engine` then times `Engine.step` with 32 constrained
against 32 unconstrained decoding requests on the default model, two engines stepped in turn (what
enforcement costs per token end to end).

    .venv/bin/python bench/grammar_bench.py [--repeats N] [--engine [--steps N] [--model DIR]]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model_loader import default_model_dir, load_tokenizer  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace of the Analytical Engine", "age": 36, "email": "ada.lovelace@example.org",
            "tags": ["admin", "user"], "address": {"city": "London", "zip": "12345"}}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        self.vocab_size = vocab_size
        self.batch = xgr.BatchGrammarMatcher()

    def start(self, batch: int):
        self.matchers = [self.xgr.GrammarMatcher(self.compiled) for _ in range(batch)]
        self.bitmask = self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def step(self, logits: torch.Tensor, tokens: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask(self.matchers, self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)
        for m, t in zip(self.matchers, tokens):
            assert m.accept_token(t), "xgrammar rejected a token of the valid instance"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        from concurrent.futures import ThreadPoolExecutor
        self.llg, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()

    def start(self, batch: int):
        self.matchers = [self.llg.LLMatcher(self.tokenizer, self.grammar) for _ in range(batch)]
        self.bitmask = self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def step(self, logits: torch.Tensor, tokens: list[int]) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(self.matchers)],
                                             self.bitmask)
        self.llt.apply_token_bitmask_inplace(logits, self.bitmask)
        for m, t in zip(self.matchers, tokens):
            assert m.consume_token(t), "llguidance rejected a token of the valid instance"


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core
        import outlines_core.kernels.torch as okt
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.okt = outlines_core, okt
        vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, _byte_vocabulary(tokenizer))
        self.index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
        self.vocab_size = vocab_size

    def start(self, batch: int):
        self.guides = [self.oc.Guide(self.index) for _ in range(batch)]
        self.bitmask = self.okt.allocate_token_bitmask(self.vocab_size)
        self.bitmask = self.bitmask.repeat(batch, 1)

    def step(self, logits: torch.Tensor, tokens: list[int]) -> None:
        for i, g in enumerate(self.guides):  # outlines-core's kernels take one row at a time
            self.okt.fill_next_token_bitmask(g, self.bitmask[i:i + 1])
        self.okt.apply_token_bitmask_inplace(logits, self.bitmask)
        for g, t in zip(self.guides, tokens):
            g.advance(t)


def _byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token id -> its bytes, for a byte-level BPE tokenizer (GPT-2's byte-to-unicode table inverted),
    without the special tokens outlines-core must not see."""
    table = _bytes_to_unicode()
    decode = {c: b for b, c in table.items()}
    special = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        vocab.setdefault(bytes(decode[c] for c in token if c in decode), []).append(i)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def time_library(lib, sampler: Sampler, tokens: list[int], batch: int, vocab: int, repeats: int) -> tuple[float, float]:
    """(unconstrained sampler, enforcement) in ms per step, each the median over the instance's tokens
    (medians, since the machine is shared and one preempted step would swamp a mean)."""
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.0, max_tokens=None), 1024) for i in range(batch)]
    base, enforce = [], []
    for _ in range(repeats):
        lib.start(batch)
        for token in tokens:
            logits = torch.randn(batch, vocab)
            started = time.perf_counter()
            sampler(logits, reqs)
            mid = time.perf_counter()
            lib.step(logits, [token] * batch)
            base.append(mid - started)
            enforce.append(time.perf_counter() - mid)
    return 1000 * statistics.median(base), 1000 * statistics.median(enforce)


def bench_libraries(repeats: int) -> None:
    tokenizer = load_tokenizer(default_model_dir())
    vocab = len(tokenizer)
    tokens = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")))
    sampler = Sampler({tokenizer.eos_token_id})
    print(f"schema instance: {len(tokens)} tokens, vocab {vocab}, torch threads {torch.get_num_threads()}")
    print("| library | tokenizer + compile (ms) | batch | unconstrained sampler (ms/step) | enforcement (ms/step) | "
          "enforcement per token (us) | overhead vs sampler |")
    print("|---|---|---|---|---|---|---|")
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        started = time.perf_counter()
        lib = cls(tokenizer, vocab)
        compile_ms = 1000 * (time.perf_counter() - started)
        for batch in (1, 32):
            base, extra = time_library(lib, sampler, tokens, batch, vocab, repeats)
            print(f"| {lib.name} | {compile_ms:.0f} | {batch} | {base:.3f} | {extra:.3f} | "
                  f"{1000 * extra / batch:.1f} | {100 * extra / base:.0f}% |", flush=True)


def bench_engine(num_requests: int, steps: int, model: str) -> None:
    """Decode steps of `num_requests` requests on two engines of `model`, one constrained by
    SCHEMA and one not, stepped in turn so that the shared machine's noise falls on both alike."""
    from engine import Engine, EngineConfig
    config = EngineConfig(model=model, num_kv_blocks=512)
    prompt = "Describe a person as JSON with name, age, email, tags and address:"
    engines = {}
    for label, structured in (("unconstrained", None), ("json schema", StructuredOutputs(json=json.dumps(SCHEMA)))):
        engine = engines[label] = Engine(config)
        params = SamplingParams(temperature=0.8, seed=0, max_tokens=steps + 8, ignore_eos=structured is None,
                                structured=structured)
        for i in range(num_requests):
            engine.add_request(f"{i}", prompt, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()  # prefill (and the first tokens), not timed
    times: dict[str, list[float]] = {label: [] for label in engines}
    spent = _time_enforcement(engines["json schema"])
    for _ in range(steps):
        for label, engine in engines.items():
            spent[0] = 0.0
            started = time.perf_counter()
            outs = engine.step()
            if len(outs) == num_requests:  # every request decoded a token (none finished)
                times[label].append(time.perf_counter() - started)
                if label == "json schema":
                    times["enforcement"] = times.get("enforcement", []) + [spent[0]]
    for label in engines:
        samples = times[label]
        step = statistics.median(samples)
        print(f"Engine.step, {num_requests} {label} decoding requests: median {1000 * step:.1f} ms/step, "
              f"{1000 * step / num_requests:.2f} ms/token ({len(samples)} steps)", flush=True)
    base, constrained = (statistics.median(times[label]) for label in engines)
    inside = statistics.median(times["enforcement"])
    print(f"constrained against unconstrained step: {100 * (constrained - base) / base:+.1f}% per token; "
          f"time inside the constrained step spent on enforcement: {1000 * inside:.2f} ms "
          f"({100 * inside / base:.1f}% of the unconstrained step)")


def _time_enforcement(engine) -> list[float]:
    """Wrap the engine's bitmask fill, bitmask apply and matcher advance to add their time to a counter."""
    import engine.sampler as sampler_module
    import engine.structured as structured_module
    spent = [0.0]

    def timed(fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
        return run

    engine.structured.grammar_bitmask = timed(engine.structured.grammar_bitmask)
    sampler_module.apply_grammar_bitmask = timed(sampler_module.apply_grammar_bitmask)
    request_class = structured_module.StructuredOutputRequest
    request_class.accept_tokens = timed(request_class.accept_tokens)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", action="store_true", help="also time Engine.step at batch 32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default=None, help="the engine's model directory (default: the default model)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_libraries(args.repeats)
    if args.engine:
        bench_engine(32, args.steps, args.model or str(default_model_dir()))


if __name__ == "__main__":
    main()
