"""A workload on a small real data set: scikit-learn's handwritten digits (8 × 8 images, 10
classes, 1,797 samples, shipped inside the package: nothing is downloaded), classified by an MLP.

The samples are split once by a seeded permutation: the last ``test`` of them are held out
(:func:`held_out`), the rest are the training set the runtime indexes. ``python -m bench
prune`` trains it dense and pruned and compares their test accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elaswave import TensorSpec, Workload

TEST = 360  # held-out samples (20 %)


def _digits(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Every sample (features scaled to [0, 1]) and label, in a seeded order."""
    from examples.own_model import load_digits

    pixels, target = load_digits()
    order = np.random.default_rng([seed, 7]).permutation(len(target))
    return (pixels[order] / 16.0).astype(np.float32), target[order].astype(np.int64)


def held_out(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out images and labels (never trained on)."""
    x, y = _digits(seed)
    return torch.from_numpy(x[-TEST:]), torch.from_numpy(y[-TEST:])


class Digits:
    def __init__(self, seed: int) -> None:
        x, y = _digits(seed)
        self.x, self.y = x[:-TEST], y[:-TEST]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.x[i]), int(self.y[i])


class DigitsMLP(Workload):
    """[Linear(64, hidden) → ReLU] × depth, then Linear(hidden, 10)."""

    def __init__(self, *, hidden: int, depth: int) -> None:
        self.hidden, self.depth = hidden, depth

    @property
    def num_layers(self) -> int:
        return self.depth + 1

    def build_layer(self, index: int, seed: int) -> nn.Module:
        if index == self.depth:
            return nn.Linear(self.hidden, 10)
        return nn.Sequential(nn.Linear(64 if index == 0 else self.hidden, self.hidden), nn.ReLU())

    def dataset(self, seed: int) -> Digits:
        return Digits(seed)

    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        return TensorSpec((micro_batch_size, 10 if index == self.depth else self.hidden))

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        return F.cross_entropy(output, targets, reduction="sum"), int(targets.shape[0])


def digits_mlp(hidden: int = 128, depth: int = 2) -> DigitsMLP:
    """The factory a config names: ``model.factory: "examples.digits:digits_mlp"``."""
    return DigitsMLP(hidden=hidden, depth=depth)
