"""PNG plots for the ``crash`` scenario: loss per step, and samples/s per step around the fault.

Each system is drawn from its crash run with the median MTTR. matplotlib is part of the
``bench`` extra (``pip install -c constraints-cpu.txt -e '.[bench]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import relative_deviation

STYLE = {
    "elaswave": {"color": "tab:blue", "marker": "o"},
    "elaswave_script": {"color": "tab:purple", "marker": "D"},
    "torchrun": {"color": "tab:red", "marker": "s"},
    "torchft": {"color": "tab:green", "marker": "^"},
    "torchft_tight": {"color": "tab:olive", "marker": "v"},
}


def _systems(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, label) in the scenario's order (a JSON round trip sorts the keys)."""
    return [(n, result["systems"][n]) for n in STYLE if n in result["systems"]]


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(runs, key=lambda r: r["mttr_s"])
    return ranked[(len(ranked) - 1) // 2]


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(result: dict[str, Any], out: Path) -> Path:
    """Top: loss vs step. Bottom: relative difference to ElasWave's fault-free run (log)."""
    plt = pyplot()
    ref = result["fault_free"]["elaswave"]["loss"]
    steps = list(range(1, len(ref) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
    top.plot(steps, ref, color="black", lw=3, alpha=0.25, label="ElasWave, fault-free")
    floor = 1e-9  # identical losses would be log(0); drawn at the floor instead
    for name, label in _systems(result):
        run = _median_run(result["runs"][name])
        kw = {**STYLE[name], "ms": 3, "lw": 1}
        top.plot(steps, run["loss"], label=f"{label}, crash", **kw)
        rel = [max(d, floor) for d in relative_deviation(run["loss"], ref)]
        bottom.plot(steps, rel, **kw)
    for ax in (top, bottom):
        ax.axvline(15, color="grey", ls="--", lw=1)
        ax.grid(alpha=0.3)
    top.text(15.3, max(ref) * 0.98, "SIGKILL rank 1\n(step 15)", va="top", fontsize=8)
    top.set_ylabel("training loss")
    top.legend(fontsize=8)
    top.set_title("Loss per step, crash runs vs ElasWave fault-free (gpt-tiny, 4 workers)")
    bottom.set_yscale("log")
    bottom.set_ylim(floor / 2, 1)
    bottom.set_ylabel(f"|Δloss| / loss vs\nElasWave fault-free\n(≤{floor:g} drawn at {floor:g})")
    bottom.set_xlabel("step")
    return save_figure(fig, plt, out)


def plot_throughput(result: dict[str, Any], out: Path) -> Path:
    """Top: samples/s of each committed step (redone ones included). Bottom: training progress.

    Both against time since the fault. Progress is the number of samples the model state has
    trained on after each commit, so a restart from a checkpoint shows as a drop.
    """
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, label in _systems(result):
        run = _median_run(result["runs"][name])
        hist = sorted(run["history"])
        kw = {**STYLE[name], "ms": 3, "lw": 1}
        pairs = list(zip(hist, hist[1:], strict=False))
        xs = [t1 - run["kill_t"] for (t0, _, _), (t1, _, _) in pairs]
        top.plot(xs, [n / (t1 - t0) for (t0, _, _), (t1, _, n) in pairs], **kw)
        batch = run["global_batch"]
        progress = [sum(batch[:step]) for _, step, _ in hist]
        bottom.plot([t - run["kill_t"] for t, _, _ in hist], progress, **kw,
                    label=f"{label} (MTTR {run['mttr_s']:.2f} s)")  # fmt: skip
    for ax in (top, bottom):
        ax.axvline(0, color="grey", ls="--", lw=1)
        ax.grid(alpha=0.3)
    top.text(0.1, top.get_ylim()[1] * 0.97, "SIGKILL rank 1 (step 15)", va="top", fontsize=8)
    top.set_ylabel("samples / s\n(step samples / step interval)")
    top.set_title("Throughput around the crash (median-MTTR run of each system)")
    bottom.set_ylabel("samples trained into the\nmodel state (after each commit)")
    bottom.set_xlabel("seconds since the fault (each point: one committed step, at its end)")
    bottom.legend(fontsize=8, loc="upper left")
    return save_figure(fig, plt, out)


def save_figure(fig: Any, plt: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
