"""Input processing: what a client sends becomes an engine Request (vLLM v1's Processor). Tokenizes the prompt,
checks it and its sampling parameters against the model and the KV pool (raising InvalidRequestError naming
the field), and builds the request: its seeded generator, grammar, speculation state, and for n > 1 or beam
search the candidates or first beam it forks into."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.beam_search import BeamSearch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.reasoning import ReasoningMarkers
from engine.request import Request
from engine.sampling_params import SamplingParams, candidate_id, candidate_seed
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.state import SpecState, new_spec_state
from engine.structured import StructuredOutputManager
from engine.timeline import RequestTimeline


class InputProcessor:
    """Builds validated requests; queues nothing (Engine.add does)."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int, device,
                 block_manager: BlockManager, structured: StructuredOutputManager, eos_token_ids: set[int],
                 reasoning_markers: ReasoningMarkers | None):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        self.block_manager = block_manager
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.reasoning_markers = reasoning_markers
        self.seeds = torch.Generator().manual_seed(config.seed)  # a request without a seed draws one here

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError("prompt token ids must be a non-empty list of ids in the vocabulary",
                                      field="prompt")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     cache_salt: str | None = None, output_token_ids: Sequence[int] = (),
                     timeline: RequestTimeline | None = None) -> Request:
        """Validate and build a request (Engine.make_request says what `output_token_ids` and `timeline`
        are)."""
        self._check_params(params, output_token_ids)
        prompt_ids = self.tokenize(prompt)
        max_tokens = self._max_tokens(prompt_ids, params)
        self._check_reasoning(params)
        self._check_output_ids(output_token_ids, max_tokens)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seeds))
        timeline = timeline or RequestTimeline(request_id)  # one per prompt: its candidates and beams share it
        if params.use_beam_search:
            return self._first_beam(request_id, prompt_ids, params, max_tokens, cache_salt, timeline)
        if params.n > 1:
            return self._candidates(request_id, prompt_ids, params, max_tokens, cache_salt, seed, timeline)
        structured = None if params.structured is None else self.structured.request(params.structured)
        return Request(request_id, prompt_ids, params, max_tokens, cache_salt, self._generator(params, seed),
                       all_token_ids=[*prompt_ids, *output_token_ids], structured_output_request=structured,
                       spec=self._spec_state(params), timeline=timeline)

    def _generator(self, params: SamplingParams, seed: int) -> torch.Generator | None:
        """The seeded generator a request samples from; None for greedy."""
        return None if params.greedy else torch.Generator(self.device).manual_seed(seed)

    def _check_params(self, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        params.check_vocab(self.vocab_size)
        if (params.n > 1 or params.use_beam_search) and output_token_ids:
            raise InvalidRequestError("a migrated request is one candidate; send it with n=1", field="n")
        if params.n > 1 and (params.structured is not None or params.max_reasoning_tokens is not None):
            raise InvalidRequestError("forked candidates carry no grammar or reasoning budget of their own yet: "
                                      "send n requests of one candidate (the ingress does)", field="n")

    def _check_reasoning(self, params: SamplingParams) -> None:
        if params.max_reasoning_tokens is None:
            return
        if self.reasoning_markers is None:
            raise InvalidRequestError("max_reasoning_tokens needs a model that thinks between markers; this "
                                      "engine has no reasoning_markers configured", field="max_reasoning_tokens")
        if params.structured is not None:
            raise InvalidRequestError("max_reasoning_tokens cannot be combined with structured outputs",
                                      field="max_reasoning_tokens")

    def _max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens (the room left in the context window when not given), checked to fit."""
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; the context window is "
                                      f"{self.max_model_len}, leaving no room to generate", field="prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(f"max_tokens={params.max_tokens} does not fit: prompt has {len(prompt_ids)} "
                                      f"tokens and the context window is {self.max_model_len}", field="max_tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        bm = self.block_manager
        if bm.blocks_needed(len(prompt_ids) + max_tokens) > bm.num_blocks:
            raise InvalidRequestError(f"prompt + max_tokens needs more KV blocks than this worker has "
                                      f"({bm.num_blocks} x {self.config.block_size} tokens)", field="max_tokens")
        return max_tokens

    def _check_output_ids(self, output_token_ids: Sequence[int], max_tokens: int) -> None:
        if output_token_ids and (len(output_token_ids) >= max_tokens
                                 or not all(0 <= t < self.vocab_size for t in output_token_ids)):
            raise InvalidRequestError(f"output_token_ids must be fewer than max_tokens={max_tokens} token ids "
                                      f"below {self.vocab_size}", field="output_token_ids")

    def _spec_state(self, params: SamplingParams) -> SpecState | None:
        """A one-candidate request speculates when it asks to, or when the engine's config does by default
        and it does not opt out; requests with a reasoning budget do not (their logits are forced)."""
        config = self.config.speculative_config
        wanted = params.speculative if params.speculative is not None else (
            config is not None and config.enabled_by_default)
        if not wanted or params.max_reasoning_tokens is not None:
            return None
        return new_spec_state(config or SpeculativeConfig())

    def _candidates(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                    cache_salt: str | None, seed: int, timeline: RequestTimeline) -> Request:
        """The first of n candidates, the others pending on it; candidate i draws from candidate_seed(seed, i)."""
        candidates = []
        for i in range(params.n):
            p = replace(params, n=1, seed=candidate_seed(seed, i))
            candidates.append(Request(candidate_id(request_id, i), prompt_ids, p, max_tokens, cache_salt,
                                      self._generator(p, p.seed), index=i, timeline=timeline))
        candidates[0].pending_forks = candidates[1:]
        return candidates[0]

    def _first_beam(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                    cache_salt: str | None, timeline: RequestTimeline) -> Request:
        """The first beam of a new search, which answers under `candidate_id(request_id, i)`."""
        search = BeamSearch(request_id, len(prompt_ids), params.beam_width, params.n, params.length_penalty,
                            frozenset(self.eos_token_ids))
        root = Request(search.next_beam_id(), prompt_ids, params, max_tokens, cache_salt, beam_search=search,
                       timeline=timeline)
        search.beams = [root]
        return root


def prompt_batch(prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                 ) -> list[tuple[str | Sequence[int], SamplingParams]]:
    """Engine.generate's prompts (one prompt, or a list) each with its sampling params (one for all, or one each)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params = sampling_params or SamplingParams()
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params",
                                  field="sampling_params")
    return list(zip(prompts, params_list))
