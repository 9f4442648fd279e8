"""Any ``nn.Module`` as a workload: the user's own, a torchvision or a timm model by name.

The model is built whole, seeded (the same on every rank), and cut into layers
(:mod:`.cut`); each rank keeps the layers it runs. Its data is a map-style data set whose item
``i`` is ``(input, target)`` (:mod:`.plaindata`), collated into micro-batches, and its loss one
of ``train.loss``'s, summed over the micro-batch with the count of what it averages over. What
passes between layers is measured once, on two samples (:meth:`ModuleWorkload.boundary`).

Export writes the model as the user's class holds it: a ``state_dict`` whose keys are the
module's own (``layer1.0.conv1.weight``, buffers included), which the user's class loads with
``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elaswave.errors import ConfigError, one_line
from elaswave.runtime.runningstats import norms_of
from elaswave.runtime.workload.base import Dataset, KeyedLayers, ParamRef, TensorSpec, Workload
from elaswave.runtime.workload.cut import Cut, cut_module
from elaswave.runtime.workload.plaindata import LossFn, cross_entropy
from elaswave.runtime.workload.resize import fit_shapes

__all__ = ["ModuleWorkload", "load_state_file"]

log = logging.getLogger(__name__)

PROBE_SAMPLES = 2  # samples the boundaries between layers are measured on


class ModuleWorkload(Workload):
    """``build()`` makes the whole model (called under a seeded generator); ``data()`` the data
    set; ``collate`` a micro-batch of its items; ``loss`` (sum, count) of one."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        data: Callable[[], Dataset],
        collate: Callable[[Sequence[Any]], Any],
        loss: LossFn,
        split: list[str],
        seed: int,
        pretrained: str | None = None,
        what: str = "the model",
    ) -> None:
        self._build, self._data, self._collate, self._loss = build, data, collate, loss
        self.split, self.pretrained, self.what = split, pretrained, what
        self._dataset: Dataset | None = None
        self._specs: list[TensorSpec] | None = None
        # Cut at the job's seed: the layer count, any error in the model or its split, and the
        # layers every build_layer of the run copies, from one build and trace.
        self._seed = seed
        self._cut = cut_module(self.whole(seed), split)
        if self._cut.whole_because:
            log.info("%s is trained as one layer: %s", what, self._cut.whole_because)

    # ---- the model ---------------------------------------------------------------------------
    def whole(self, seed: int) -> nn.Module:
        """The whole model with its initial values for ``seed`` (or ``pretrained``'s)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = self._build()
            except Exception as exc:  # the user's code: its error, on one line
                raise ConfigError(f"{self.what} failed to build: {one_line(exc)}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{self.what} returned {type(model).__name__}, not an nn.Module")
        if self.pretrained is not None:
            state = load_state_file(self.pretrained)
            why = _misfit(model.state_dict(), state)
            if why:
                raise ConfigError(
                    f"model.pretrained {self.pretrained}: does not fit {self.what}: {why}"
                )
            model.load_state_dict(state, strict=True)
        return model

    def _cut_at(self, seed: int) -> Cut:
        """The layers for ``seed`` (the job's, cut once; another is cut anew)."""
        if self._seed != seed:
            self._cut, self._seed = cut_module(self.whole(seed), self.split), seed
        return self._cut

    @property
    def num_layers(self) -> int:
        return len(self._cut.layers)

    def build_layer(self, index: int, seed: int) -> nn.Module:
        return copy.deepcopy(self._cut_at(seed).layers[index])

    def tied(self) -> Sequence[tuple[ParamRef, ParamRef]]:
        return self._cut.tied

    # ---- the data ----------------------------------------------------------------------------
    def dataset(self, seed: int) -> Dataset:
        if self._dataset is None:
            self._dataset = self._data()
        return self._dataset

    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        return self._collate(samples)

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        return self._loss(output, targets)

    def correct(self, output: torch.Tensor, targets: Any) -> int | None:
        """Top-1 hits when the loss is the built-in cross-entropy over class indices."""
        if self._loss is not cross_entropy or not isinstance(targets, torch.Tensor):
            return None
        if targets.is_floating_point() or output.dim() != 2 or targets.shape != output.shape[:1]:
            return None
        return int((output.argmax(1) == targets).sum())

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        spec = self._boundaries()[index]
        return TensorSpec((micro_batch_size, *spec.shape[1:]), spec.dtype)

    def _boundaries(self) -> list[TensorSpec]:
        """What each layer returns for a micro-batch of the first samples (eval mode, no
        gradient: the model's state is not touched)."""
        if self._specs is None:
            layers = self._cut.layers
            data = self.dataset(0)
            x, _ = self.collate([data[i] for i in range(min(PROBE_SAMPLES, len(data)))])
            specs = []
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                modes = [m.training for m in layers]
                try:
                    for layer in layers:
                        x = layer.eval()(x)
                        specs.append(TensorSpec(tuple(x.shape), x.dtype))
                finally:
                    for layer, mode in zip(layers, modes, strict=True):
                        layer.train(mode)
            self._specs = specs
        return self._specs

    # ---- the model back ----------------------------------------------------------------------
    def export(self, model: KeyedLayers, out: Path) -> None:
        """The user's ``state_dict``: the trained layers' parameters and buffers under the
        module's own names, in a whole model built as the run built it (a module its forward
        never calls keeps its initial values; a compressed layer's tensors keep their shapes),
        written as one safetensors file."""
        from safetensors.torch import save_file

        whole = self.whole(model.seed)
        state = whole.state_dict()
        for layer in model.layers:
            for name, t in layer.state_dict().items():
                if name in state:
                    state[name] = t
        fit_shapes(whole, state)
        whole.load_state_dict(state, strict=True)
        tensors = {n: t.detach().cpu().contiguous().clone() for n, t in whole.state_dict().items()}
        save_file(tensors, str(out), metadata={"format": "pt"})

    # ---- checked before any worker starts ----------------------------------------------------
    def check(self) -> None:
        """One micro-batch through the model and the loss: items of the wrong shape or type, a
        model that fails on them or a loss that is not (scalar sum, count) are config errors."""
        data = self.dataset(0)
        try:
            n = len(data)
        except TypeError:
            raise ConfigError(
                f"data: the data set ({type(data).__name__}) has no len(): a map-style data set "
                "is needed"
            ) from None
        if n < 1:
            raise ConfigError("data: the data set is empty")
        item = _item(data, 0)
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(f"data: item 0 is {_kind(item)}, not (input, target)")
        try:
            x, targets = self.collate([_item(data, i) for i in range(min(PROBE_SAMPLES, n))])
        except Exception as exc:  # noqa: BLE001 - the user's items or collate
            raise ConfigError(f"data: the items do not collate: {one_line(exc)}") from None
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"data: a micro-batch's input is {_kind(x)}, not a tensor")
        try:
            specs = self._boundaries()
        except Exception as exc:  # noqa: BLE001 - the user's model on the user's data
            raise ConfigError(f"{self.what} fails on a micro-batch: {one_line(exc)}") from None
        self._check_buffers(x)
        output = torch.zeros(specs[-1].shape, dtype=specs[-1].dtype)
        try:
            total, count = self._loss(output, targets)
        except Exception as exc:  # noqa: BLE001 - the user's loss
            raise ConfigError(f"train.loss fails on a micro-batch: {one_line(exc)}") from None
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            raise ConfigError(
                f"train.loss returned a sum of shape {tuple(getattr(total, 'shape', ()))}, not a "
                "scalar"
            )
        if isinstance(count, bool) or not isinstance(count, (int, torch.Tensor)):
            raise ConfigError(f"train.loss returned a count of type {type(count).__name__}")

    def _check_buffers(self, x: torch.Tensor) -> None:
        """A training forward may change BatchNorm's running statistics (train state: see
        :mod:`elaswave.runtime.runningstats`) and no other persistent buffer: each rank's copy
        of one would follow the micro-batches that rank ran. Run on copies of the cut layers,
        in train mode."""
        layers = [copy.deepcopy(layer).train() for layer in self._cut.layers]
        before = []
        for layer in layers:
            kept = {f"{m}.{b}" if m else b for m, _ in norms_of(layer) for b in _STATS}
            before.append(
                {
                    name: t.clone()
                    for name, t in layer.state_dict().items()
                    if name not in kept and not name.endswith("num_batches_tracked")
                }
            )
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            try:
                for layer in layers:
                    x = layer(x)
            except Exception:  # noqa: BLE001 - _boundaries said why, layer by layer
                return
        for layer, held in zip(layers, before, strict=True):
            after = layer.state_dict()
            for name, value in held.items():
                if not torch.equal(after[name], value):
                    raise ConfigError(
                        f"{self.what}: its buffer {name} changes in a training forward; "
                        "ElasWave keeps BatchNorm's running statistics as train state, no other "
                        "buffer"
                    )


_STATS = ("running_mean", "running_var")  # what norms_of's modules keep beside their count


def _misfit(want: dict[str, torch.Tensor], have: dict[str, torch.Tensor]) -> str:
    """How a state_dict differs from a model's ('' when it loads strictly)."""
    for what, keys in (
        ("missing", want.keys() - have.keys()),
        ("unexpected", have.keys() - want.keys()),
    ):
        if keys:
            shown = ", ".join(sorted(keys)[:3]) + (", ..." if len(keys) > 3 else "")
            return f"{len(keys)} {what} key(s) ({shown})"
    for key, t in want.items():
        if tuple(have[key].shape) != tuple(t.shape):
            return f"{key} is {tuple(have[key].shape)}, the model's {tuple(t.shape)}"
    return ""


def _item(data: Dataset, i: int) -> Any:
    try:
        return data[i]
    except Exception as exc:  # noqa: BLE001 - the user's data set
        raise ConfigError(f"data: item {i} cannot be read: {one_line(exc)}") from None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """A state_dict from a local file: safetensors, or ``torch.save``'s (tensors only)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.pretrained {path}: no such file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(p))
        state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a file that is not a state_dict
        raise ConfigError(f"model.pretrained {path}: not a state_dict ({one_line(exc)})") from None
    if not isinstance(state, dict):
        raise ConfigError(
            f"model.pretrained {path}: holds a {type(state).__name__}, not a state_dict"
        )
    return state
