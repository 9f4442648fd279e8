"""Structured pruning during training: zero-invariant groups, DHSPG, compression.

``ZIG(model, example_inputs)`` gives any module's zero-invariant groups outside a run
(:mod:`elaswave.prune.zig`)."""

from __future__ import annotations

from typing import Any

__all__ = ["ZIG"]


def __getattr__(name: str) -> Any:
    if name == "ZIG":  # imported on use: the package's other modules do not need torch.fx
        from elaswave.prune.zig import ZIG

        return ZIG
    raise AttributeError(name)
