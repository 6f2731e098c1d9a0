"""Errors the engine raises to its callers; each names what to fix."""


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run as given; `field` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
