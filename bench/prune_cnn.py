"""``python -m bench prune``'s CNN part: a small residual convolutional net with BatchNorm on the
digits, dense against pruned to half its groups with DHSPG and with HESSO, over three seeds.

The model is ``examples/own_model.py``'s ``small_resnet`` (a stem conv of 16 channels, two
stages of two residual blocks, the second at 32 channels and stride 2, pooling, a Linear) on
the 8 × 8 digits, trained as a plain ``nn.Module`` (``model.source: module``): its groups are
traced (the two residual streams, each block's inner channels). Each run is exported (the
pruned ones with ``--compress``), loaded into ``small_resnet`` and scored on the data set's last
360 images, which no run trains on; parameters and FLOPs (``torch.utils.flop_counter``, one
image) are the exported model's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import REPO_ROOT, BenchError, console, elaswave_launch, print_table

SEEDS = (1, 2, 3)
WORKERS = 2
HELD_OUT = 360

CNN: dict[str, Any] = {
    "model": {"source": "module", "factory": "examples.own_model:small_resnet",
              "args": {"channels": 1, "width": 16, "classes": 10}},
    "data": {"source": "dataset", "factory": "examples.own_model:digit_images",
             "args": {"channels": 1, "size": 8}, "eval_samples": HELD_OUT},
    "train": {"steps": 600, "global_batch": 64, "micro_batch_size": 16, "lr": 0.003,
              "eval_every": 600},
}  # fmt: skip
METHODS: dict[str, dict[str, Any]] = {
    "dhspg": {"target_sparsity": 0.5, "start_step": 100, "epsilon": 0.95, "lmbda": 1.0},
    "hesso": {"method": "hesso", "target_sparsity": 0.5, "start_step": 100,
              "pruning_steps": 300, "pruning_periods": 10},
}  # fmt: skip


def run_cnn(base: Path, env: dict[str, str]) -> dict[str, Any]:
    """Every seed's dense, DHSPG and HESSO runs: accuracy, parameters, FLOPs, sparsity."""
    cells: list[dict[str, Any]] = []
    for seed in SEEDS:
        cell = {}
        for name, prune in (("dense", None), *METHODS.items()):
            cell[name] = _one(base / f"cnn-{seed}-{name}", env, seed, prune)
        cells.append(cell)
        console.print(
            f"cnn seed {seed}: accuracy "
            + ", ".join(f"{n} {c['accuracy']:.3f}" for n, c in cell.items())
            + f"; sparsity dhspg {cell['dhspg']['sparsity']}, hesso {cell['hesso']['sparsity']}"
        )
    return {"config": CNN, "methods": METHODS, "seeds": list(SEEDS), "cells": cells}


def _one(base: Path, env: dict[str, str], seed: int, prune: dict[str, Any] | None) -> dict:
    """One run of ``seed`` (pruned with ``prune``), exported and scored."""
    from elaswave.prune.load import load_compressed_module
    from examples.own_model import digit_images, small_resnet

    doc = json.loads(json.dumps(CNN))
    doc["train"]["seed"] = seed
    doc["elastic"] = {"nproc_per_node": WORKERS, "nnodes": "1:1", "max_restarts": 0}
    if prune is not None:
        doc["train"]["prune"] = prune
    base.mkdir(parents=True, exist_ok=True)
    (base / "job.yaml").write_text(yaml.safe_dump(doc))
    run_dir, out = base / "run", base / "model.safetensors"
    elaswave_launch(base / "job.yaml", run_dir, f"bench-cnn-{os.getpid()}-{base.name}", env=env)
    cmd = [sys.executable, "-m", "elaswave", "export", "--run-dir", str(run_dir), "--out",
           str(out), *(["--compress"] if prune else [])]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: {r.stderr.strip()[-2000:]}")
    model = load_compressed_module(small_resnet(**CNN["model"]["args"]), out)
    data = digit_images(**CNN["data"]["args"])
    x = torch.stack([data[i][0] for i in range(len(data) - HELD_OUT, len(data))])
    y = torch.stack([data[i][1] for i in range(len(data) - HELD_OUT, len(data))])
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).double().mean())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "kind" not in s]
    return {
        "accuracy": accuracy,
        "params": sum(p.numel() for p in model.parameters()),
        "flops": _flops(model, x[:1]),
        "sparsity": steps[-1].get("sparsity"),
    }


def _flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return int(counter.get_total_flops())


def cnn_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """Each model's medians over the seeds (accuracy, parameters, FLOPs), its accuracy gap to
    dense (median of the seeds' gaps) and each seed's sparsity."""
    cells = result["cells"]
    rows = []
    for name in ("dense", *result["methods"]):
        med = {k: statistics.median(c[name][k] for c in cells) for k in ("accuracy", "params",
                                                                            "flops")}  # fmt: skip
        gap = statistics.median(c[name]["accuracy"] - c["dense"]["accuracy"] for c in cells)
        sparsity = " ".join(f"{c[name]['sparsity']:.3f}" if c[name]["sparsity"] else "–"
                            for c in cells)  # fmt: skip
        rows.append((name, f"{med['accuracy']:.3f}", f"{gap * 100:+.1f}", f"{med['params']:,.0f}",
                     f"{med['flops']:,.0f}", sparsity))  # fmt: skip
    return rows


def show_cnn(result: dict[str, Any]) -> None:
    print_table(
        f"Digits CNN (small_resnet), {HELD_OUT} held-out images, median of seeds "
        f"{', '.join(map(str, result['seeds']))}",
        ("model", "test accuracy", "vs dense (points)", "parameters", "FLOPs / image",
         "sparsity by seed"),
        cnn_rows(result),
    )  # fmt: skip
