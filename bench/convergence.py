"""Convergence deviation after faults, ablated: what keeps ElasWave's loss on the fault-free curve.

One job, ``bench/gpt-text.yaml`` (gpt-tiny's model with dropout 0.1 on this repository's docs as
bytes, 4 workers, 1,000 steps), three faults: rank 1 killed at step 200 and respawned (a join, a
few steps later), rank 2 killed at step 500 and not respawned (``max_restarts: 1``: three ranks to
the end). Each system's faulted run is compared, step by step, with a fault-free run:

* **ElasWave**: sample-keyed random numbers, the fixed global batch (its defaults), against its
  fault-free run; and the same in the float64 mode (``train.reduce_dtype: float64``), against its
  own fault-free run, which shows how much of ElasWave's deviation is float32's summation order
  (a sum over three ranks rounds unlike one over four);
* **rank-keyed RNG** (``train.rng: rank``): dropout keyed by the computing rank and the
  micro-batch's place among its own, as a loop that seeds each rank draws; against its own
  fault-free run (the same world draws the same masks);
* **shrinking batch** (``train.batch: shrink``, ``train.partial_redo: false``): each rank keeps its
  four micro-batches, so three ranks train 24 samples a step instead of 32; against ElasWave's
  fault-free run (without a fault the two are the same run);
* **TorchFT** with its own random numbers (:mod:`bench.torchft_baseline`, ``rng="torch"``: each
  replica group seeds torch once and runs the layers unkeyed); groups 1 and 2 die at steps 200
  and 500 and are not replaced (TorchFT's default), so its batch drops to 24, then 16; against
  its own fault-free run.

The deviation of a step is ``|loss - fault-free loss| / fault-free loss``; reported over the
steps from the first fault on: mean, max, and the mean of the last 200 steps. ElasWave's
reduction against each is ``1 - ElasWave's / theirs``, beside the paper's "about 78 %". The
runs go one after another (``--repeat`` is the number of rounds of faulted runs; the fault-free
runs come once), and the plot is ``bench/results/convergence.png``.

``CONVERGENCE_STEPS`` (default 1000) shortens every run for a smoke test; the faults move with it
(at 20 % and 50 % of the steps).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    BenchError,
    bench_env,
    console,
    elaswave_launch,
    print_table,
    read_jsonl,
    relative_deviation,
    write_config,
)

DESCRIPTION = (
    "convergence deviation after faults: ElasWave vs rank-keyed RNG, shrinking batch, TorchFT"
)
DEFAULT_REPEAT = 1
CONFIG = REPO_ROOT / "bench" / "gpt-text.yaml"
PAPER_REDUCTION = 0.78  # the ElasWave paper's "about 78 %" lower convergence deviation
LAST = 200  # the tail the "late" deviation is averaged over
SYSTEMS = {
    "elaswave": "ElasWave (sample-keyed RNG, fixed batch)",
    "elaswave_f64": "ElasWave, float64 mode",
    "rank_rng": "ElasWave, rank-keyed RNG",
    "shrink": "ElasWave, shrinking batch",
    "torchft": "TorchFT, its own RNG",
}
SETTINGS = {  # ELASWAVE_* overrides of each ElasWave variant
    "elaswave": {},
    "elaswave_f64": {"ELASWAVE_TRAIN__REDUCE_DTYPE": "float64"},
    "rank_rng": {"ELASWAVE_TRAIN__RNG": "rank"},
    "shrink": {"ELASWAVE_TRAIN__BATCH": "shrink", "ELASWAVE_TRAIN__PARTIAL_REDO": "false"},
}
REFERENCE = {
    "elaswave": "elaswave",
    "elaswave_f64": "elaswave_f64",
    "rank_rng": "rank_rng",
    "shrink": "elaswave",
}


def fault_steps(steps: int) -> tuple[int, int]:
    """The two kills: at 20 % and 50 % of the run (200 and 500 of 1,000 steps)."""
    return max(2, steps // 5), max(3, steps // 2)


def deviation(loss: list[float], ref: list[float], *, since: int) -> dict[str, float]:
    """Relative per-step deviation from ``ref`` over the steps from ``since`` (1-based) on:
    mean, max, and the mean of the last :data:`LAST` steps."""
    rel = relative_deviation(loss[since - 1 :], ref[since - 1 :])
    return {
        "mean": statistics.fmean(rel),
        "max": max(rel),
        "late_mean": statistics.fmean(rel[-LAST:]),
    }


def run(repeat: int, config: Path) -> dict[str, Any]:
    del config  # this scenario's job is its own (bench/gpt-text.yaml)
    steps = int(os.environ.get("CONVERGENCE_STEPS", "1000"))
    first, second = fault_steps(steps)
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-convergence-"))
    corpus = tmp / "corpus"  # the docs as they are now: a later edit changes no run of this one
    corpus.mkdir()
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        shutil.copy(path, corpus / path.name)
    job = write_config(tmp / "gpt-text.yaml", CONFIG, {
        "data": {"files": [str(corpus / "*.md")]}, "train": {"steps": steps},
    })  # fmt: skip
    env = bench_env(tmp / "state")
    free = {
        "elaswave": _elaswave(job, tmp / "free-elaswave", env, "elaswave", faults=()),
        "elaswave_f64": _elaswave(job, tmp / "free-f64", env, "elaswave_f64", faults=()),
        "rank_rng": _elaswave(job, tmp / "free-rank_rng", env, "rank_rng", faults=()),
        "torchft": _torchft(job, tmp / "free-torchft", kills=()),
    }
    for name, res in free.items():
        console.print(f"fault-free {name:>8}: final loss {res['loss'][-1]:.4f}, {res['wall_s']} s")
    faults = (f"kill,rank=1,at_step={first}", f"kill,rank=2,at_step={second}")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    for r in range(1, repeat + 1):
        for name in SYSTEMS:
            out = tmp / f"r{r}-{name}"
            if name == "torchft":
                res = _torchft(job, out, kills=((first, 1), (second, 2)))
                ref = free["torchft"]
            else:
                res = _elaswave(job, out, env, name, faults=faults)
                ref = free[REFERENCE[name]]
            res["deviation"] = deviation(res["loss"], ref["loss"], since=first)
            rounds[name].append(res)
            d = res["deviation"]
            console.print(f"round {r}/{repeat} {name:>8}: deviation mean {d['mean']:.2e}, "
                          f"max {d['max']:.2e}, last {LAST} steps {d['late_mean']:.2e}; "
                          f"{res['wall_s']} s")  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    summary = {
        name: {k: statistics.median(r["deviation"][k] for r in runs) for k in
               ("mean", "max", "late_mean")}
        for name, runs in rounds.items()
    }  # fmt: skip
    ours = summary["elaswave"]
    reduction = {
        name: {k: 1 - ours[k] / summary[name][k] if summary[name][k] else None for k in ours}
        for name in SYSTEMS
        if not name.startswith("elaswave")
    }
    result: dict[str, Any] = {
        "scenario": "convergence",
        "repeat": repeat,
        "steps": steps,
        "faults": {
            "elaswave": list(faults),
            "torchft": [f"group 1 at {first}", f"group 2 at {second}"],
        },
        "systems": SYSTEMS,
        "fault_free": {name: res["loss"] for name, res in free.items()},
        "runs": {name: [r["loss"] for r in runs] for name, runs in rounds.items()},
        "summary": summary,
        "reduction": reduction,
        "paper_reduction": PAPER_REDUCTION,
    }
    result["plot"] = str(plot(result, RESULTS_DIR / "convergence.png"))
    return result


def _elaswave(
    config: Path, out: Path, env: dict[str, str], name: str, *, faults: tuple[str, ...]
) -> dict[str, Any]:
    args = [a for f in faults for a in ("--fault", f)]
    start, end = elaswave_launch(config, out, f"conv-{out.name}", env={**env, **SETTINGS[name]},
                                 extra_args=args, timeout=3600)  # fmt: skip
    losses: dict[int, float] = {}
    for m in read_jsonl(out / "metrics.jsonl"):
        if "kind" not in m:
            losses[m["step"]] = m["loss"]
    if sorted(losses) != list(range(1, len(losses) + 1)):
        raise BenchError(f"{out}: steps missing from metrics.jsonl")
    return {"loss": [losses[s] for s in sorted(losses)], "wall_s": round(end - start, 1)}


def _torchft(config: Path, out: Path, *, kills: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    from bench.torchft_baseline import run_torchft

    res = run_torchft(config, out, kill=False, kills=kills, rng="torch", timeout=3600)
    return {"loss": res["loss"], "wall_s": res["wall_s"], "global_batch": res["global_batch"]}


def plot(result: dict[str, Any], out: Path) -> Path:
    """Top: each faulted run's loss (first round), a 20-step running mean. Bottom: its relative
    deviation from its fault-free run per step (log)."""
    from bench.crash_plots import pyplot, save_figure

    plt = pyplot()
    steps = result["steps"]
    xs = list(range(1, steps + 1))
    first, second = fault_steps(steps)
    colors = {"elaswave": "tab:blue", "elaswave_f64": "tab:cyan", "rank_rng": "tab:orange",
              "shrink": "tab:purple", "torchft": "tab:green"}  # fmt: skip
    refs = {**REFERENCE, "torchft": "torchft"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
    floor = 1e-9
    for name, label in result["systems"].items():
        loss, ref = result["runs"][name][0], result["fault_free"][refs[name]]
        top.plot(xs, _running_mean(loss, 20), color=colors[name], lw=1, label=label)
        rel = [max(d, floor) for d in relative_deviation(loss, ref)]
        bottom.plot(xs, rel, color=colors[name], lw=0.6, alpha=0.8)
    for ax in (top, bottom):
        for s in (first, second):
            ax.axvline(s, color="grey", ls="--", lw=1)
        ax.grid(alpha=0.3)
    top.set_ylabel("training loss\n(20-step running mean)")
    top.set_title(f"Faulted runs: rank 1 killed at {first} (rejoins), rank 2 at {second}")
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylim(floor / 2, 1)
    bottom.set_ylabel(f"|Δloss| / loss vs its\nfault-free run (≤{floor:g} at {floor:g})")
    bottom.set_xlabel("step")
    return save_figure(fig, plt, out)


def _running_mean(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def show(result: dict[str, Any]) -> None:
    red = result["reduction"]
    rows = []
    for name, label in result["systems"].items():
        s = result["summary"][name]
        cut = red.get(name)
        rows.append([
            label, f"{s['mean']:.2e}", f"{s['max']:.2e}", f"{s['late_mean']:.2e}",
            "—" if cut is None else f"{cut['mean']:.1%} / {cut['max']:.1%}",
        ])  # fmt: skip
    print_table(
        f"Loss deviation from the fault-free run, steps {fault_steps(result['steps'])[0]}"
        f"–{result['steps']} (median of {result['repeat']} round(s)); the paper: "
        f"≈{result['paper_reduction']:.0%} lower",
        ["system", "mean", "max", f"mean, last {LAST}", "ElasWave's reduction (mean / max)"],
        rows,
    )
