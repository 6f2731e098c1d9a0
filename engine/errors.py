"""Errors the engine raises to its callers; each names what to fix. Also the one reading of a
pydantic validation error into the field it names, which every API and the config share."""
from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run as given; `field` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field



class WorkerStalled(RuntimeError):
    """The worker answers calls but its engine loop has made no progress for too long: it is stuck."""


class RankFailed(RuntimeError):
    """A collective of a tensor-parallel engine's ranks failed: one of them is gone (or stuck past the timeout);
    the engine can run no step again."""


class WorkerRankLost(WorkerStalled):
    """A tensor-parallel worker answers calls but one of its ranks has exited: it can run no step, so the
    controller restarts it as it does a stuck one (its streams migrate)."""


@dataclass(frozen=True)
class FieldError:
    """One problem pydantic found: where (`loc`, each part a string), what (`message`), its `type`."""
    loc: tuple[str, ...]
    message: str
    type: str

    @property
    def path(self) -> str:
        """The dotted location (`pools.decode.replicas`); "" for a problem of the whole model."""
        return ".".join(self.loc)


def first_field_error(exc, root: str | None = None) -> FieldError:
    """The first error of a pydantic `ValidationError` (or of anything with its `.errors()`, such as
    FastAPI's `RequestValidationError`). `root`, when given, is dropped from the front of the
    location: FastAPI puts "body" there, which names no field of the request."""
    first = exc.errors()[0]
    loc = tuple(str(part) for part in first["loc"])
    if root is not None and loc[:1] == (root,):
        loc = loc[1:]
    return FieldError(loc, first["msg"], first["type"])
