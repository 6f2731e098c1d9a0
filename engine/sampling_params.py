"""Sampling parameters, with vLLM's names and semantics."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # each is matched against the text of every new token
# Below this a temperature is greedy, as in vLLM: dividing logits by it would overflow to inf.
SAMPLING_EPS = 1e-5
SEED_RANGE = (-2**63, 2**63 - 1)  # what torch.Generator.manual_seed takes, with room for seed + n
TOP_K_MAX = 2**31 - 1


def candidate_seed(seed: int, i: int) -> int:
    """Candidate i's seed: the request's seed + i, wrapped into the signed 64 bits a seed must fit."""
    return (seed + i + 2**63) % 2**64 - 2**63


def candidate_id(request_id: str, i: int) -> str:
    """The request id of candidate (or returned beam) i of a request with n > 1 or beam search."""
    return f"{request_id}-{i}"


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """A constraint on the output, enforced while decoding (vLLM's `StructuredOutputsParams`): exactly one
    of `json` (a JSON schema, as JSON text), `json_object` (any JSON object), `regex`, `choice` (one of the
    strings) or `grammar` (an EBNF grammar)."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError("structured outputs need exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {given or 'none'}", field="structured_outputs")

    @property
    def kind(self) -> str:
        """Which of the fields is the constraint."""
        return self._given()[0]

    def _given(self) -> list[str]:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return given + (["json_object"] if self.json_object else [])


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 (or below SAMPLING_EPS) means greedy; top_k<=0
    means no top-k. With `use_beam_search`, `best_of` (default n) beams are searched by cumulative logprob
    and the n best come back (engine/beam_search.py); the sampling fields then do not apply."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None
    max_reasoning_tokens: int | None = None  # thinking tokens between the model's markers (engine/reasoning.py)
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    # Speculative decoding for this request: None follows the engine's default, False opts out, True opts in.
    speculative: bool | None = None

    def __post_init__(self):
        # vLLM and OpenAI clients send null or a bare string as well as a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = self.stop or []
        self.stop_token_ids = self.stop_token_ids or []
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        """Check every field on its own (construction does; `check_vocab` adds what needs the model)."""
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} {message}", field=name)

        check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"must be an integer in [1, 128], got {self.n!r}")
        check(_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
              f"must be in [0, 100], got {self.temperature!r}")
        check(_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and -1 <= self.top_k <= TOP_K_MAX, "top_k",
              f"must be -1, 0 (disabled) or a positive integer up to {TOP_K_MAX}, got {self.top_k!r}")
        check(_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_num(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value!r}")
        check(_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
              f"must be in (0, 10], got {self.repetition_penalty!r}")
        check(self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
              "seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
              f"must be a positive integer, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              f"must be a non-negative integer, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        check(self.max_reasoning_tokens is None
              or (isinstance(self.max_reasoning_tokens, int) and self.max_reasoning_tokens >= 0),
              "max_reasoning_tokens", f"must be a non-negative integer, got {self.max_reasoning_tokens!r}")
        check(self.speculative is None or isinstance(self.speculative, bool), "speculative",
              f"must be true, false or null, got {self.speculative!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        self._validate_token_ids(None)
        self._validate_beam_search()

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids it names (stop_token_ids, logit_bias) exist in a vocabulary of `vocab_size`: what
        construction cannot check. The ingress checks it against the served model, an engine against its own."""
        self._validate_token_ids(vocab_size)

    def _validate_beam_search(self) -> None:
        if self.best_of is not None and not (isinstance(self.best_of, int) and self.n <= self.best_of <= 128):
            raise InvalidRequestError(f"best_of must be an integer in [n, 128], got {self.best_of!r}", field="best_of")
        if not _num(self.length_penalty) or abs(self.length_penalty) > 100:
            raise InvalidRequestError(f"length_penalty must be a number in [-100, 100], got {self.length_penalty!r}",
                                      field="length_penalty")
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise InvalidRequestError("best_of other than n needs use_beam_search", field="best_of")
            return
        unsupported = [name for name, on in (("stop", self.stop), ("stop_token_ids", self.stop_token_ids),
                                             ("logprobs", self.logprobs is not None), ("min_tokens", self.min_tokens),
                                             ("structured_outputs", self.structured),
                                             ("max_reasoning_tokens", self.max_reasoning_tokens is not None)) if on]
        if unsupported:
            raise InvalidRequestError(f"{unsupported[0]} is not supported with use_beam_search", field=unsupported[0])

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        in_vocab = (lambda t: isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size))
        if not all(in_vocab(t) for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids in the vocabulary, got {self.stop_token_ids}",
                                      field="stop_token_ids")
        for token, bias in (self.logit_bias or {}).items():
            if not in_vocab(token):
                raise InvalidRequestError(f"logit_bias key {token!r} is not a token id in the vocabulary",
                                          field="logit_bias")
            if not _num(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r}",
                                          field="logit_bias")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
