"""Structured pruning's quality and what compression saves (``train.prune``, DHSPG and HESSO).

Two pairs of runs, each a dense run and the same run pruned (DHSPG), 2 workers, fault-free:

- ``examples/digits.py``: an MLP (64 → 128 → 128 → 10, ReLU) on scikit-learn's handwritten
  digits, pruned to 0.7 of its hidden channels; test accuracy on the 360 held-out images, dense
  against the compressed model;
- a tiny llama (vocab 256: bytes; hidden 64, MLP 256, 2 layers, 4 heads over 2 key-value heads) on
  real text (this repository's README and docs, as bytes), its MLP channels pruned to 0.5
  (``kinds: [mlp]``, ``uniform``); held-out loss at the same step, dense against pruned.

For each: parameters, FLOPs per sample or token (2 × the matrix products' weights) and the CPU
latency of one forward pass on one thread (median of 100), before and after ``elaswave export
--compress``.

Then a small residual CNN with BatchNorm on the same digits, dense and pruned to half its
groups with DHSPG and with HESSO, three seeds each (:mod:`bench.prune_cnn`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.common import REPO_ROOT, BenchError, bench_env, console, elaswave_launch, print_table
from bench.prune_cnn import run_cnn, show_cnn
from elaswave.prune.compress import matmul_flops

DESCRIPTION = "structured pruning (DHSPG, HESSO): quality vs dense, parameters, FLOPs, CPU latency"
DEFAULT_REPEAT = 1
WORKERS = 2

DIGITS: dict[str, Any] = {
    "model": {"source": "module", "factory": "examples.digits:digits_mlp",
              "args": {"hidden": 128, "depth": 2}},
    "train": {"steps": 800, "global_batch": 64, "micro_batch_size": 16, "lr": 0.003,
              "seed": 1234},
}  # fmt: skip
# lmbda 1.0: OTOv2's Adam default (1e-2) reaches 0.58 here in 800 steps, 0.3 reaches 0.61
DIGITS_PRUNE = {"target_sparsity": 0.7, "tolerance": 0.05, "start_step": 100, "epsilon": 0.95,
                "lmbda": 1.0}  # fmt: skip

LLAMA: dict[str, Any] = {
    "model": {"source": "hf", "seq_len": 64,
              "hf": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                     "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 128}},
    "data": {"source": "tokens", "dtype": "uint16", "eval_samples": 64},
    "train": {"steps": 300, "global_batch": 16, "micro_batch_size": 4, "lr": 0.003,
              "seed": 1234, "eval_every": 300},
}  # fmt: skip
LLAMA_PRUNE = {"target_sparsity": 0.5, "tolerance": 0.05, "start_step": 100, "epsilon": 0.95,
               "kinds": ["mlp"], "uniform": True}  # fmt: skip


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-prune-"))
    env = bench_env(tmp / "state")
    tokens = _text_tokens(tmp / "text.bin")
    count = tokens.stat().st_size // 2
    cells: dict[str, list[dict[str, Any]]] = {"digits": [], "llama": []}
    for i in range(1, repeat + 1):
        cells["digits"].append(_digits(tmp / f"digits-{i}", env))
        cells["llama"].append(_llama(tmp / f"llama-{i}", env, tokens))
        d, m = cells["digits"][-1], cells["llama"][-1]
        console.print(
            f"run {i}/{repeat}: digits accuracy {d['dense']['accuracy']:.3f} dense, "
            f"{d['pruned']['accuracy']:.3f} pruned; llama eval loss "
            f"{m['dense']['eval_loss']:.3f} dense, {m['pruned']['eval_loss']:.3f} pruned"
        )
    cnn = run_cnn(tmp, env)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": "prune",
        "command": "python -m bench prune",
        "workers": WORKERS,
        "digits": {"config": DIGITS, "prune": DIGITS_PRUNE},
        "llama": {"config": LLAMA, "prune": LLAMA_PRUNE, "tokens": count},
        "cells": cells,
        "cnn": cnn,
    }


def _text_tokens(path: Path) -> Path:
    """The repository's README and docs as bytes, one token per byte (uint16)."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    data = b"\n\n".join(f.read_bytes() for f in files)
    np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(path)
    return path


def _job(base: Path, doc: dict[str, Any], prune: dict[str, Any] | None) -> Path:
    doc = json.loads(json.dumps(doc))
    doc["elastic"] = {"nproc_per_node": WORKERS, "nnodes": "1:1", "max_restarts": 0}
    if prune is not None:
        doc["train"]["prune"] = prune
    base.mkdir(parents=True, exist_ok=True)
    path = base / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _train_and_export(
    base: Path, name: str, doc: dict[str, Any], prune: dict[str, Any] | None, env: dict, out: str
) -> tuple[Path, Path]:
    config = _job(base / name, doc, prune)
    run_dir = base / name / "run"
    elaswave_launch(config, run_dir, f"bench-prune-{os.getpid()}-{base.name}-{name}", env=env)
    target = base / name / out
    cmd = [sys.executable, "-m", "elaswave", "export", "--run-dir", str(run_dir),
           "--out", str(target), *(["--compress"] if prune else [])]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: {r.stderr.strip()[-2000:]}")
    return run_dir, target


def _latency(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Median seconds of one forward pass over ``x`` on one thread (100 runs after 10 warm-up
    ones)."""
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        for i in range(110):
            start = time.perf_counter()
            model(x)
            if i >= 10:
                times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return statistics.median(times)


def _digits(base: Path, env: dict) -> dict[str, Any]:
    from safetensors.torch import load_file

    from examples.digits import digits_mlp, held_out

    x, y = held_out(DIGITS["train"]["seed"])
    out = {}
    for name, prune in (("dense", None), ("pruned", DIGITS_PRUNE)):
        run_dir, path = _train_and_export(base, name, DIGITS, prune, env, "model.safetensors")
        workload = digits_mlp(**DIGITS["model"]["args"])
        layers = torch.nn.Sequential(*(workload.build_layer(i, 0) for i in range(3))).eval()
        tensors = {k.removeprefix("layers."): v for k, v in load_file(str(path)).items()}
        for key, value in tensors.items():  # the compressed shapes, where pruned
            owner, _, leaf = key.rpartition(".")
            setattr(layers.get_submodule(owner), leaf, torch.nn.Parameter(value))
        with torch.no_grad():
            accuracy = float((layers(x).argmax(dim=1) == y).float().mean())
        out[name] = {
            "accuracy": accuracy,
            "params": sum(p.numel() for p in layers.parameters()),
            "flops_per_sample": matmul_flops(layers),
            "latency_s": _latency(layers, x),
            "sparsity": _last(run_dir, "sparsity"),
            "train_step_s": _train_step(run_dir, DIGITS_PRUNE["start_step"]),
        }
    return out


def _llama(base: Path, env: dict, tokens: Path) -> dict[str, Any]:
    import transformers

    doc = json.loads(json.dumps(LLAMA))
    doc["data"]["path"] = str(tokens)
    out = {}
    text = np.fromfile(tokens, dtype=np.uint16)[: 8 * 64].astype(np.int64)
    ids = torch.from_numpy(text).view(8, 64)  # a batch of 8 sequences
    for name, prune in (("dense", None), ("pruned", LLAMA_PRUNE)):
        run_dir, path = _train_and_export(base, name, doc, prune, env, "hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        evals = [r for r in _lines(run_dir) if r.get("kind") == "eval"]
        if not evals:
            raise BenchError(f"{run_dir}: no held-out evaluation recorded")
        out[name] = {
            "eval_loss": float(evals[-1]["eval_loss"]),
            "eval_step": int(evals[-1]["step"]),
            "params": model.num_parameters(),
            "intermediate_size": model.config.intermediate_size,
            "flops_per_token": matmul_flops(model),
            "latency_s": _latency(model, ids),
            "sparsity": _last(run_dir, "sparsity"),
            "train_step_s": _train_step(run_dir, LLAMA_PRUNE["start_step"]),
        }
    return out


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_step(run_dir: Path, after: int) -> float:
    """The median ``step_seconds`` of the steps after ``after`` (DHSPG at work in the pruned
    run; the same steps of the dense one)."""
    times = [r["step_seconds"] for r in _lines(run_dir)
             if "kind" not in r and r.get("step", 0) > after]  # fmt: skip
    if not times:
        raise BenchError(f"{run_dir}: no step after step {after}")
    return statistics.median(times)


def _last(run_dir: Path, key: str) -> Any:
    steps = [r for r in _lines(run_dir) if "step" in r and "kind" not in r]
    return steps[-1].get(key) if steps else None


# (key, format) of each column after the model's name, per part
COLUMNS = {
    "digits": (("accuracy", "{:.3f}"), ("params", "{:,.0f}"), ("flops_per_sample", "{:,.0f}")),
    "llama": (("eval_loss", "{:.4f}"), ("params", "{:,.0f}"), ("intermediate_size", "{:.0f}"),
              ("flops_per_token", "{:,.0f}")),
}  # fmt: skip


def _rows(result: dict[str, Any], part: str) -> list[tuple[str, ...]]:
    """Each model's medians over the runs: the part's columns, then latency (ms), sparsity and
    the training step while pruning (ms; the dense run's same steps)."""
    cells = result["cells"][part]
    rows = []
    for name in ("dense", "pruned"):
        med = {k: statistics.median(c[name][k] for c in cells) for k, _ in COLUMNS[part]}
        latency = statistics.median(c[name]["latency_s"] for c in cells) * 1e3
        step = statistics.median(c[name].get("train_step_s", float("nan")) for c in cells) * 1e3
        rows.append(
            (name, *(fmt.format(med[k]) for k, fmt in COLUMNS[part]), f"{latency:.3f}",
             str(cells[0][name]["sparsity"]), f"{step:.2f}")
        )  # fmt: skip
    return rows


def show(result: dict[str, Any]) -> None:
    print_table(
        "Digits MLP, 360 held-out images (latency: one forward of all 360, ms)",
        (
            "model",
            "test accuracy",
            "parameters",
            "FLOPs / sample",
            "latency",
            "sparsity",
            "train step",
        ),
        _rows(result, "digits"),
    )
    print_table(
        "Tiny llama on this repository's text (held-out loss at the last step; latency: one "
        "forward of 8 x 64 tokens, ms)",
        (
            "model",
            "eval loss",
            "parameters",
            "MLP width",
            "FLOPs / token",
            "latency",
            "sparsity",
            "train step",
        ),
        _rows(result, "llama"),
    )
    if "cnn" in result:
        show_cnn(result["cnn"])
