"""Getting the trained model back: ``elaswave export``.

A run keeps its config (``<run_dir>/config.json``, written at launch) and its state as durable
checkpoints: every ``durable_every`` steps, and the last step's with ``train.save_final`` (the
default). Export rebuilds the workload's layers from the config, loads a checkpoint's parameters
into them and lets the workload write them: a Hugging Face model as a directory that
``AutoModelForCausalLM.from_pretrained`` loads, any other workload as one safetensors file keyed
by its global parameter names (``layers.<index>.<name>``).

BatchNorm's running statistics are not part of the elastic state (each process's own follow the
micro-batches it ran): export recomputes them from the trained parameters, as a cumulative
average of the batch statistics of the run's first training samples
(:func:`recompute_norm_stats`), so that the exported model evaluates alike however the run's
membership changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave.config import JobConfig
from elaswave.errors import ConfigError, ElasWaveError

__all__ = [
    "Exported", "cpu_latency", "export_model", "find_checkpoint",
    "run_config",
]  # fmt: skip


@dataclass(frozen=True)
class Exported:
    step: int  # the step whose state was written
    loss: float  # that step's loss
    checkpoint: Path
    out: Path
    sizes: tuple[int, int] | None = None  # --compress: (parameters before, after)
    flops: tuple[int, int] | None = None  # --compress: (matrix FLOPs per sample before, after)
    # --compress: (seconds, seconds) of one forward of a micro-batch on one CPU thread, before
    # and after (medians), the input's shape and the forwards timed of each; None where no
    # sample could be built
    latency: tuple[float, float] | None = None
    latency_input: tuple[int, ...] | None = None
    latency_runs: tuple[int, int] | None = None
    skipped: str = ""  # newer checkpoints that failed their check, and which file


LATENCY_RUNS = 20  # forwards timed (after 3 untimed) for the latency before and after,
LATENCY_BUDGET_S = 10.0  # or as many as fit in this many seconds (3 at least): a large model


def run_config(run_dir: Path) -> JobConfig:
    """The config a run was launched with."""
    from elaswave.events import RUN_CONFIG

    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise ElasWaveError(f"no run found at {run_dir} (missing {RUN_CONFIG})")
    try:
        return JobConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ElasWaveError(f"{path}: not a run config ({exc})") from None


def find_checkpoint(directory: Path, step: int | None) -> tuple[Path, str]:
    """The checkpoint of ``step`` under ``directory``, or the newest intact one; one that fails
    its check (a file truncated, changed or missing) is never read: with ``step`` the export is
    refused naming the file, without it the newest intact one is taken: (its path, the newer
    ones skipped and why, '' if none)."""
    from elaswave.runtime.durable.layout import check, newest_intact, step_of

    if step is None:
        choice = newest_intact(directory)
        if choice.path is None and choice.skipped:
            raise ElasWaveError(f"no intact checkpoint in {directory}: {choice.failures()}")
        if choice.path is None:
            raise ElasWaveError(
                f"no saved state in {directory}: the run ended before its last step without "
                "durable checkpoints, or ran with train.save_final: false"
            )
        return choice.path, choice.failures()
    path = directory / f"step-{step:08d}"
    if not path.is_dir():
        have = sorted(step_of(p) for p in directory.glob("step-*") if step_of(p) >= 0)
        listed = ", ".join(map(str, have)) or "none"
        raise ElasWaveError(f"no checkpoint of step {step} in {directory} (steps kept: {listed})")
    why = check(path)
    if why is not None:
        raise ElasWaveError(f"the checkpoint of step {step} in {directory} failed its check: {why}")
    return path, ""


def export_model(
    run_dir: Path,
    out: Path,
    step: int | None = None,
    *,
    compress: bool = False,
    pad: bool = False,
) -> Exported:
    """Write the model of ``run_dir`` at ``step`` (default: its newest saved state) to ``out``;
    ``compress``: a pruned run's smaller model (:func:`compressed`); ``pad``: a Hugging Face
    model's layers all as wide as the widest (so that ``from_pretrained`` loads it), as a run
    with ``train.prune.uniform`` always has them (a layer may still keep a group or two fewer
    than another: groups outside the redundant set that reached zero too)."""
    from elaswave.runtime.durable.checkpoints import load
    from elaswave.runtime.optim import FlatParams
    from elaswave.runtime.workload.base import build_layers
    from elaswave.runtime.workload.load import load_workload

    if out.exists():
        raise ConfigError(f"--out {out} already exists (remove it, or choose another path)")
    cfg = run_config(run_dir)
    if compress and cfg.train.prune is None:
        raise ConfigError(f"--compress: the run at {run_dir} was not pruned (no train.prune)")
    if pad and not compress:
        raise ConfigError("--pad pads the layers of a compressed model: it needs --compress")
    path, skipped = find_checkpoint(cfg.resolved_durable_dir, step)
    workload = load_workload(cfg)
    model = build_layers(workload, cfg.train.seed)
    flat = FlatParams(model)
    state = load(path, flat.numel)
    flat.data.copy_(state.params)
    _running_stats(workload, model, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    kinds = cfg.train.prune.kinds if cfg.train.prune is not None else []
    sizes = flops = latency = runs = None
    sample = _sample(workload, cfg) if compress else None
    before = cpu_latency(model, sample) if sample is not None else None
    if compress:
        uniform = cfg.train.prune is not None and cfg.train.prune.uniform
        sizes, flops = compressed(
            workload, model, flat.data, kinds=kinds, pad=pad, uniform=uniform, sample=sample
        )
        if before is not None:
            after = cpu_latency(model, sample)
            latency, runs = (before[0], after[0]), (before[1], after[1])
    workload.export(model, out)
    if sizes is not None and not out.is_dir():  # the new shapes, beside the safetensors file
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        out.with_name(out.name + ".shapes.json").write_text(json.dumps(shapes, indent=1))
    shape = tuple(sample.shape) if sample is not None and latency is not None else None
    return Exported(
        state.step, state.loss, path, out, sizes, flops, latency, shape, runs, skipped,
    )  # fmt: skip


def _running_stats(workload: Any, model: Any, state: Any) -> None:
    """The checkpoint's running statistics (BatchNorm's) into ``model``'s norm layers."""
    import torch

    from elaswave.runtime.runningstats import RunningStats

    stats = RunningStats.of(workload, model, 1, device=torch.device("cpu"))
    if stats is None:
        return
    for index, layer in enumerate(model.layers):
        stats.bind(index, layer)
    try:
        stats.adopt(state.buffers, state.step)
    except ValueError as exc:
        raise ConfigError(f"{state.path}: {exc}") from None


def _micro_batches(workload: Any, cfg: JobConfig, samples: int) -> list[Any]:
    """The inputs of the run's first ``samples`` training samples (no more than it has), in
    whole micro-batches of the run's size, one at least."""
    data = workload.dataset(cfg.train.seed)
    size = cfg.train.micro_batch_size
    n = min(len(data), max(size, min(samples, len(data)) // size * size))
    return [
        workload.collate([data[i] for i in range(a, min(a + size, n))])[0]
        for a in range(0, n, size)
    ]


def _sample(workload: Any, cfg: JobConfig) -> Any:
    """One micro-batch's inputs of the run's own data (the first samples), or None where the
    data cannot be read here (the run's files moved): the latency is then not measured."""
    try:
        (inputs,) = _micro_batches(workload, cfg, cfg.train.micro_batch_size)
    except Exception:  # noqa: BLE001 - the export itself does not need the data
        return None
    return inputs if hasattr(inputs, "shape") else None


def cpu_latency(
    model: Any, x: Any, runs: int = LATENCY_RUNS, *, budget_s: float = LATENCY_BUDGET_S
) -> tuple[float, int]:
    """(median seconds, forwards timed) of one forward of ``x`` through ``model`` (its layers
    in order, eval mode, no autograd) on one CPU thread, after 3 untimed forwards: ``runs``
    forwards, or as many as ``budget_s`` seconds allow (3 at least)."""
    import statistics
    import time

    import torch

    threads, mode = torch.get_num_threads(), model.training
    torch.set_num_threads(1)
    model.eval()
    times: list[float] = []
    began = time.perf_counter()
    try:
        with torch.no_grad():
            for i in range(runs + 3):
                start = time.perf_counter()
                model(x, 0, 0)
                if i >= 3:
                    times.append(time.perf_counter() - start)
                if len(times) >= 3 and time.perf_counter() - began > budget_s:
                    break
    finally:
        torch.set_num_threads(threads)
        model.train(mode)
    return statistics.median(times), len(times)


def compressed(
    workload: Any,
    model: Any,
    flat: Any,
    *,
    kinds: list[str],
    pad: bool = False,
    uniform: bool = False,
    sample: Any = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shrink ``model`` (holding ``flat``, a pruned run's parameters) to its non-zero groups;
    a Hugging Face workload's config takes the new widths: the widest layer's, with each
    layer's own beside them where they differ (``elaswave.prune.load.load_compressed`` loads that;
    ``pad``: every layer padded with zero groups to a width its config can express, the widest
    layer's, every head of gpt2 and gpt_neox, so that ``from_pretrained`` loads it; ``uniform``:
    every layer as wide as the widest). Returns the parameter counts and the matrix FLOPs per
    sample or token (:func:`~elaswave.prune.compress.matmul_flops`; convolutions counted at the
    size of ``sample``'s inputs), each before and after."""
    from elaswave.prune.compress import hf_config, kept_groups, matmul_flops, shrink
    from elaswave.prune.groups import find_groups
    from elaswave.runtime.workload.hfgroups import HEADS_FIXED

    before, flops = sum(p.numel() for p in model.parameters()), matmul_flops(model, sample)
    families = find_groups(workload, model, kinds)
    hf = getattr(workload, "config", None) is not None and hasattr(workload, "hf_names")
    fixed = hf and pad and getattr(workload.config, "model_type", "") in HEADS_FIXED
    whole = ("attention",) if fixed else ()
    kept = kept_groups(families, model, flat, same_width=hf and (pad or uniform), whole=whole)
    shrink(model, families, kept)
    if hf:
        workload.config = hf_config(workload.config, families, kept)
    after = sum(p.numel() for p in model.parameters())
    return (before, after), (flops, matmul_flops(model, sample))
