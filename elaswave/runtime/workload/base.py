"""The public workload seam: everything the runtime knows of a model.

A workload describes a model as an ordered list of layers that any rank can build alone and
identically, a data set indexed by global sample id, how samples become a micro-batch, what passes
from one layer to the next, and the loss as ``(sum, count)``. The runtime never looks inside a
layer: data parallelism runs them all, a pipeline stage runs a contiguous range of them, and the
partitioner cuts between them.

Randomness inside layers needs no care from the workload: before each layer call the runtime
seeds the default generators from (seed, step, micro-batch, layer) (:func:`call_layer`), so any
``nn.Dropout`` or ``torch.rand*`` draws the same numbers on whichever rank computes that piece of
work, whatever the world size, the pipeline cut or the rank's batch share. A redone step draws
them again, identically.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from elaswave.runtime.workload.rng import stream_seed

__all__ = [
    "Dataset",
    "KeyedLayers",
    "ParamRef",
    "TensorSpec",
    "Workload",
    "build_layer",
    "build_layers",
    "call_layer",
    "hollow",
    "layer_seed",
]


class Dataset(Protocol):
    """Anything with a length, indexable by global sample id (0 ≤ id < len)."""

    def __len__(self) -> int: ...

    def __getitem__(self, sample_id: int) -> Any: ...


ParamRef = tuple[int, str]  # (layer index, parameter name inside that layer)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor that passes between two pipeline stages."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Member:
    """Block ``j`` of parameter ``param``: elements ``[start + j*size, start + (j+1)*size)``
    along ``axis``."""

    param: ParamRef
    axis: int
    size: int = 1
    start: int = 0


@dataclass(frozen=True)
class Family:
    """``count`` zero-invariant groups over one hidden dimension (:mod:`elaswave.prune.groups`):
    group ``j`` is block ``j`` of every member."""

    name: str  # e.g. layers.3.mlp
    kind: str  # groups of one kind share a width in a compressed model (attention | mlp | ...)
    count: int
    members: tuple[Member, ...]
    # Blocks removed with a zero group but not part of it: the next layer's inputs from a
    # channel that is zero whenever its group is (a zero-preserving activation between).
    consumers: tuple[Member, ...] = ()


class Workload(abc.ABC):
    """A model and its data, as the runtime sees them.

    Subclass it and return an instance from a factory (``model.source: module``,
    ``model.factory: "package.module:function"``, ``model.args: {...}``). Constructing the
    workload should be cheap: layers are built by :meth:`build_layer`, on the ranks that need them.
    """

    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """How many layers the model has (the pipeline can cut between any two of them)."""

    @abc.abstractmethod
    def build_layer(self, index: int, seed: int) -> nn.Module:
        """Layer ``index`` with its initial parameters, a function of (seed, index) alone.

        Its ``forward`` takes the previous layer's output (layer 0: the micro-batch's inputs) and
        returns one tensor. Its parameter names (``layers.<index>.<name>``) are the model's
        stable global names."""

    @abc.abstractmethod
    def dataset(self, seed: int) -> Dataset:
        """The training samples, indexed by global sample id (the runtime picks the ids)."""

    @abc.abstractmethod
    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        """One micro-batch from its samples: (inputs of layer 0, targets for :meth:`loss`)."""

    @abc.abstractmethod
    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        """What layer ``index`` returns for a micro-batch of ``micro_batch_size`` samples (what
        a pipeline stage that ends after it sends to the next one)."""

    @abc.abstractmethod
    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        """(sum of the micro-batch's losses, how many terms that sum counts).

        Count what the loss averages over: samples for a classifier, target tokens for a
        language model (padding and ignored labels not counted). The runtime sums both over
        the whole global batch and divides once, after the reduction: the gradient is that of
        the mean over every counted term of the batch, whatever share of it each rank ran."""

    def correct(self, output: torch.Tensor, targets: Any) -> int | None:
        """How many of the micro-batch's samples a classifier gets right (top-1), for the
        held-out accuracy; None (the default): the model is not scored by accuracy."""
        return None

    def build_meta_layer(self, index: int, seed: int) -> nn.Module:
        """Layer ``index`` with its shapes only, on the meta device: no memory, no initial
        values (what a pipeline rank keeps of the layers it does not hold, and what the flat
        layout is computed from). Default: the layer built on the CPU (:func:`build_layer`),
        moved there at once: one layer's memory and initialisation at a time. Override it where
        that costs: the Hugging Face workload copies its meta model's modules. (Not built under
        ``torch.device("meta")``: ``normal_`` on meta tensors imports torch's compiler stack on
        first use, seconds per process.)"""
        return build_layer(self, seed, index).to("meta")

    def layer_costs(self) -> Sequence[float] | None:
        """Relative cost of each layer for the pipeline partitioner, or ``None``: equal costs until
        measured (``layer_costs: profile`` or ``online``)."""
        return None

    def tied(self) -> Sequence[tuple[ParamRef, ParamRef]]:
        """Pairs of parameters in different layers that are one logical weight (tied input and
        output embeddings). Each layer owns a copy, built with the same initial values; the
        runtime sums their gradients before the reduction, so every copy gets the same update
        and stays identical, on whichever ranks and stages hold them. Default: none."""
        return ()

    def zero_invariant_groups(self, model: KeyedLayers) -> Sequence[Family] | None:
        """The model's zero-invariant groups, for ``train.prune`` (see
        :mod:`elaswave.prune.groups`): groups of parameter slices that, all zero, can be removed
        with the output unchanged. Default None: found by tracing the layers (a ``Linear``
        feeding another through element-wise layers)."""
        return None

    def export(self, model: KeyedLayers, out: Path) -> None:
        """Write the trained ``model`` (every layer, as :func:`build_layers` builds it, holding
        the trained parameters) to ``out``. Default: one safetensors file of every parameter
        and persistent buffer (BatchNorm's running statistics, say) keyed by its global name
        (``layers.<index>.<name>``; both copies of a tied weight)."""
        from safetensors.torch import save_file

        kept = model.state_dict(keep_vars=True)  # parameters and persistent buffers
        tensors = {
            n: t.detach().cpu().contiguous().clone()
            for n, t in [*model.named_parameters(), *model.named_buffers()]
            if n in kept
        }
        save_file(tensors, str(out), metadata={"format": "pt"})


def layer_seed(seed: int, step: int, microbatch: int, *, layer: int) -> int:
    """The seed of the default generators while ``layer`` runs for (step, micro-batch)."""
    return stream_seed(seed, step, microbatch, layer=layer, site=0)


def call_layer(
    layer: nn.Module,
    x: torch.Tensor,
    *,
    seed: int,
    step: int,
    microbatch: int,
    index: int,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """Run one layer with the default generators keyed by (seed, step, micro-batch, layer).

    With ``autocast`` (bf16), the layer runs under ``torch.autocast`` (its matrix products in
    that dtype; parameters, their gradients and the optimizer stay float32) and an output in
    that dtype comes back as float32, so what passes between layers and stages keeps its
    declared dtype. The same inputs give the same bits on whichever rank runs the layer."""
    seed_generators(layer_seed(seed, step, microbatch, layer=index), getattr(x, "device", None))
    if autocast is None:
        return layer(x)
    with torch.autocast(device_type=x.device.type, dtype=autocast):
        out = layer(x)
    return out.float() if out.dtype == autocast else out


def seed_generators(seed: int, device: torch.device | None = None) -> None:
    """Seed the default generators a layer running on ``device`` draws from: the host's, and
    the device's own on a CUDA device. That is what ``torch.manual_seed(seed)`` gives such a
    layer, without its cost: it seeds every device of every kind, and formats a stack for each
    kind it may seed later, which costs a visible share of a small model's step on a GPU
    (docs/benchmarks.md, "Measurements behind design choices"). On other accelerators (and with
    ``device`` unknown) it is ``torch.manual_seed`` itself."""
    torch.default_generator.manual_seed(seed)
    if device is None:
        if _accelerators():
            torch.manual_seed(seed)
        return
    if device.type == "cpu":
        return
    generator = _device_generator(device.type, device.index)
    if generator is None:
        torch.manual_seed(seed)
    else:
        generator.manual_seed(seed)


@functools.cache
def _device_generator(kind: str, index: int | None) -> torch.Generator | None:
    """The default generator of a CUDA device (``index`` None: the current one); None for
    other kinds. Asked once per device: the generator objects live as long as the process."""
    if kind != "cuda":
        return None
    torch.cuda.init()  # fills torch.cuda.default_generators (a no-op once CUDA is up)
    return torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]


@functools.cache
def _accelerators() -> bool:
    """Whether this process may use a device with generators of its own (asked once)."""
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or hasattr(torch, "npu")  # torch_npu imported
        or (xpu is not None and xpu.is_available())
        or torch.backends.mps.is_available()
    )


INIT_STEP = -1  # the (step, micro-batch) key of layer initialisation: never a training step
EVAL_STEP = -2  # the step key of an evaluation's layer calls: never a training step


def build_layer(workload: Workload, seed: int, index: int) -> nn.Module:
    """Layer ``index`` of ``workload``, built with the default generators seeded from (seed,
    layer): its initial parameters do not depend on which other layers a rank builds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, INIT_STEP, INIT_STEP, layer=index))
        return workload.build_layer(index, seed)


def initial_params(workload: Workload, seed: int, index: int) -> torch.Tensor:
    """Layer ``index``'s initial trainable parameters, flat in the flat buffers' order (the
    layer built alone, as every rank builds it)."""
    layer = build_layer(workload, seed, index)
    return torch.cat([p.detach().reshape(-1) for p in layer.parameters() if p.requires_grad])


def build_layers(
    workload: Workload, seed: int, keep: range | None = None, *, shells: bool = False
) -> KeyedLayers:
    """Every layer of ``workload`` (:func:`build_layer`). With ``keep``, the layers outside it
    are on the meta device (``Workload.build_meta_layer``): they have their shapes (the flat
    layout of the whole model) and no memory. ``shells``: only their parameters are on the meta
    device (:func:`hollow`), their buffers are built."""
    layers = []
    for index in range(workload.num_layers):
        if keep is None or index in keep:
            layer = build_layer(workload, seed, index)
        elif shells:
            layer = hollow(build_layer(workload, seed, index))
        else:
            layer = workload.build_meta_layer(index, seed)
        layers.append(layer)
    return KeyedLayers(layers, seed=seed)


def hollow(layer: nn.Module) -> nn.Module:
    """``layer`` with its trainable parameters on the meta device (their shapes kept, no memory)
    and its buffers (rotary tables, masks: small, and not rebuilt cheaply) and frozen parameters
    kept as they are: a shell that ZeRO-3 fills with gathered parameters while the layer runs."""
    for module in layer.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.requires_grad and p.device.type != "meta":
                module._parameters[name] = nn.Parameter(p.detach().to("meta"), p.requires_grad)
    return layer


class KeyedLayers(nn.Module):
    """A workload's layers in order, run with keyed randomness (:func:`call_layer`)."""

    def __init__(
        self, layers: Sequence[nn.Module], *, seed: int, autocast: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.seed = int(seed)
        self.autocast = autocast  # run the layers under torch.autocast in this dtype (bf16)
        self.stats: Any = None  # the norm layers' running statistics (runtime/runningstats.py)

    def __len__(self) -> int:
        return len(self.layers)

    def forward(
        self,
        x: torch.Tensor,
        step: int,
        microbatch: int,
        start: int = 0,
        stop: int | None = None,
        *,
        rng: int | None = None,
    ) -> torch.Tensor:
        """Layers ``start .. stop - 1`` on ``x`` for (step, micro-batch); ``rng``: what the
        random numbers are keyed by instead of the micro-batch (``train.rng: rank``)."""
        stop = len(self.layers) if stop is None else stop
        for index in range(start, stop):
            x = self.run_layer(index, x, step, microbatch=microbatch, rng=rng)
        return x

    def run_layer(
        self, index: int, x: torch.Tensor, step: int, *, microbatch: int, rng: int | None = None
    ) -> torch.Tensor:
        """Layer ``index`` alone on ``x`` for (step, micro-batch): keyed randomness and this
        model's autocast, as :meth:`forward` runs it (pipeline stages time layers one by one).
        In training, its norm layers' batch statistics go to ``stats`` (:class:`RunningStats`),
        keyed by (step, micro-batch)."""
        layer = self.layers[index]
        key = microbatch if rng is None else rng
        run = functools.partial(
            call_layer, layer, x, seed=self.seed, step=step, microbatch=key, index=index,
            autocast=self.autocast,
        )  # fmt: skip
        if self.stats is None or not self.training:
            return run()
        with self.stats.capture(index, step, microbatch):
            return run()

    def param_slice(self, ref: ParamRef) -> slice:
        """Where parameter ``(layer, name)`` lies in the flat buffer of every layer's parameters."""
        index, name = ref
        offset = self.segments()[index][0]
        for pname, p in self.layers[index].named_parameters():
            if not p.requires_grad:
                continue
            if pname == name:
                return slice(offset, offset + p.numel())
            offset += p.numel()
        raise KeyError(f"layer {index} has no trainable parameter {name!r}")

    def segments(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each layer's trainable parameters in a flat buffer of them all."""
        out, offset = [], 0
        for layer in self.layers:
            n = sum(p.numel() for p in layer.parameters() if p.requires_grad)
            out.append((offset, n))
            offset += n
        return tuple(out)
