"""Your own PyTorch model and data set, trained elastically without writing a Workload.

``small_resnet`` returns a plain ``nn.Module`` (a small residual network with BatchNorm);
``digit_images`` returns a plain map-style data set whose item ``i`` is ``(image, label)``:
scikit-learn's handwritten digits (8 × 8, 10 classes, 1,797 samples, shipped inside the package:
nothing is downloaded), as ``channels`` × ``size`` × ``size`` float images. ElasWave cuts the
model into layers at its top-level children, batches the items with torch's default collate
and sums the cross-entropy (``train.loss``). Train it from the repository root with::

    elaswave launch examples/own_model.yaml --fault kill,rank=1,at_step=10

and write the trained model back as the class's own ``state_dict`` with ``elaswave export``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Two 3 × 3 convolutions with BatchNorm and a residual connection (a ResNet basic block)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """stem → stage1 → stage2 → pool → dropout → fc: its top-level children run in a chain."""

    def __init__(self, channels: int = 1, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())  # fmt: skip
        self.stage1 = nn.Sequential(Block(width, width), Block(width, width))
        self.stage2 = nn.Sequential(Block(width, 2 * width, 2), Block(2 * width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stage2(self.stage1(self.stem(x))))
        return self.fc(self.drop(torch.flatten(x, 1)))


def small_resnet(channels: int = 1, width: int = 16, classes: int = 10) -> SmallResNet:
    """The factory a config names: ``model.factory: "examples.own_model:small_resnet"``."""
    return SmallResNet(channels, width, classes)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``sklearn.datasets.load_digits`` returns them (64 pixel values
    in 0..16 per sample, and the labels), read from the file the package ships without importing
    scikit-learn (over a second per process: every worker reads the data set)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits need scikit-learn (pip install scikit-learn)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


class DigitImages(torch.utils.data.Dataset):
    """The digits in a seeded order, as ``(channels, size, size)`` images in [0, 1]."""

    def __init__(self, channels: int = 1, size: int = 8, seed: int = 0) -> None:
        pixels, target = load_digits()
        order = np.random.default_rng([seed, 7]).permutation(len(target))
        images = torch.from_numpy((pixels[order] / 16.0).astype(np.float32)).view(-1, 1, 8, 8)
        if size != 8:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        self.images = images.expand(-1, channels, -1, -1).contiguous()
        self.labels = torch.from_numpy(target[order].astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def digit_images(channels: int = 1, size: int = 8, seed: int = 0) -> DigitImages:
    """The factory a config names: ``data.factory: "examples.own_model:digit_images"``."""
    return DigitImages(channels, size, seed)
