"""Speculative decoding: a proposer guesses a request's next tokens, the target model verifies them in one
packed forward, and only the tokens its own sampler agrees with are kept (speculator.py)."""
from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
