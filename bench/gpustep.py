"""One worker's step time on a GPU: ElasWave against a plain PyTorch loop on the same GPU.

The same job (``--config``, default gpt-tiny: model, data, global batch, micro-batches, keyed
dropout, AdamW with the config's hyper-parameters, float32) trained for ``STEPS`` steps

* by one ElasWave worker: ``elaswave launch --device cuda --nproc-per-node 1`` (an NCCL group of
  one; the step's reduction, commit report and plan check included);
* by :func:`bench.ddp_baseline.run_ddp` with ``world=1`` on the same GPU: the bare model in a
  plain loop (forward and backward of every micro-batch, one optimizer step), the clock read
  once the device finished the step.

Rounds alternate the two (ElasWave, then the loop), so slow drift hits both alike. Per run: the
median of the per-step wall intervals after ``WARMUP`` steps (ElasWave: the commits' ``time``
in ``metrics.jsonl``; the loop: its step ends), and the median time inside the step. The
summary is the median over rounds and the ratio ElasWave / loop, also paired per round; and
the largest loss difference between the two, to show that both did the same work.

Needs a CUDA device: without one it says so in one line and fails. ``--device cpu`` runs the
same plumbing on the CPU (``DRY_STEPS`` steps, CPU numbers: a dry run, not a measurement).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    bench_env,
    console,
    elaswave_launch,
    launch_command,
    ms,
    print_table,
    summarize,
)
from bench.ddp_baseline import run_ddp
from bench.overhead import measure, measure_elaswave

DESCRIPTION = "one worker's step time on a GPU: ElasWave vs a plain PyTorch loop, same GPU"
DEFAULT_REPEAT = 3
STEPS, WARMUP = 30, 5  # on the GPU: steps a run trains, and how many of them start it up
DRY_STEPS, DRY_WARMUP = 8, 2  # --device cpu: the plumbing only
DEVICES = ("cuda", "cpu")
VARIANTS = {"elaswave": "ElasWave, one worker (a group of one)", "plain": "plain PyTorch loop"}


def require(device: str, cuda_available: bool) -> None:
    """A one-line :class:`BenchError` unless ``device`` can run here."""
    if device not in DEVICES:
        raise BenchError(f"gpustep runs on cuda or cpu, not {device!r}")
    if device == "cuda" and not cuda_available:
        raise BenchError(
            "gpustep needs a CUDA device and this machine has none "
            "(--device cpu runs its plumbing on the CPU)"
        )


def run(repeat: int, config: Path, device: str = "cuda") -> dict[str, Any]:
    import torch

    require(device, torch.cuda.is_available())
    steps, warmup = (STEPS, WARMUP) if device == "cuda" else (DRY_STEPS, DRY_WARMUP)
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-gpustep-"))
    args = ["--device", device, "--nproc-per-node", "1", "--steps", str(steps)]
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(1, repeat + 1):
            row: dict[str, Any] = {}
            for name in VARIANTS:
                out = tmp / f"r{r}-{name}"
                out.mkdir()
                began = time.perf_counter()
                if name == "elaswave":
                    job = f"bench-gpustep-{os.getpid()}-{r}"
                    env = bench_env(tmp / "state")  # --device on the command line wins
                    elaswave_launch(config, out / "run", job, env=env, extra_args=args)
                    row[name] = measure_elaswave(out / "run", steps, warmup)
                    del row[name]["first_end"], row[name]["last_end"]
                else:
                    raw = run_ddp(config, steps=steps, world=1, out_dir=out, device=device)
                    row[name] = measure(raw, steps=steps, warmup=warmup)
                console.print(
                    f"round {r}/{repeat} {name:>8}: {ms(row[name]['step_median_s'])} ms/step "
                    f"(in-step {ms(row[name]['in_step_median_s'])} ms; "
                    f"run {time.perf_counter() - began:.0f} s)"
                )
            rounds.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary(rounds, device=device, steps=steps, warmup=warmup, config=config, args=args)


def summary(
    rounds: list[dict[str, Any]],
    *,
    device: str,
    steps: int,
    warmup: int,
    config: Path,
    args: list[str],
) -> dict[str, Any]:
    """The scenario's result from its rounds (each: ``measure``'s dict per variant)."""
    stats = {
        name: {
            "step_s": summarize(r[name]["step_median_s"] for r in rounds),
            "in_step_s": summarize(r[name]["in_step_median_s"] for r in rounds),
        }
        for name in VARIANTS
    }
    plain = stats["plain"]["step_s"]["median"]
    paired = [r["elaswave"]["step_median_s"] / r["plain"]["step_median_s"] for r in rounds]
    loss_gap = max(
        abs(a - b)
        for r in rounds
        for a, b in zip(r["elaswave"]["loss"], r["plain"]["loss"], strict=True)
    )
    return {
        "scenario": "gpustep",
        "device": device,
        "dry_run": device != "cuda",
        "commands": {
            "elaswave": launch_command(config, args),
            "plain": f"bench.ddp_baseline.run_ddp(world=1, device={device!r}): a plain loop",
        },
        "repeat": len(rounds),
        "steps": steps,
        "warmup_steps": warmup,
        "variants": VARIANTS,
        "rounds": rounds,
        "summary": stats,
        "ratio_vs_plain": stats["elaswave"]["step_s"]["median"] / plain,
        "ratio_vs_plain_paired": summarize(paired),
        "max_abs_loss_diff": loss_gap,
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, label in result["variants"].items():
        s = result["summary"][name]
        spread = f"{ms(s['step_s']['min'], 2)}–{ms(s['step_s']['max'], 2)}"
        rows.append((label, ms(s["step_s"]["median"], 2), spread, ms(s["in_step_s"]["median"], 2)))
    dry = " (a CPU dry run: not a GPU measurement)" if result["dry_run"] else ""
    print_table(
        f"One worker's step time on {result['device']}{dry}, {result['repeat']} interleaved "
        f"rounds (median of per-round medians, steps {result['warmup_steps'] + 1}–"
        f"{result['steps']}), ms",
        ("variant", "ms/step", "spread", "in-step"),
        rows,
    )
    paired = result["ratio_vs_plain_paired"]
    console.print(
        f"ElasWave / plain loop: {result['ratio_vs_plain']:.3f} (paired per round: median "
        f"{paired['median']:.3f}, range {paired['min']:.3f}–{paired['max']:.3f}); "
        f"max |loss difference| {result['max_abs_loss_diff']:.2e}"
    )
