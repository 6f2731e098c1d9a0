"""A large prompt's chat templating and tokenization run off the ingress's event loop: while one is under
way, another client's stream keeps getting its tokens. Shown by order of events, not by timing: the
tokenizer of the large prompt does not finish until the short stream has received more tokens, which
could never happen if the tokenizer held the event loop (it would wait out its deadline instead)."""
import asyncio
import json
import threading

from router.api.admission import Admission
from router.api.auth import Authenticator
from router.placement.latency_report import LatencyReporter
from router.metrics import Metrics
from router.api.openai_api import APIError
from router.placement.request_router import RequestRouter
from router.api.service import ModelInfo, OpenAIService
from tests.ingress.conftest import MODEL
from tests.pool_helpers import OneWorkerView

DEADLINE_S = 60.0


class GatedTokenizer:
    """The real tokenizer; rendering a conversation longer than `big` characters first announces itself
    (`started`) and then waits for `release`, recording whether it came before the deadline."""

    def __init__(self, tokenizer, big: int):
        self.tokenizer, self.big = tokenizer, big
        self.started, self.release = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None

    def apply_chat_template(self, messages, **kwargs):
        if sum(len(m["content"]) for m in messages) > self.big:
            self.started.set()
            self.released_in_time = self.release.wait(DEADLINE_S)
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_stream_keeps_its_tokens_while_a_huge_prompt_is_tokenized(pair_app, tokenizer):
    (decode,) = pair_app.actors().values()
    gated = GatedTokenizer(tokenizer, big=100_000)
    requests = RequestRouter(OneWorkerView(decode), Metrics(), LatencyReporter(controller=None))
    service = OpenAIService(ModelInfo(MODEL, tokenizer.vocab_size, 512, 0), gated, Authenticator({}),
                            Admission(8), requests, block_size=16)
    short = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum dolor " * 50_000}]}
    events = []

    async def main():
        response = await service.completions(json.dumps(short).encode(), None)
        chunks = response.body_iterator
        await anext(chunks)
        big = asyncio.ensure_future(service.chat(json.dumps(huge).encode(), None))
        await asyncio.to_thread(gated.started.wait, DEADLINE_S)
        events.append("tokenizing")
        for _ in range(5):
            await anext(chunks)
            events.append("chunk")
        gated.release.set()
        try:
            events.append(("big", (await big).status_code))
        except APIError as exc:  # what the route turns into an error response
            events.append(("big", exc.status))
        async for _ in chunks:
            pass
        await response.on_close()

    asyncio.run(main())
    assert gated.released_in_time is True
    # The huge conversation is over the context: 400 once tokenized, after the short stream moved on.
    assert events == ["tokenizing"] + ["chunk"] * 5 + [("big", 400)]
