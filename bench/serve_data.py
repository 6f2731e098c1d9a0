"""bench/serve.py's workloads: datasets of sessions and their arrival times. Pure functions, seeded.

A workload is a list of `Session`s. A session is one or more turns sent one after another (multi-turn
chat has several; every other dataset has one). Token-id prompts have exact lengths; chat turns are
text decoded from random token ids. Every dataset draws fresh tokens per seed, because the servers
under test cache prefixes: a second run with the same seed measures cache hits.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

DATASETS = ("random", "prefix-repetition", "multi-turn", "long-prompt-burst")


@dataclass(slots=True)
class Turn:
    """One request: token ids for /v1/completions, or a user message for /v1/chat/completions."""
    output_len: int
    prompt_token_ids: list[int] | None = None
    user_text: str | None = None
    prompt_len: int = 0  # exact for token ids; for chat, tokens drawn for the message (results take the server's count)

    @property
    def is_chat(self) -> bool:
        return self.user_text is not None


@dataclass(slots=True)
class Session:
    turns: list[Turn]
    kind: str = "default"  # groups results: "short"/"long" in long-prompt-burst, "prefix-3", ...
    with_previous: bool = False  # arrives together with the session before it (a burst)
    arrival: float = 0.0  # seconds after the run starts; set by assign_arrivals


@dataclass(slots=True)
class TokenSpace:
    """What the datasets need of a tokenizer: ids to draw from and a way to make text of them."""
    vocab_size: int
    special_ids: frozenset[int] = frozenset()
    decode: Callable[[list[int]], str] = lambda ids: " ".join(f"w{i}" for i in ids)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenSpace":
        return cls(len(tokenizer), frozenset(tokenizer.all_special_ids),
                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        ids = []
        while len(ids) < n:
            i = rng.randrange(self.vocab_size)
            if i not in self.special_ids:
                ids.append(i)
        return ids


def _len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in mean·[1 − range_ratio, 1 + range_ratio], at least 1 (vLLM's --random-range-ratio)."""
    lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def random_sessions(space: TokenSpace, num_prompts: int, input_len: int, output_len: int, seed: int,
                    range_ratio: float = 0.0) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_prompts):
        n = _len(rng, input_len, range_ratio)
        sessions.append(Session([Turn(_len(rng, output_len, range_ratio), space.sample(rng, n), prompt_len=n)]))
    return sessions


def prefix_repetition_sessions(space: TokenSpace, num_prompts: int, num_prefixes: int, prefix_len: int,
                               suffix_len: int, output_len: int, seed: int) -> list[Session]:
    """`num_prefixes` shared prefixes, each followed by its own unique suffixes, in shuffled order."""
    rng = random.Random(seed)
    prefixes = [space.sample(rng, prefix_len) for _ in range(num_prefixes)]
    sessions = []
    for i in range(num_prompts):
        p = i % num_prefixes
        ids = prefixes[p] + space.sample(rng, suffix_len)
        sessions.append(Session([Turn(output_len, ids, prompt_len=len(ids))], kind=f"prefix-{p}"))
    rng.shuffle(sessions)
    return sessions


def prefix_zipf_sessions(space: TokenSpace, num_prompts: int, num_prefixes: int, prefix_len: tuple[int, int],
                         question_len: int, output_len: int, zipf: float, seed: int,
                         warm_up: bool = False) -> list[Session]:
    """System prompts shared with Zipf popularity (issue 41): `num_prefixes` prefixes of lengths uniform in
    `prefix_len`, drawn from `seed` alone; `num_prompts` requests, each a prefix picked with weight 1 / rank**zipf
    and a fresh `question_len`-token question. `warm_up`: instead, each prefix once (least popular first, so the
    popular ones are the most recent in an LRU cache), as a deployment's steady state has seen them all."""
    rng = random.Random(seed)
    prefixes = [space.sample(rng, rng.randint(*prefix_len)) for _ in range(num_prefixes)]
    questions = random.Random(seed + 1 if not warm_up else seed - 1)
    if warm_up:
        picks = list(reversed(range(num_prefixes)))
    else:
        weights = [1 / (rank + 1) ** zipf for rank in range(num_prefixes)]
        picks = questions.choices(range(num_prefixes), weights, k=num_prompts)
    sessions = []
    for p in picks:
        ids = prefixes[p] + space.sample(questions, question_len)
        sessions.append(Session([Turn(output_len, ids, prompt_len=len(ids))], kind=f"prefix-{p}"))
    return sessions


def multi_turn_sessions(space: TokenSpace, num_prompts: int, turns: int, user_len: int, output_len: int,
                        seed: int) -> list[Session]:
    """Conversations of `turns` user messages; each turn is sent with the whole conversation so far.
    `num_prompts` counts turns (requests), so the last conversation may be shorter."""
    rng = random.Random(seed)
    sessions = []
    for start in range(0, num_prompts, turns):
        n = min(turns, num_prompts - start)
        sessions.append(Session([Turn(output_len, user_text=space.decode(space.sample(rng, user_len)),
                                      prompt_len=user_len) for _ in range(n)], kind="chat"))
    return sessions


def long_prompt_burst_sessions(space: TokenSpace, num_prompts: int, short_input_len: int, short_output_len: int,
                               long_input_len: int, long_output_len: int, burst_every: int, burst_size: int,
                               seed: int) -> list[Session]:
    """A steady stream of short requests; after every `burst_every` of them, `burst_size` long prompts
    arrive at once, at the moment of the last short one. `num_prompts` counts all requests."""
    rng = random.Random(seed)
    sessions: list[Session] = []
    shorts = 0
    while len(sessions) < num_prompts:
        if shorts and shorts % burst_every == 0 and sessions[-1].kind == "short":
            for _ in range(min(burst_size, num_prompts - len(sessions))):
                ids = space.sample(rng, long_input_len)
                sessions.append(Session([Turn(long_output_len, ids, prompt_len=len(ids))], kind="long",
                                        with_previous=True))
            continue
        ids = space.sample(rng, short_input_len)
        sessions.append(Session([Turn(short_output_len, ids, prompt_len=len(ids))], kind="short"))
        shorts += 1
    return sessions


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma with shape `burstiness` and mean 1/rate (burstiness 1 is Poisson,
    below 1 burstier, above 1 steadier, as in `vllm bench serve`); all zero at an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(n)]


def assign_arrivals(sessions: list[Session], request_rate: float, burstiness: float, seed: int) -> None:
    """Sets each session's arrival; a session `with_previous` arrives with the one before it.
    The first session arrives at once."""
    leaders = sum(not s.with_previous for s in sessions)
    gaps = iter(arrival_gaps(leaders, request_rate, burstiness, seed))
    t = 0.0
    for i, s in enumerate(sessions):
        if not s.with_previous:
            gap = next(gaps)
            t += gap if i else 0.0
        s.arrival = t
