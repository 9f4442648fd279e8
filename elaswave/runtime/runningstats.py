"""BatchNorm's running statistics as train state, the same whatever the membership history.

In a training forward a BatchNorm layer moves its running mean and variance towards the
micro-batch's statistics. Which rank runs which micro-batch depends on the plan, so, left alone,
each rank's buffers would hold a different mix of micro-batches, and a newcomer's none. Here each
micro-batch is a logical unit, as for the gradients:

- **capture**: a training forward writes each norm layer's batch statistics into the
  micro-batch's own row of a step buffer (the layer runs with momentum 1 into views of that row,
  and counts into a flag whether it ran);
- **reduce**: every rank sums the rows of the micro-batches its reduction holds (the strategy's
  :meth:`~elaswave.runtime.strategies.base.Strategy.covered`), zeros elsewhere: each row comes
  from exactly one rank, so the sum is exact;
- **commit**: once the step's update is applied, every rank folds the rows into one copy of every
  norm layer's running statistics, in micro-batch order, as one process running the micro-batches
  one after the other would.

The modules' buffers are views into that copy (:meth:`RunningStats.bind`): evaluation,
checkpoints and export see it. Every rank holds the whole model's copy (it is small: 0.1 % of
resnet18's parameters), so pipelines and re-cuts never move it; a newcomer takes it from a rank at
the resume step (:meth:`RunningStats.share`), checkpoints keep it beside the parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from elaswave.runtime.workload.base import KeyedLayers, Workload

__all__ = ["Norm", "RunningStats", "norms_of"]


@dataclass(frozen=True)
class Norm:
    """One norm layer's running statistics: ``channels`` means at ``offset`` of the values,
    as many variances after them, its batch count at ``index`` of the counts."""

    layer: int
    name: str  # the module's name inside its layer
    channels: int
    momentum: float | None  # None: a cumulative average (1 / batches seen)
    offset: int
    index: int


def norms_of(layer: nn.Module) -> list[tuple[str, nn.modules.batchnorm._NormBase]]:
    """The modules of ``layer`` that keep running statistics (BatchNorm and its kin with
    ``track_running_stats``), in module order."""
    return [
        (name, m)
        for name, m in layer.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and m.running_mean is not None
    ]


def _running(m: nn.modules.batchnorm._NormBase) -> tuple[torch.Tensor, torch.Tensor]:
    """``m``'s running mean and variance: every module :func:`norms_of` finds keeps both."""
    assert m.running_mean is not None and m.running_var is not None
    return m.running_mean, m.running_var


class RunningStats:
    """Every norm layer's running statistics of the whole model, and the step's captured rows.

    ``values``: [mean | var] of each norm in order; ``counts``: batches each one has seen. A row of
    the step buffer is [the norms' batch mean | var, laid out as ``values`` | 1.0 per norm that
    ran]. ``step``: the last step folded in (a checkpoint's step after a restore)."""

    def __init__(
        self,
        norms: Sequence[Norm],
        values: torch.Tensor,
        counts: torch.Tensor,
        *,
        microbatches: int,
    ) -> None:
        self.norms = tuple(norms)
        self.values = values
        self.counts = counts
        self.microbatches = microbatches
        self.step = 0
        size, k = values.numel(), len(self.norms)
        self.width = size + k
        # one row per micro-batch, and a scratch row for forwards that are no training step's
        self.rows = values.new_zeros(microbatches + 1, self.width)
        self._captured: set[tuple[int, int]] = set()  # (micro-batch, layer) of ``captured_step``
        self.captured_step = -1
        self._bound: dict[int, list[nn.modules.batchnorm._NormBase]] = {}
        self.by_layer: dict[int, tuple[int, int]] = {}  # layer -> its norms' [first, last + 1)
        for i, norm in enumerate(self.norms):
            first, _ = self.by_layer.get(norm.layer, (i, i))
            self.by_layer[norm.layer] = (first, i + 1)
        owner = torch.empty(size, dtype=torch.int64)
        for norm in self.norms:
            owner[norm.offset : norm.offset + 2 * norm.channels] = norm.index
        self._owner = owner.to(values.device)
        momenta = [n.momentum if n.momentum is not None else float("nan") for n in self.norms]
        self._momenta = torch.tensor(momenta, dtype=torch.float64, device=values.device)
        layers = torch.tensor([n.layer for n in self.norms], dtype=torch.int64)
        self._column_layer = torch.cat([layers[owner], layers]).to(values.device)

    @classmethod
    def of(
        cls, workload: Workload, model: KeyedLayers, microbatches: int, *, device: torch.device
    ) -> RunningStats | None:
        """The model's running statistics with their initial values (those a layer is built
        with: a pretrained model's own), or None where no layer keeps any. A layer this rank
        holds only the shape of (on the meta device) is built once to read them."""
        from elaswave.runtime.workload.base import build_layer

        norms: list[Norm] = []
        initial: list[torch.Tensor] = []
        counts: list[int] = []
        dtypes = set()
        offset = 0
        for index, layer in enumerate(model.layers):
            found = norms_of(layer)
            if not found:
                continue
            if any(_running(m)[0].is_meta for _, m in found):
                found = norms_of(build_layer(workload, model.seed, index))
            for name, m in found:
                mean, var = _running(m)
                c = mean.numel()
                norms.append(Norm(index, name, c, m.momentum, offset, len(norms)))
                initial += [mean.detach().reshape(-1), var.detach().reshape(-1)]
                tracked = m.num_batches_tracked
                counts.append(int(tracked) if tracked is not None else 0)
                dtypes.add(mean.dtype)
                offset += 2 * c
        if not norms:
            return None
        if len(dtypes) > 1:
            kinds = sorted(map(str, dtypes))
            raise ValueError(f"the model's running statistics mix dtypes {kinds}")
        values = torch.cat(initial).to(device)
        count = torch.tensor(counts, dtype=torch.int64, device=device)
        return cls(norms, values, count, microbatches=microbatches)

    # ---- the modules' buffers ----------------------------------------------------------------
    def bind(self, index: int, layer: nn.Module) -> None:
        """Make layer ``index``'s running statistics views into the kept copy (a layer built or
        moved anew holds copies of its own)."""
        if index not in self.by_layer:
            return
        first, stop = self.by_layer[index]
        found = norms_of(layer)
        if len(found) != stop - first:
            raise ValueError(f"layer {index} has {len(found)} norm layers, not {stop - first}")
        for norm, (name, m) in zip(self.norms[first:stop], found, strict=True):
            if name != norm.name:
                raise ValueError(f"layer {index}'s norm {name!r} is not {norm.name!r}")
            self._point(m, norm, self.values, count=self.counts[norm.index])
        self._bound[index] = [m for _, m in found]

    def _point(
        self,
        m: nn.modules.batchnorm._NormBase,
        norm: Norm,
        values: torch.Tensor,
        *,
        count: torch.Tensor | None,
    ) -> None:
        shape = _running(m)[0].shape
        a, c = norm.offset, norm.channels
        m._buffers["running_mean"] = values[a : a + c].view(shape)
        m._buffers["running_var"] = values[a + c : a + 2 * c].view(shape)
        if m._buffers.get("num_batches_tracked") is not None and count is not None:
            m._buffers["num_batches_tracked"] = count

    @contextlib.contextmanager
    def capture(self, index: int, step: int, microbatch: int) -> Iterator[None]:
        """Around a training forward of layer ``index``: its norms write their batch statistics
        into tensors of their own (autograd keeps them for the backward: they are never written
        again), copied into ``microbatch``'s row of ``step`` after it (a forward of no training
        step, e.g. a timing probe, into the scratch row); the kept copy is left as it was."""
        modules = self._bound.get(index)
        if modules is None:
            yield
            return
        first, stop = self.by_layer[index]
        training = step >= 1 and 0 <= microbatch < self.microbatches
        if training and step != self.captured_step:
            self._captured.clear()
            self.captured_step = step
        norms = self.norms[first:stop]
        own = [self.values.new_zeros(2 * n.channels) for n in norms]
        ran = self.counts.new_zeros(len(norms))
        for k, (norm, m, scratch) in enumerate(zip(norms, modules, own, strict=True)):
            self._point(m, dataclasses.replace(norm, offset=0), scratch, count=ran[k])
            m.momentum = 1.0  # the running statistics become the batch's
        try:
            yield
        finally:
            row = self.rows[microbatch if training else self.microbatches]
            for norm, m, scratch in zip(norms, modules, own, strict=True):
                self._point(m, norm, self.values, count=self.counts[norm.index])
                m.momentum = norm.momentum
                row[norm.offset : norm.offset + 2 * norm.channels].copy_(scratch)
            size = self.values.numel()
            row[size + first : size + stop].copy_(ran)
            if training:
                self._captured.add((microbatch, index))

    # ---- one step ----------------------------------------------------------------------------
    def contribution(self, step: int, covered: Mapping[int, Sequence[int]]) -> torch.Tensor:
        """This rank's part of ``step``'s rows for the sum: the rows of the micro-batches its
        reduction holds (``covered``: layer -> micro-batch ids), zeros elsewhere."""
        mask = torch.zeros(self.microbatches, max(self.by_layer) + 1, dtype=torch.bool)
        for layer, ids in covered.items():
            if layer not in self.by_layer:
                continue
            for mb in ids:
                if step != self.captured_step or (mb, layer) not in self._captured:
                    raise RuntimeError(
                        f"the running statistics of step {step}, micro-batch {mb}, layer "
                        f"{layer} were not captured"
                    )
                mask[mb, layer] = True
        keep = mask.to(self.rows.device)[:, self._column_layer]
        rows = self.rows[: self.microbatches]
        return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def commit(self, step: int, rows: torch.Tensor) -> None:
        """Fold ``step``'s summed rows into the kept copy, micro-batch by micro-batch (every
        rank the same: the result depends on the rows alone)."""
        size, values = self.values.numel(), self.values
        for row in rows.view(self.microbatches, self.width):
            ran = row[size:] > 0
            self.counts += ran
            seen = self.counts.to(torch.float64).clamp(min=1)
            factor = torch.where(self._momenta.isnan(), 1.0 / seen, self._momenta)
            weight = factor.to(values.dtype)[self._owner]
            mixed = values * (1 - weight) + row[:size] * weight
            values.copy_(torch.where(ran[self._owner], mixed, values))
        self.step = step

    # ---- as state ----------------------------------------------------------------------------
    def saved(self) -> torch.Tensor:
        """[values | counts] as one float64 vector on the host (exact: float32 values and counts
        below 2**53)."""
        return torch.cat([self.values.to(torch.float64), self.counts.to(torch.float64)]).cpu()

    def adopt(self, saved: torch.Tensor | None, step: int) -> None:
        """Take a vector of :meth:`saved` as the state of ``step``."""
        if saved is None:
            raise ValueError("the saved state holds no running statistics for the norm layers")
        size = self.values.numel()
        if saved.numel() != size + self.counts.numel():
            raise ValueError(
                f"the saved running statistics have {saved.numel()} values, this model "
                f"{size + self.counts.numel()}"
            )
        saved = saved.to(self.values.device)
        self.values.copy_(saved[:size])
        self.counts.copy_(saved[size:].round().to(torch.int64))
        self.step = step
        self.captured_step = -1

    def share(self, comm: Any, step: int, broken: Callable[[], bool]) -> int:
        """After a plan's sync to ``step``: every rank takes the copy of the lowest rank whose
        copy is of ``step`` (a newcomer's is not). Returns that rank."""
        from elaswave.runtime.strategies.base import DP

        device = self.values.device
        mine = torch.tensor([float(self.step)], dtype=torch.float64, device=device)
        have = [int(r[0]) for r in comm.allgather(DP, mine, broken)]
        holders = [r for r, s in enumerate(have) if s == step]
        if not holders:
            raise RuntimeError(f"no rank holds the running statistics of step {step} ({have})")
        if len(holders) < len(have):
            buf = self.saved().to(device)
            comm.broadcast(DP, buf, holders[0], abort=broken)
            self.adopt(buf, step)
        return holders[0]
