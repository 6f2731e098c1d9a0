"""Streamed text split at a start and an end marker, whatever the chunks: a chunk that ends in what may
be the beginning of a marker keeps that part back until the next chunk says whether it is one."""
from __future__ import annotations


class MarkerScanner:
    """`feed` returns events in order: ("out", text) outside the markers, ("start", ""), ("in", text) between
    them, ("end", ""). With `once`, text after the first end marker is all "out", unscanned; `inside` starts
    between the markers (a prompt that opened them)."""

    def __init__(self, start: str, end: str, inside: bool = False, once: bool = False):
        self.start, self.end, self.inside, self.once = start, end, inside, once
        self.held = ""
        self.closed = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        text, self.held = self.held + text, ""
        events = []
        while text:
            if self.closed:
                return events + [("out", text)]
            marker, kind = (self.end, "in") if self.inside else (self.start, "out")
            at = text.find(marker)
            if at == -1:
                keep = partial_suffix(text, marker)
                if len(text) > keep:
                    events.append((kind, text[:len(text) - keep]))
                self.held = text[len(text) - keep:]
                break
            if at:
                events.append((kind, text[:at]))
            events.append(("end" if self.inside else "start", ""))
            self.closed = self.inside and self.once
            self.inside = not self.inside
            text = text[at + len(marker):]
        return events

    def flush(self) -> list[tuple[str, str]]:
        """The text kept back, once no more comes: it was no marker."""
        text, self.held = self.held, ""
        return [("in" if self.inside else "out", text)] if text else []


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0 when none does)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
