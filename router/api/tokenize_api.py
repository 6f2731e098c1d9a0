"""vLLM's utility endpoints beside the OpenAI API: /tokenize and /detokenize with vLLM's bodies.

/tokenize takes a completion's `prompt` (text or token ids) or a chat's `messages` (rendered through the
chat template with the same controls as chat completions) and answers the token ids the server would run;
/detokenize turns token ids back into text. Both follow the API-key rule, are admitted like generation
requests and tokenize on the tokenizer pool, off the event loop.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from router.api.openai_api import APIError, ChatTemplateControls, parse_body
from router.api.service import OpenAIService, render_chat


class TokenizeRequest(ChatTemplateControls):
    """POST /tokenize: exactly one of `prompt` and `messages`."""
    model: str | None = None
    prompt: str | list[int] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(service: OpenAIService, body: bytes, authorization: str | None) -> TokenizeResponse:
    service.auth.tenant(authorization)
    req = parse_body(TokenizeRequest, body)
    if req.model is not None:
        service.check_model(req.model)
    options = req.template_options() if req.messages is not None else None

    def run() -> list[int]:
        if options is None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            return service.prompt_ids(req.prompt, add_special)
        messages = req.template_messages()
        if not req.add_special_tokens:
            return render_chat(service.tokenizer, messages, **options)
        return service.tokenizer.encode(render_chat(service.tokenizer, messages, tokenize=False, **options))

    with service.admission.acquire(1):
        ids = await service.tokenizers.run(run)
    strs = service.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=service.model.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(service: OpenAIService, body: bytes, authorization: str | None) -> DetokenizeResponse:
    service.auth.tenant(authorization)
    req = parse_body(DetokenizeRequest, body)
    if req.model is not None:
        service.check_model(req.model)
    vocab = service.model.vocab_size
    if not all(0 <= t < vocab for t in req.tokens):
        raise APIError.bad_request(f"tokens must be token ids in [0, {vocab})", "tokens")
    with service.admission.acquire(1):
        return DetokenizeResponse(prompt=await service.tokenizers.run(service.tokenizer.decode, req.tokens))
