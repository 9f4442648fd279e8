"""ZeRO-3 against ZeRO-1 and replicated data parallelism on the ~60 M-parameter Llama-style model
of ``stagemem`` (transformers, random init), 4 workers: what each rank holds, its peak resident
set, the fault-free step time and the crash MTTR.

Per round, in this order (each mode with its defaults: snapshots every step, verification every
10 steps for ZeRO):

- *fault-free*: ``elaswave launch`` of ``STEPS`` steps with ``--zero 0`` (replicated),
  ``--zero 1`` and ``--zero 3``. Per rank, what the worker says it holds (its ``memory`` events:
  parameter, gradient — with the step's reduction buffer —, optimizer and recovery-copy bytes,
  the last each worker reported; ZeRO-3's most bytes held at once in a step, the largest it
  reported: of gathered layers' parameters ``gathered_bytes``, of layer gradients and their
  reduction's buffers ``layer_grad_bytes``, of both ``transient_bytes``), and its peak resident set
  sampled from the operating system every 0.1 s as ``stagemem`` samples it. Step time: the
  median ``step_seconds`` of the steps after the first ``WARMUP`` (start-up, first allocations),
  and the median wall interval between their commits;
- *crash*: ``CRASH_STEPS`` steps with ``--zero 1`` and ``--zero 3``, rank 1 SIGKILLed while step
  ``FAULT_STEP`` is in flight; MTTR and its phases from the run's single incident, as ``mttr``
  reads it (no step lost or committed twice). ZeRO-3 redoes the interrupted step whole.

The whole model's state is its parameter, gradient and optimizer bytes: float32 parameters, a
float32 gradient (the job's ``reduce_dtype``) and two float32 Adam moments, 16 bytes per
parameter. A ZeRO-3 rank's (parameters + gradients + optimizer) is compared with that over N,
the number of data-parallel ranks; the transient peaks with the largest layer's float32
parameters (the embedding and the head here: 16.4 M each, a block 3.4 M). Ratios between modes
are paired within a round; memory figures are over every rank of every round, time figures
over rounds.

Goals (60 M llama, 4 workers, 2 cores): ZeRO-3 (params + grads + optimizer) per rank ≤ 1.1 ×
(the whole model's / N) on every rank; ``gathered_bytes`` ≤ 2 layers' worth on every rank;
ZeRO-3 step time ≤ 1.3 × ZeRO-1's. The crash MTTR of ZeRO-3 against ZeRO-1 is a measurement.
Five launches a round, 42 steps in all (and the two redone ones), kept few for 2 cores:
``--repeat 1`` takes about 5 minutes on 2 idle cores. The model is fixed (``--config`` is not
used).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    bench_env,
    console,
    diffs,
    elaswave_launch,
    ms,
    print_table,
    read_jsonl,
    summarize,
)
from bench.mttr import PHASES
from bench.mttr import _check as check_recovered  # one recovered incident, no step lost
from bench.stagemem import MODEL, WORLD, job_config
from bench.stagemem import _launch as launch_sampled  # the launch, and each worker's peak RSS

DESCRIPTION = "ZeRO-3 vs ZeRO-1 vs replicated (60 M llama): bytes/rank, peak RSS, step, MTTR"
DEFAULT_REPEAT = 1
STEPS = 10
WARMUP = 3  # steps left out of the step-time medians
CRASH_STEPS = 6
FAULT_STEP = 4
FAULT = f"kill,rank=1,at_step={FAULT_STEP}"
MODES: dict[str, tuple[str, list[str]]] = {
    "replicated": ("replicated DP (--zero 0)", ["--zero", "0"]),
    "zero1": ("ZeRO-1 (--zero 1)", ["--zero", "1"]),
    "zero3": ("ZeRO-3 (--zero 3)", ["--zero", "3"]),
}
CRASHED = ("zero1", "zero3")
STEP_KEYS = ("step_s", "interval_s")  # step_seconds; commit to commit
FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "replica_bytes", "gathered_bytes",
          "layer_grad_bytes", "transient_bytes")  # fmt: skip
PEAKS = ("gathered_bytes", "layer_grad_bytes", "transient_bytes")  # the most a step held
PARAM_BYTES = 4  # float32 parameters
STATE_BYTES = 4 + 4 + 8  # per parameter: float32 parameter, gradient, two Adam moments
GOALS = {
    "zero3_state_over_share": 1.1,  # (params + grads + optimizer) / (whole / N), every rank
    "zero3_gathered_layers": 2.0,  # gathered_bytes / the largest layer's parameters, every rank
    "step_zero3_over_zero1": 1.3,  # paired step-time ratio (median over rounds)
}


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-zero3-"))
    env = bench_env(tmp / "state")
    cfg = job_config(tmp / "config.yaml", STEPS)
    layers = _layer_sizes(cfg)
    rounds: list[dict[str, Any]] = []
    for r in range(1, repeat + 1):
        row: dict[str, Any] = {"fault_free": {}, "crash": {}}
        for mode, (_, args) in MODES.items():
            cell = _fault_free(cfg, tmp / f"r{r}-{mode}", mode, args, env, r)
            row["fault_free"][mode] = cell
            held = [_state(m) for m in cell["memory"].values()]
            console.print(
                f"round {r}/{repeat} {mode:>10}: params+grads+optimizer "
                f"{statistics.median(held) / 2**20:.1f} MB/rank, peak RSS "
                f"{statistics.median(cell['peak_rss_bytes']) / 2**20:.0f} MB, "
                f"{cell['step_s']:.3f} s/step (run {cell['launch_s']:.0f} s)"
            )
        for mode in CRASHED:
            inc = _crash(cfg, tmp / f"r{r}-crash-{mode}", mode, env, r)
            row["crash"][mode] = inc
            console.print(
                f"round {r}/{repeat} {mode:>10} crash: MTTR {ms(inc['mttr_s'])} ms (detection "
                f"{ms(inc['detection_s'])}, state {ms(inc['state_s'])}, redo "
                f"{ms(inc['redo_s'])} ms; run {inc['launch_s']:.0f} s)"
            )
        rounds.append(row)
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    return {
        "scenario": "zero3",
        "command": f"python -m bench zero3 --repeat {repeat}",
        "launches": {
            **{m: _command(args) for m, (_, args) in MODES.items()},
            **{f"crash_{m}": _command([*MODES[m][1], "--fault", FAULT]) for m in CRASHED},
        },
        "job": "bench.stagemem.job_config: llama-10m.yaml with the 60 M model, 4 workers, "
        "global batch 8, micro-batch 1",
        "model": MODEL,
        "repeat": repeat,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "crash_steps": CRASH_STEPS,
        "fault": FAULT,
        "world": WORLD,
        "modes": {m: label for m, (label, _) in MODES.items()},
        "rounds": rounds,
        **summary(rounds, layers, WORLD),
    }


def _command(args: Sequence[str]) -> str:
    return " ".join(["elaswave launch JOB.yaml --run-dir DIR --job-id ID --pp 1", *args, "--quiet"])


def _layer_sizes(cfg: Path) -> list[int]:
    """Each layer's parameter count (embedding, blocks, head)."""
    from elaswave.config import load_config
    from elaswave.runtime.workload.load import build_model

    return [n for _, n in build_model(load_config(cfg, env={})).segments()]


def _fault_free(
    cfg: Path, out: Path, mode: str, args: list[str], env: dict[str, str], r: int
) -> dict[str, Any]:
    job_id = f"bench-zero3-{os.getpid()}-{r}-{mode}"
    began = time.time()
    peaks = launch_sampled(cfg, out, job_id, 1, env, extra_args=args)
    launch_s = time.time() - began
    events = read_jsonl(out / "events.jsonl")
    _check_mode(out, events, mode)
    memory = _memory(events)
    if len(memory) != WORLD or len(peaks) != WORLD:
        raise BenchError(
            f"{out}: {len(memory)} workers reported their memory and {len(peaks)} were sampled, "
            f"not {WORLD}"
        )
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "kind" not in m]
    metrics.sort(key=lambda m: m["step"])
    if [m["step"] for m in metrics] != list(range(1, STEPS + 1)):
        raise BenchError(f"{out}: committed {[m['step'] for m in metrics]}")
    return {
        "memory": memory,
        "peak_rss_bytes": peaks,
        "step_s": statistics.median(m["step_seconds"] for m in metrics[WARMUP:]),
        # the wall intervals ending at steps WARMUP+1 .. STEPS (commit to commit)
        "interval_s": statistics.median(diffs([m["time"] for m in metrics[WARMUP - 1 :]])),
        "loss": [m["loss"] for m in metrics],
        "launch_s": round(launch_s, 3),
    }


def _memory(events: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per worker: the bytes it last said it holds, and the most of each of ``PEAKS`` it
    said."""
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if e["kind"] != "memory" or not e.get("worker"):
            continue
        m = {f: int(e.get(f, 0)) for f in FIELDS}
        for f in PEAKS:
            m[f] = max(m[f], out.get(e["worker"], m)[f])
        out[e["worker"]] = m
    return out


def _check_mode(run_dir: Path, events: list[dict[str, Any]], mode: str) -> None:
    """The launch really ran the asked mode: ZeRO's sync reports ``max_over_mean``, only ZeRO-3
    gathers layers."""
    synced = [e for e in events if e["kind"] == "state_synced"]
    gathered = [e.get("gathered_bytes", 0) for e in events if e["kind"] == "memory"]
    sharded = bool(synced) and all("max_over_mean" in e for e in synced)
    if not synced or any(("max_over_mean" in e) != sharded for e in synced) or not gathered:
        raise BenchError(f"{run_dir}: no memory or mixed state_synced events")
    if (sharded, max(gathered) > 0) != (mode != "replicated", mode == "zero3"):
        raise BenchError(f"{run_dir}: expected {mode}, events say otherwise")


def _crash(cfg: Path, out: Path, mode: str, env: dict[str, str], r: int) -> dict[str, Any]:
    job_id = f"bench-zero3-{os.getpid()}-{r}-crash-{mode}"
    args = ["--steps", str(CRASH_STEPS), *MODES[mode][1], "--fault", FAULT]
    began, ended = elaswave_launch(cfg, out, job_id, env=env, extra_args=args, timeout=1800)
    return check_recovered(out, CRASH_STEPS, ended - began)


def _state(m: Mapping[str, int]) -> int:
    """A rank's parameter + gradient + optimizer bytes."""
    return m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]


def summary(rounds: list[dict[str, Any]], layers: Sequence[int], world: int) -> dict[str, Any]:
    """Medians, spreads, ratios and goals from the rounds (each: ``fault_free`` cells per mode,
    ``crash`` incidents per crashed mode); ``layers``: each layer's parameter count; ``world``:
    the data-parallel ranks of the fault-free runs (N). Pure."""
    whole = STATE_BYTES * sum(layers)
    share, layer = whole / world, PARAM_BYTES * max(layers)
    memory = {}
    for mode in MODES:
        ranks = [m for r in rounds for m in r["fault_free"][mode]["memory"].values()]
        memory[mode] = {
            **{f: summarize(m[f] for m in ranks) for f in FIELDS},
            "state_bytes": summarize(_state(m) for m in ranks),
            "state_over_share": summarize(_state(m) / share for m in ranks),
            "gathered_layers": summarize(m["gathered_bytes"] / layer for m in ranks),
            "layer_grad_layers": summarize(m["layer_grad_bytes"] / layer for m in ranks),
            "transient_layers": summarize(m["transient_bytes"] / layer for m in ranks),
            "peak_rss_bytes": summarize(
                p for r in rounds for p in r["fault_free"][mode]["peak_rss_bytes"]
            ),
        }
    step = {
        mode: {k: summarize(r["fault_free"][mode][k] for r in rounds) for k in STEP_KEYS}
        for mode in MODES
    }

    def paired(a: str, b: str, key: str, kind: str = "fault_free") -> dict[str, Any]:
        return summarize(r[kind][a][key] / r[kind][b][key] for r in rounds)

    ratios = {
        "step_zero3_over_zero1": paired("zero3", "zero1", "step_s"),
        "interval_zero3_over_zero1": paired("zero3", "zero1", "interval_s"),
        "step_zero3_over_replicated": paired("zero3", "replicated", "step_s"),
        "step_zero1_over_replicated": paired("zero1", "replicated", "step_s"),
        "mttr_zero3_over_zero1": paired("zero3", "zero1", "mttr_s", "crash"),
    }
    mttr = {m: {p: summarize(r["crash"][m][p] for r in rounds) for p in PHASES} for m in CRASHED}
    loss_gap = {
        mode: max(
            abs(a - b)
            for r in rounds
            for a, b in zip(
                r["fault_free"][mode]["loss"], r["fault_free"]["replicated"]["loss"], strict=True
            )
        )
        for mode in ("zero1", "zero3")
    }
    z3 = memory["zero3"]
    measured = {
        "zero3_state_over_share": z3["state_over_share"]["max"],
        "zero3_gathered_layers": z3["gathered_layers"]["max"],
        "step_zero3_over_zero1": ratios["step_zero3_over_zero1"]["median"],
    }
    return {
        "parameters": sum(layers),
        "layers": list(layers),
        "whole_state_bytes": whole,
        "share_bytes": share,
        "largest_layer_bytes": layer,
        "memory": memory,
        "step": step,
        "ratios": ratios,
        "mttr": mttr,
        "max_abs_loss_diff_vs_replicated": loss_gap,
        "goals": {
            k: {"max": GOALS[k], "measured": v, "met": v is not None and v <= GOALS[k]}
            for k, v in measured.items()
        },
    }


def _spread(s: Mapping[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """``median (min–max)`` of a :func:`summarize` result, times ``scale``."""
    if s["median"] is None:
        return "–"
    med, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def show(result: dict[str, Any]) -> None:
    mb = 1 / 2**20
    rows = []
    for mode, label in result["modes"].items():
        m = result["memory"][mode]
        rows.append(
            (label, f"{m['param_bytes']['median'] * mb:.1f}",
             f"{m['grad_bytes']['median'] * mb:.1f}",
             f"{m['optimizer_bytes']['median'] * mb:.1f}", _spread(m["state_bytes"], mb),
             _spread(m["state_over_share"], digits=2), f"{m['replica_bytes']['median'] * mb:.1f}",
             _spread(m["gathered_bytes"], mb), _spread(m["gathered_layers"], digits=2),
             _spread(m["peak_rss_bytes"], mb, 0))
        )  # fmt: skip
    runs = f"{result['repeat']} run{'s' if result['repeat'] > 1 else ''}"
    print_table(
        f"State per rank, {result['world']} workers, {result['parameters'] / 1e6:.1f} M "
        f"parameters: MB, median rank (min–max over the ranks of {runs}); the whole model's "
        f"params + grads + optimizer {result['whole_state_bytes'] * mb:.1f} MB, / N = "
        f"{result['share_bytes'] * mb:.1f} MB; largest layer "
        f"{result['largest_layer_bytes'] * mb:.1f} MB",
        ("mode", "params", "grads", "optimizer", "params+grads+opt", "/ (whole / N)",
         "recovery copies", "gathered peak", "layers' worth", "peak RSS"),
        rows,
    )  # fmt: skip
    z3 = result["memory"]["zero3"]
    print_table(
        "ZeRO-3's transient buffers at their peak in a step: MB (layers' worth: / the largest "
        "layer's float32 parameters), median rank (min–max)",
        ("gathered parameters", "layer gradients and their reduction", "both at once"),
        [tuple(f"{_spread(z3[f'{k}_bytes'], mb)}; {_spread(z3[f'{k}_layers'], digits=2)}"
               for k in ("gathered", "layer_grad", "transient"))],
    )  # fmt: skip
    rows = []
    for mode, label in result["modes"].items():
        s = result["step"][mode]
        rows.append((label, _spread(s["step_s"], digits=3), _spread(s["interval_s"], digits=3)))
    print_table(
        f"Fault-free step time, s: median of {runs}' medians (min–max), steps "
        f"{result['warmup_steps'] + 1}–{result['steps']}",
        ("mode", "step_seconds", "commit to commit"),
        rows,
    )
    rows = []
    for phase in PHASES:
        name = phase.removesuffix("_s")
        rows.append(
            (f"[bold]{name.upper()}[/bold]" if phase == "mttr_s" else name,
             *(_spread(result["mttr"][m][phase], 1000) for m in CRASHED))
        )  # fmt: skip
    print_table(
        f"Crash MTTR ({result['fault']}, {result['crash_steps']} steps), ms: median (min–max) "
        f"of {runs}",
        ("phase", *(result["modes"][m] for m in CRASHED)),
        rows,
    )
    for key, label in (
        ("step_zero3_over_zero1", "step time ZeRO-3 / ZeRO-1"),
        ("interval_zero3_over_zero1", "commit interval ZeRO-3 / ZeRO-1"),
        ("step_zero3_over_replicated", "step time ZeRO-3 / replicated"),
        ("step_zero1_over_replicated", "step time ZeRO-1 / replicated"),
        ("mttr_zero3_over_zero1", "MTTR ZeRO-3 / ZeRO-1"),
    ):
        s = result["ratios"][key]
        console.print(f"paired {label}: {_spread(s, digits=3)}")
    gap = result["max_abs_loss_diff_vs_replicated"]
    console.print(
        f"max |loss − replicated's| (float32): ZeRO-1 {gap['zero1']:.2e}, ZeRO-3 {gap['zero3']:.2e}"
    )
    labels = {
        "zero3_state_over_share": "ZeRO-3 (params + grads + optimizer) / (whole / N), every rank",
        "zero3_gathered_layers": "ZeRO-3 gathered peak in layers' worth, every rank",
        "step_zero3_over_zero1": "ZeRO-3 / ZeRO-1 step time (paired median)",
    }
    for key, goal in result["goals"].items():
        verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
        measured = "–" if goal["measured"] is None else f"{goal['measured']:.3f}"
        console.print(f"goal: {labels[key]} <= {goal['max']:g} — {verdict} ({measured})")
