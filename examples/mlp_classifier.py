"""A workload written only against ElasWave's public seam: an MLP classifier on seeded synthetic
data, with ``nn.Dropout`` inside its layers.

Train it with ``elaswave launch examples/mlp.yaml`` from the repository root (the factory is
imported as ``examples.mlp_classifier:mlp_classifier``, from the current directory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elaswave import TensorSpec, Workload


class Blobs:
    """``num_samples`` points in ``features`` dimensions around ``classes`` seeded centres; sample
    ``i`` is a pure function of (seed, i)."""

    def __init__(self, *, seed: int, features: int, classes: int, num_samples: int) -> None:
        self.seed, self.features, self.num_samples = seed, features, num_samples
        self.classes = classes
        centres = np.random.default_rng([seed, 1]).normal(0.0, 1.0, size=(classes, features))
        self.centres = centres.astype(np.float32)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, 2, i])
        label = int(rng.integers(self.classes))
        point = self.centres[label] + rng.normal(0.0, 0.8, size=self.features).astype(np.float32)
        return torch.from_numpy(point), label


class MLPClassifier(Workload):
    """[input block, hidden block × depth, output layer]; each block Linear → GELU → Dropout."""

    def __init__(
        self, *, features: int, hidden: int, depth: int, classes: int, dropout: float,
        num_samples: int,
    ) -> None:  # fmt: skip
        self.features, self.hidden, self.depth, self.classes = features, hidden, depth, classes
        self.dropout, self.num_samples = dropout, num_samples

    @property
    def num_layers(self) -> int:
        return self.depth + 2

    def build_layer(self, index: int, seed: int) -> nn.Module:
        if index == self.num_layers - 1:
            return nn.Linear(self.hidden, self.classes)
        width = self.features if index == 0 else self.hidden
        return nn.Sequential(nn.Linear(width, self.hidden), nn.GELU(), nn.Dropout(self.dropout))

    def dataset(self, seed: int) -> Blobs:
        return Blobs(
            seed=seed, features=self.features, classes=self.classes, num_samples=self.num_samples
        )

    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        points = torch.stack([p for p, _ in samples])
        return points, torch.tensor([label for _, label in samples], dtype=torch.int64)

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        width = self.classes if index == self.num_layers - 1 else self.hidden
        return TensorSpec((micro_batch_size, width), torch.float32)

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        return F.cross_entropy(output, targets, reduction="sum"), int(targets.shape[0])


def mlp_classifier(
    features: int = 16, hidden: int = 64, depth: int = 2, classes: int = 4,
    dropout: float = 0.1, num_samples: int = 4096,
) -> MLPClassifier:  # fmt: skip
    """The factory a config names: ``model.factory: "examples.mlp_classifier:mlp_classifier"``."""
    return MLPClassifier(
        features=features, hidden=hidden, depth=depth, classes=classes, dropout=dropout,
        num_samples=num_samples,
    )  # fmt: skip
