"""The zero-invariant groups of a module: the graph walk (:mod:`~elaswave.prune.graph`) with
its rules, those of operations (:mod:`~elaswave.prune.rules`) and those of layers with
parameters (:mod:`~elaswave.prune.layers`).

The walk knows nothing of the rules and the rules of operations nothing of the layers' rules:
each is told the next one here, so that the three modules import one another in one direction
only (graph ← rules ← layers ← this module).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from elaswave.prune import graph
from elaswave.prune.layers import rule_of
from elaswave.prune.rules import step_node

__all__ = ["analyse"]


def analyse(model: nn.Module, example: tuple[Any, ...], **options: Any) -> graph.Analysis:
    """:func:`elaswave.prune.graph.analyse` with every rule (``options``: its keywords)."""
    step = functools.partial(step_node, layer_rule=rule_of)
    return graph.analyse(model, example, step=step, **options)
