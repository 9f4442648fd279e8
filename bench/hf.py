"""A Hugging Face model, 4 workers: ElasWave's step time against plain DDP on the same model and
batches, in float32 and under bf16 autocast.

The model is ``bench/llama-10m.yaml`` (a Llama-style decoder of about 10 M parameters from
transformers) unless ``--config`` names another. Per round, in this order: ElasWave float32,
DDP float32, ElasWave bf16, DDP bf16 (``train.autocast: bf16`` for both), so that drift on a
shared machine hits every variant alike. Step times are measured as in ``overhead`` (medians of
the per-step wall intervals after ``WARMUP`` steps); ratios are paired within a round.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    DEFAULT_CONFIG,
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

DESCRIPTION = "HF llama (~10 M params), 4 workers: step time vs DDP, float32 and bf16 autocast"
DEFAULT_REPEAT = 3
CONFIG = Path(__file__).with_name("llama-10m.yaml")
STEPS, WARMUP, WORLD = 20, 4, 4
GOAL_RATIO = 1.05
VARIANTS = {
    "elaswave": "ElasWave, float32",
    "ddp": "PyTorch DDP, float32",
    "elaswave_bf16": "ElasWave, bf16 autocast",
    "ddp_bf16": "PyTorch DDP, bf16 autocast",
}


def run(repeat: int, config: Path) -> dict[str, Any]:
    if config == DEFAULT_CONFIG.resolve():
        config = CONFIG
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-hf-"))
    configs = {dtype: _variant_config(config, tmp, dtype) for dtype in ("off", "bf16")}
    params = _parameters(configs["off"])
    rounds: list[dict[str, Any]] = []
    for r in range(1, repeat + 1):
        row = {}
        for name in VARIANTS:
            began = time.perf_counter()
            cfg = configs["bf16" if name.endswith("bf16") else "off"]
            row[name] = _run_variant(name, cfg, tmp / f"r{r}-{name}", job=f"{r}-{name}")
            console.print(
                f"round {r}/{repeat} {name:>13}: {ms(row[name]['step_median_s'])} ms/step "
                f"(run {time.perf_counter() - began:.0f} s)"
            )
        rounds.append(row)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {n: summarize(r[n]["step_median_s"] for r in rounds) for n in VARIANTS}
    pairs = {
        "elaswave/ddp (float32)": ("elaswave", "ddp"),
        "elaswave/ddp (bf16)": ("elaswave_bf16", "ddp_bf16"),
        "bf16/float32 (ElasWave)": ("elaswave_bf16", "elaswave"),
        "bf16/float32 (DDP)": ("ddp_bf16", "ddp"),
    }
    paired = {
        label: summarize(r[a]["step_median_s"] / r[b]["step_median_s"] for r in rounds)
        for label, (a, b) in pairs.items()
    }
    loss_gap = {
        dtype: max(
            abs(a - b)
            for r in rounds
            for a, b in zip(r[f"elaswave{s}"]["loss"], r[f"ddp{s}"]["loss"], strict=True)
        )
        for dtype, s in (("float32", ""), ("bf16", "_bf16"))
    }
    ratio = paired["elaswave/ddp (float32)"]["median"]
    return {
        "scenario": "hf",
        "config": str(
            config.relative_to(Path.cwd()) if config.is_relative_to(Path.cwd()) else config
        ),
        "parameters": params,
        "commands": {
            "elaswave": launch_command(configs["off"], ["--steps", str(STEPS)]),
            "ddp": f"bench.ddp_baseline.run_ddp (torch.multiprocessing.spawn, {WORLD} gloo ranks)",
            "bf16": "the same with train.autocast: bf16",
        },
        "repeat": repeat,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "world": WORLD,
        "variants": VARIANTS,
        "rounds": rounds,
        "summary": summary,
        "paired": paired,
        "max_abs_loss_diff_elaswave_vs_ddp": loss_gap,
        "goal": {"ratio_max": GOAL_RATIO, "met": ratio <= GOAL_RATIO},
    }


def _variant_config(config: Path, tmp: Path, autocast: str) -> Path:
    data = yaml.safe_load(config.read_text())
    data.setdefault("elastic", {})["nproc_per_node"] = WORLD
    data.setdefault("train", {})["autocast"] = autocast
    out = tmp / f"{config.stem}-{autocast}.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def _parameters(config: Path) -> int:
    from elaswave.config import load_config
    from elaswave.runtime.workload.load import load_workload

    workload = load_workload(load_config(config, env={}))
    meta = getattr(workload, "_model", None)  # HF: the meta model (no memory)
    if meta is None:
        return -1
    return sum(p.numel() for p in meta.parameters())


def _run_variant(name: str, config: Path, out: Path, job: str) -> dict[str, Any]:
    out.mkdir()
    if name.startswith("ddp"):
        return measure(run_ddp(config, steps=STEPS, world=WORLD, out_dir=out), steps=STEPS,
                       warmup=WARMUP)  # fmt: skip
    env = bench_env(out.parent / "state", {})
    job_id = f"bench-hf-{os.getpid()}-{job.replace('_', '-')}"
    elaswave_launch(config, out / "run", job_id, env=env, extra_args=["--steps", str(STEPS)])
    result = measure_elaswave(out / "run", steps=STEPS, warmup=WARMUP)
    del result["first_end"], result["last_end"]
    return result


def show(result: dict[str, Any]) -> None:
    rows = [
        (label, ms(result["summary"][name]["median"]),
         f"{ms(result['summary'][name]['min'])}–{ms(result['summary'][name]['max'])}")
        for name, label in result["variants"].items()
    ]  # fmt: skip
    print_table(
        f"HF model ({result['parameters'] / 1e6:.1f} M parameters), {result['world']} workers, "
        f"{result['repeat']} interleaved rounds, steps {result['warmup_steps'] + 1}–"
        f"{result['steps']}: ms/step (median of round medians)",
        ("variant", "ms/step", "spread"),
        rows,
    )
    for label, s in result["paired"].items():
        console.print(f"paired {label}: median {s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})")
    gap = result["max_abs_loss_diff_elaswave_vs_ddp"]
    console.print(
        f"max |loss ElasWave − DDP|: float32 {gap['float32']:.2e}, bf16 {gap['bf16']:.2e}"
    )
    goal = result["goal"]
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(f"goal: ElasWave/DDP (float32) <= {goal['ratio_max']:g} — {verdict}")
