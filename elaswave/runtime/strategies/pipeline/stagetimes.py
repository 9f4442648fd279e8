"""What a pipeline stage's layers cost in real steps (``layer_costs: online``).

During a step the stage times each layer's forward per micro-batch, each micro-batch's backward
through the whole stage and the emulated device time. At the end of the step the totals become
seconds per micro-batch per layer (:func:`~elaswave.planning.layercosts.stage_sample`: the
backward follows the forward times, the device time its own cost shares) and feed an
exponential moving average per layer. The worker reports the averages to its daemon every
``cost_every`` committed steps; the leader cuts the next plan with them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from elaswave.planning.layercosts import ema_update, stage_sample
from elaswave.runtime.timing import clock

EMA_WEIGHT = 0.3  # weight of the newest step: the average follows the last few steps


class StageTimer:
    """Per-step timings of one stage and the moving average of its layers' seconds."""

    def __init__(self, weight: float = EMA_WEIGHT) -> None:
        self.weight = weight
        self.average: dict[int, float] = {}  # layer -> seconds per micro-batch (fwd + bwd)
        self.layers: range = range(0)
        self._warm = False  # the first step on a new set of layers warms up: not counted
        self._forward: list[float] = []
        self._backward = 0.0
        self._pause = 0.0

    def begin(self, layers: range) -> None:
        """Start a step of a stage that runs ``layers``."""
        if layers != self.layers:
            self.layers, self._warm = layers, False
        self._forward = [0.0] * len(layers)
        self._backward = self._pause = 0.0

    @contextmanager
    def forward(self, layer: int) -> Iterator[None]:
        start = clock().now()
        yield
        self._forward[layer - self.layers.start] += clock().now() - start

    @contextmanager
    def backward(self) -> Iterator[None]:
        start = clock().now()
        yield
        self._backward += clock().now() - start

    @contextmanager
    def pause(self) -> Iterator[None]:
        start = clock().now()
        yield
        self._pause += clock().now() - start

    def end(self, microbatches: int, pause_weights: Sequence[float]) -> None:
        """The step ran ``microbatches``: fold its per-layer seconds into the average.
        ``pause_weights[j]`` is the share of the emulated device time the j-th layer stands for."""
        if microbatches < 1 or not self.layers:
            return
        if not self._warm:
            self._warm = True
            return
        sample = stage_sample(
            self._forward,
            self._backward,
            self._pause,
            pause_weights=pause_weights,
            microbatches=microbatches,
        )
        self.average = ema_update(
            self.average, dict(zip(self.layers, sample, strict=True)), weight=self.weight
        )

    def snapshot(self) -> dict[int, float]:
        """The current average of every layer this stage runs (empty before the first sample)."""
        return {i: x for i, x in self.average.items() if i in self.layers}
