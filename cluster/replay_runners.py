"""Where `tandem replay` (cluster/replay.py) runs a record again: the offline engine on a model directory,
or a running server through its OpenAI API. Both answer the model revision, turn a supplied input into
token ids as the server did, and produce each choice's `Output` under the record's choice index."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from cluster.admin_client import AdminClient, CLIError
from router.api.audit import sampling_from_record


@dataclass(slots=True)
class Output:
    """One choice as the replay produced it; `token_ids` is None where the runner cannot see them (a server)."""
    text: str
    token_ids: list[int] | None
    finish_reason: str | None


def _params(record: dict, prompt: int):
    """The record's sampling parameters with the seed prompt `prompt` ran with."""
    if record["sampling"].get("max_reasoning_tokens") is not None:
        raise CLIError("this request had a reasoning budget (max_reasoning_tokens), which replay does not carry")
    params = sampling_from_record(record["sampling"])
    params.seed = record["prompts"][prompt]["seed"]
    return params


def _truncate(record: dict, ids: list[int]) -> list[int]:
    keep = record["options"].get("truncate_prompt_tokens")
    return ids[-keep:] if keep else ids


class OfflineRunner:
    """The engine on the model directory `model` (default: the one the record's server was configured
    with), with the record's dtype, block size and context limit."""

    def __init__(self, model: str | None, device: str | None, record: dict):
        from engine.model_loader import resolve_model_dir
        self.engine_options = record["engine"]
        try:
            self.model_dir = resolve_model_dir(model or self.engine_options.get("model"))
        except FileNotFoundError as exc:
            raise CLIError(f"{exc}; pass the model directory the record was served from with --model DIR") from None
        self.device = device or self.engine_options.get("device", "auto")
        self.where = str(self.model_dir)
        self._tokenizer = None

    def revision(self, record: dict) -> str:
        from engine.model_loader import model_revision
        return model_revision(self.model_dir)

    def tokenize(self, record: dict, given) -> list[int]:
        from router.api.service import render_chat
        if self._tokenizer is None:
            from engine.model_loader import load_tokenizer
            self._tokenizer = load_tokenizer(self.model_dir)
        options = record["options"]
        if isinstance(given, str):
            ids = self._tokenizer.encode(given, add_special_tokens=options.get("add_special_tokens", True))
        elif given and isinstance(given[0], int):
            ids = list(given)
        else:
            ids = render_chat(self._tokenizer, given, add_generation_prompt=options["add_generation_prompt"],
                              continue_final_message=options["continue_final_message"])
        return _truncate(record, ids)

    def generate(self, record: dict, inputs: list) -> dict:
        from engine import Engine, EngineConfig
        params = [_params(record, p) for p in range(len(inputs))]
        e = self.engine_options
        engine = Engine(EngineConfig(model=str(self.model_dir), dtype=e["dtype"], device=self.device,
                                     block_size=e["block_size"], max_model_len=e.get("max_model_len"),
                                     num_kv_blocks=self._num_blocks(record, inputs, params)))
        outputs = {}
        for p, out in enumerate(engine.generate([i.token_ids for i in inputs], params)):
            for j, cand in enumerate(out.candidates):
                outputs[p * params[p].n + j] = Output(cand.text, list(cand.token_ids), cand.finish_reason)
        return outputs

    def _num_blocks(self, record: dict, inputs: list, params: list) -> int:
        """Enough KV blocks for every sequence at its longest, and no more (the default 1 GB is a server's)."""
        from transformers import AutoConfig
        limit = getattr(AutoConfig.from_pretrained(self.model_dir), "max_position_embeddings", 2048)
        limit = min(record["engine"].get("max_model_len") or limit, limit)
        size = record["engine"]["block_size"]
        return 2 + sum(p.beam_width * math.ceil(min(limit, len(i.token_ids) + (p.max_tokens or limit)) / size)
                       for i, p in zip(inputs, params))


class ServerRunner:
    """A running tandem server (`url`, the OpenAI API's base without /v1), called with `api_key`
    (default TANDEM_API_KEY)."""

    def __init__(self, url: str, api_key: str | None):
        self.client = _APIClient(url, api_key or os.environ.get("TANDEM_API_KEY"), timeout_s=600)
        self.where = self.client.url
        self.model = None

    def revision(self, record: dict) -> str | None:
        cards = self.client.call("GET", "/v1/models").get("data", [])
        card = next((c for c in cards if c.get("id") == record["model"]["id"]), cards[0] if cards else {})
        self.model = card.get("id")
        return card.get("revision")

    def tokenize(self, record: dict, given) -> list[int]:
        options = record["options"]
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            body = {"prompt": given, "add_special_tokens": options.get("add_special_tokens", True)}
        else:
            body = {"messages": given, "add_generation_prompt": options["add_generation_prompt"],
                    "continue_final_message": options["continue_final_message"]}
        return _truncate(record, self.client.call("POST", "/tokenize", {"model": self.model, **body})["tokens"])

    def generate(self, record: dict, inputs: list) -> dict:
        outputs = {}
        for p, given in enumerate(inputs):
            params = _params(record, p)
            body = completion_body(params, self.model, given.token_ids)
            for choice in self.client.call("POST", "/v1/completions", body)["choices"]:
                outputs[p * params.n + choice["index"]] = Output(choice["text"], None, choice.get("finish_reason"))
        return outputs


class _APIClient(AdminClient):
    """The server's OpenAI API with an API key; errors say what to pass."""

    def _explain(self, status: int, message: str | None) -> str:
        if status == 401:
            return f"{self.url} rejected the API key; pass one with --api-key KEY or TANDEM_API_KEY"
        return f"{self.url} answered {status}: {message or 'no details'}"


def completion_body(params, model: str | None, prompt: list[int]) -> dict:
    """A /v1/completions body that runs `prompt` with `params` (SamplingParams) as the record had them."""
    body = {"model": model, "prompt": prompt, "n": params.n, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty, "seed": params.seed, "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens, "stop": params.stop, "stop_token_ids": params.stop_token_ids,
            "ignore_eos": params.ignore_eos, "include_stop_str_in_output": params.include_stop_str_in_output,
            "skip_special_tokens": params.skip_special_tokens, "use_beam_search": params.use_beam_search,
            "length_penalty": params.length_penalty}
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.best_of is not None:
        body["best_of"] = params.best_of
    if (s := params.structured) is not None:
        body["structured_outputs"] = {s.kind: list(s.choice) if s.kind == "choice" else getattr(s, s.kind)}
    return body
