"""How far off a kind of first-token prediction comes, measured on the requests it placed or admitted.

Shedding (router/api/flow_control.py) scales its predictions by a high quantile of these errors; placement
scales its prediction of a decode worker's chunked local prefill beside running streams by their median
(`Router.local_factor`): that prediction is made from the worker's step costs as they were, and under load
streams join and chunks shrink faster than it counts (measured ÷ predicted had a median of 1.2-1.8 there,
the remote path's 0.9-1.2), so a prompt placed locally because it looked sooner crawled instead.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class PredictionErrors:
    """The ratios of measured to predicted seconds of the last `window` samples (those of the last
    `horizon_s`, when given, so that a factor learnt under a past load wears off). `factor(q)`, their
    q-quantile within BOUNDS, scales the next prediction; with fewer than `min_samples` it is 1."""

    MIN_SAMPLES = 20  # shedding's: before, the prediction counts as is
    MIN_PREDICTED_S = 0.05  # shorter predictions say nothing of a queue's or a chunking's error
    BOUNDS = (0.25, 4.0)  # the factor's range: a few outliers must not shut or open a path

    def __init__(self, window: int = 256, min_samples: int = MIN_SAMPLES, horizon_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (when, measured ÷ predicted)
        self.min_samples, self.horizon_s, self.clock = min_samples, horizon_s, clock

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s >= self.MIN_PREDICTED_S and measured_s > 0:
            self.samples.append((self.clock(), measured_s / predicted_s))

    @property
    def ratios(self) -> list[float]:
        if self.horizon_s is not None:
            oldest = self.clock() - self.horizon_s
            while self.samples and self.samples[0][0] < oldest:
                self.samples.popleft()
        return [ratio for _, ratio in self.samples]

    def factor(self, quantile: float | None) -> float:
        ratios = self.ratios
        if quantile is None or len(ratios) < self.min_samples:
            return 1.0
        ordered = sorted(ratios)
        value = ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]
        return min(max(value, self.BOUNDS[0]), self.BOUNDS[1])
