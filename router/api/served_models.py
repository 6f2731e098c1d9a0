"""Several models behind one API (ClusterConfig.models): each model is an OpenAIService over its own pools, and
a request goes to the one whose model, alias or LoRA adapter its `model` names; /v1/models lists them all."""
from __future__ import annotations

import json

from router.api.openai_api import APIError
from router.api.openai_responses import ModelCard, ModelList
from router.api.request_trace import Trace
from router.api.service import OpenAIService


class ServedModels:
    """The OpenAIService interface the HTTP layer calls, over one service per model."""

    def __init__(self, services: list[OpenAIService]):
        self.services = services
        first = services[0]
        self.auth, self.model, self.tokenizer = first.auth, first.model, first.tokenizer  # API keys are shared

    def pick(self, model: str) -> OpenAIService:
        """The service serving `model` (a model's name or alias, or one of its adapters); 404 naming all."""
        for service in self.services:
            if model in service.model.names or model in service.adapters():
                return service
        served = ", ".join(f"`{n}`" for s in self.services for n in (*s.model.names, *sorted(s.adapters())))
        raise APIError(404, f"the model `{model}` does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def pick_body(self, body: bytes) -> OpenAIService:
        """The service a request body's `model` names; a body without a readable one goes to the first model,
        whose parsing answers it with the precise 400."""
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return self.services[0]
        return self.pick(model) if isinstance(model, str) else self.services[0]

    async def completions(self, body: bytes, authorization: str | None, trace: Trace | None = None):
        self.auth.tenant(authorization)  # the key first: a stranger learns nothing of the models
        return await self.pick_body(body).completions(body, authorization, trace)

    async def chat(self, body: bytes, authorization: str | None, trace: Trace | None = None):
        self.auth.tenant(authorization)
        return await self.pick_body(body).chat(body, authorization, trace)

    def models(self, authorization: str | None) -> ModelList:
        return ModelList(data=[card for s in self.services for card in s.models(authorization).data])

    def model_card(self, model: str, authorization: str | None) -> ModelCard:
        self.auth.tenant(authorization)
        return self.pick(model).model_card(model, authorization)

    def check_model(self, model: str):
        return self.pick(model).check_model(model)
