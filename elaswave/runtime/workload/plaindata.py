"""What a plain module trains on, and how its loss is counted: ``data.source: dataset |
imagefolder``, ``data.collate``, ``train.loss``.

A data set is map-style: item ``i`` is ``(input, target)`` (tensors, or nested tuples/dicts of
them), the same item on every rank (the runtime picks the ids). A loss returns the *sum* over
the micro-batch and how many terms that sum counts; the runtime divides once by the global
count, so the gradient is the batch mean's whatever share of the batch a rank ran.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from elaswave.config import JobConfig
from elaswave.errors import ConfigError, one_line
from elaswave.runtime.workload.base import Dataset

__all__ = ["LossFn", "make_collate", "make_data", "make_loss", "resolve"]

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, int]]


def resolve(spec: str, key: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (config key ``key``), importable
    from the current directory too (as ``python -m`` does)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key} {spec!r}: cannot import {module_name!r} ({exc})") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{key} {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ConfigError(f"{key} {spec!r}: {attr!r} is not callable")
    return target


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy; counted per class-index target (per sample with soft targets)."""
    total = F.cross_entropy(output, target, reduction="sum")
    soft = target.is_floating_point() and target.shape == output.shape
    return total, int(output.shape[0] if soft else target.numel())


def mse(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed squared error over every element, counted per element (torch's mean)."""
    return F.mse_loss(output, target.to(output.dtype), reduction="sum"), int(target.numel())


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def make_loss(cfg: JobConfig) -> LossFn:
    """``train.loss``: a built-in one, or the user's function checked on each call's shape."""
    name = cfg.train.loss
    if name in LOSSES:
        return LOSSES[name]
    fn = resolve(name, "train.loss")

    def user_loss(output: torch.Tensor, target: Any) -> tuple[torch.Tensor, int]:
        result = fn(output, target)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(
                f"train.loss {name!r} returned {type(result).__name__}, not (sum, count)"
            )
        total, count = result
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            shape = tuple(getattr(total, "shape", ()))
            raise ConfigError(f"train.loss {name!r} returned a sum of shape {shape}, not a scalar")
        return total.reshape(()), int(count)

    return user_loss


def make_data(cfg: JobConfig) -> Callable[[], Dataset]:
    """``data.source: dataset`` (the factory with ``data.args``) or ``imagefolder``, built on
    first use."""
    d = cfg.data
    if d.source == "imagefolder":
        return lambda: image_folder(str(d.path), d.image_size)
    if d.source != "dataset":
        raise ConfigError(
            "a plain nn.Module trains on data.source: dataset (data.factory) or imagefolder "
            f"(data.path), not {d.source}"
        )
    assert d.factory is not None
    factory = resolve(d.factory, "data.factory")

    def build() -> Dataset:
        try:
            data = factory(**d.args)
        except Exception as exc:  # the user's code: its error, on one line
            raise ConfigError(f"data.factory {d.factory!r} failed: {one_line(exc)}") from None
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise ConfigError(
                f"data.factory {d.factory!r} returned {type(data).__name__}: a map-style data "
                "set (len() and [i]) is needed"
            )
        return data

    return build


def make_collate(cfg: JobConfig) -> Callable[[Sequence[Any]], Any]:
    """``data.collate``, or torch's ``default_collate``."""
    if cfg.data.collate is not None:
        return resolve(cfg.data.collate, "data.collate")
    from torch.utils.data import default_collate

    return default_collate  # type: ignore[return-value]  # torch types it for lists; any sequence works


def image_folder(path: str, size: int) -> Dataset:
    """torchvision's ImageFolder at ``path``: each image resized and center-cropped to
    ``size`` × ``size``, as a float tensor in [0, 1]; its class index as the target."""
    if not os.path.isdir(path):
        raise ConfigError(f"data.path {path}: not a directory")
    try:
        from torchvision import datasets, transforms
    except Exception as exc:  # noqa: BLE001 - missing, or a build that does not fit torch
        raise ConfigError(
            f"data.source: imagefolder needs torchvision ({one_line(exc)}): "
            "pip install 'elaswave[vision]'"
        ) from None
    transform = transforms.Compose(
        [transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()]
    )
    try:
        return datasets.ImageFolder(path, transform=transform)
    except (OSError, FileNotFoundError, RuntimeError) as exc:
        raise ConfigError(f"data.path {path}: {one_line(exc)}") from None
