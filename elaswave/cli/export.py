"""``elaswave export``: write a run's trained model, for ``model.source: hf`` a directory that
``AutoModelForCausalLM.from_pretrained`` loads, otherwise one safetensors file.
"""

from __future__ import annotations

from pathlib import Path

import typer

from elaswave.cli.common import fail, out
from elaswave.errors import ElasWaveError


def export(
    run_dir: Path = typer.Option(..., "--run-dir", help="The run's directory."),
    out_path: Path = typer.Option(
        ..., "--out", help="HF models: a directory; others: a .safetensors file."
    ),
    step: int | None = typer.Option(None, "--step", help="A checkpointed step; default: newest."),
    compress: bool = typer.Option(
        False, "--compress", help="A pruned run (train.prune): write the smaller model."
    ),
    pad: bool = typer.Option(
        False,
        "--pad",
        help="With --compress, HF models: every layer as wide as the widest, so that "
        "from_pretrained loads it (always so after train.prune.uniform; otherwise layers of "
        "different widths load with elaswave.prune.load.load_compressed).",
    ),
) -> None:
    """Write a run's trained model: for model.source hf a directory that
    AutoModelForCausalLM.from_pretrained loads, otherwise one safetensors file."""
    from elaswave.export import export_model

    try:
        done = export_model(run_dir, out_path, step, compress=compress, pad=pad)
    except ElasWaveError as exc:
        raise fail(exc) from None
    if done.skipped:
        out.print(f"skipped newer checkpoints that failed their check: {done.skipped}",
                  highlight=False, soft_wrap=True)  # fmt: skip
    out.print(
        f"exported step {done.step} (loss {done.loss:.4f}) from {done.checkpoint} to {done.out}",
        highlight=False,
        soft_wrap=True,
    )
    if done.sizes is not None and done.flops is not None:
        (before, after), (f0, f1) = done.sizes, done.flops
        out.print(
            f"compressed: {after:,} parameters of {before:,} ({after / before:.1%}); "
            f"{f1:,} matrix FLOPs per sample or token of {f0:,} ({f1 / f0:.1%})",
            highlight=False,
            soft_wrap=True,
        )
    if done.latency and done.latency_input and done.latency_runs:
        (l0, l1), shape = done.latency, "×".join(map(str, done.latency_input))
        n = min(done.latency_runs)
        out.print(
            f"CPU latency (one thread, a {shape} micro-batch, median of {n}): "
            f"{l1 * 1e3:.2f} ms of {l0 * 1e3:.2f} ms ({l1 / l0:.2f}×)",
            highlight=False,
            soft_wrap=True,
        )
