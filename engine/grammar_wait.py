"""Constrained requests held back from scheduling while their grammar compiles on the structured output
manager's thread (vLLM's WAITING_FOR_FSM), so the step loop never waits for a compile."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputManager

if TYPE_CHECKING:
    from engine.request import Request


class GrammarWaitList:
    """The requests whose grammar still compiles, in arrival order."""

    def __init__(self, manager: StructuredOutputManager):
        self.manager = manager
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, req: Request) -> None:
        self.requests.append(req)

    def discard(self, req: Request) -> None:
        if req in self.requests:
            self.requests.remove(req)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, InvalidRequestError]]]:
        """The requests whose grammar is compiled and allows the tokens they already have (replayed into it),
        and, with the error, those whose grammar did not compile or does not allow those tokens."""
        ready, failed = [], []
        for req in [r for r in self.requests if r.structured_output_request.ready]:
            self.requests.remove(req)
            try:
                if not req.structured_output_request.accept_tokens(req.output_token_ids):
                    raise InvalidRequestError("output_token_ids do not follow the request's structured output",
                                              field="output_token_ids")
            except InvalidRequestError as exc:
                failed.append((req, exc))
                continue
            ready.append(req)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until one grammar is ready or `timeout` seconds pass (the engine has nothing else to run)."""
        self.manager.wait_any([r.structured_output_request for r in self.requests], timeout)
