"""Crash recovery vs torchrun restart and TorchFT on the same job, same fault.

Every system trains ``configs/gpt-tiny.yaml`` (4 workers, 40 steps, global batch 32) and loses
worker/rank/replica group 1 to a SIGKILL it sends itself just before the gradient reduction of
step 15. Per round, interleaved: ElasWave (``elaswave launch --fault kill,rank=1,at_step=15``),
the same job driven by a user's own loop (``--script bench/crash_script.py``),
torchrun restart from a checkpoint (:mod:`bench.torchrun_baseline`), TorchFT with its default
timeouts and TorchFT with tight ones (:mod:`bench.torchft_baseline`). One fault-free run of each
comes first, as the reference for the loss deviation.

Per crash run:

* MTTR: kill → the first step committed after it. For torchrun that is step 11 (it resumes from
  checkpoint 10); ``step 15 again`` is kill → step 15 committed again, for every system.
* steps lost / redone: completed steps thrown away (torchrun: 11–14) / steps computed again.
* post/pre: median samples/s per step after the fault (intervals ending at the 3rd and later
  commits after it) over before it (steps 6–14). TorchFT's global batch drops to 24.
* loss deviation: max and mean over the 40 steps of ``|loss - reference| / reference``, against
  the same system's fault-free run and against ElasWave's fault-free run.
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
    launch_command,
    ms,
    print_table,
    read_jsonl,
    relative_deviation,
    summarize,
)

DESCRIPTION = "crash recovery vs torchrun restart and TorchFT: MTTR, lost work, throughput, loss"
DEFAULT_REPEAT = 3
FAULT = "kill,rank=1,at_step=15"
FAULT_STEP = 15
WARMUP = 5
SYSTEMS = {
    "elaswave": "ElasWave (in place)",
    "elaswave_script": "ElasWave, own loop (--script)",
    "torchrun": "torchrun restart, ckpt every 10",
    "torchft": "TorchFT, default timeouts",
    "torchft_tight": "TorchFT, heartbeat 0.5 s, gloo 1 s",
}
TIGHT = {"heartbeat_timeout_ms": 500, "pg_timeout_s": 1.0}
GOALS = {"vs_torchrun_max": 1 / 20, "vs_torchft_max": 1 / 2, "elaswave_loss_dev_max": 1e-6}


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.config import load_config

    cfg = load_config(config, env={})
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-crash-"))
    env = bench_env(tmp / "state")
    free = {}
    for name in SYSTEMS:
        free[name] = _run_system(name, config, tmp / f"free-{name}", env, kill=False)
        free[name].update(_throughput_control(free[name]))
        console.print(f"fault-free {name:>13}: final loss {free[name]['loss'][-1]:.6f}, "
                      f"run {free[name]['wall_s']:.1f} s")  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    for r in range(1, repeat + 1):
        for name in SYSTEMS:
            res = _run_system(name, config, tmp / f"r{r}-{name}", env, kill=True)
            res.update(_throughput(res))
            res.update(_deviation(res["loss"], free[name]["loss"], "own"))
            res.update(_deviation(res["loss"], free["elaswave"]["loss"], "elaswave"))
            runs[name].append(res)
            console.print(
                f"round {r}/{repeat} {name:>13}: MTTR {ms(res['mttr_s'])} ms, step 15 again "
                f"{ms(res['refault_step_done_s'])} ms, post/pre {res['post_over_pre']:.2f}, "
                f"batch after {res['global_batch_after']}; run {res['wall_s']:.1f} s"
            )
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    summary = {name: _summary(runs[name]) for name in SYSTEMS}
    mttr = {name: summary[name]["mttr_s"]["median"] for name in SYSTEMS}
    ratios = {f"elaswave/{n}": mttr["elaswave"] / mttr[n] for n in SYSTEMS if n != "elaswave"}
    ratios["elaswave/torchrun_step15_again"] = (
        summary["elaswave"]["refault_step_done_s"]["median"]
        / summary["torchrun"]["refault_step_done_s"]["median"]
    )
    dev = summary["elaswave"]["loss_dev_own_max"]
    result = {
        "scenario": "crash",
        "repeat": repeat,
        "fault": FAULT,
        "systems": SYSTEMS,
        "commands": _commands(config),
        "job": {
            "steps": cfg.train.steps,
            "global_batch": cfg.train.global_batch,
            "micro_batch_size": cfg.train.micro_batch_size,
            "workers": 4,
        },  # fmt: skip
        "fault_free": free,
        "runs": runs,
        "summary": summary,
        "mttr_ratios": ratios,
        "goal": {
            **GOALS,
            "met_vs_torchrun": ratios["elaswave/torchrun"] <= GOALS["vs_torchrun_max"],
            "met_vs_torchft": ratios["elaswave/torchft"] <= GOALS["vs_torchft_max"],
            "met_vs_torchft_tight": ratios["elaswave/torchft_tight"] <= GOALS["vs_torchft_max"],
            "met_loss_dev": dev <= GOALS["elaswave_loss_dev_max"],
        },
    }
    from bench.crash_plots import plot_losses, plot_throughput

    result["plots"] = [
        str(plot_losses(result, RESULTS_DIR / "crash_losses.png")),
        str(plot_throughput(result, RESULTS_DIR / "crash_throughput.png")),
    ]
    return result


def _run_system(name: str, config: Path, out: Path, env: dict[str, str], *, kill: bool) -> dict:
    if name in ("elaswave", "elaswave_script"):
        return _run_elaswave(config, out, env, kill=kill, script=name == "elaswave_script")
    if name == "torchrun":
        from bench.torchrun_baseline import run_torchrun

        return run_torchrun(config, out, kill=kill)
    from bench.torchft_baseline import run_torchft

    return run_torchft(config, out, kill=kill, **(TIGHT if name == "torchft_tight" else {}))


def _run_elaswave(
    config: Path, out: Path, env: dict[str, str], *, kill: bool, script: bool = False
) -> dict[str, Any]:
    """The engine's run of ``config``; ``script``: the same job driven by a user's own loop
    (``bench/crash_script.py``)."""
    from elaswave.report import PHASES, build_report

    job_id = f"bench-crash-{os.getpid()}-{out.name.replace('_', '-')}"
    extra = ["--fault", FAULT] if kill else []
    if script:
        extra += ["--script", str(REPO_ROOT / "bench" / "crash_script.py")]
    began, ended = elaswave_launch(config, out, job_id, env=env, extra_args=extra)
    metrics = sorted(read_jsonl(out / "metrics.jsonl"), key=lambda m: m["time"])
    first: dict[int, dict[str, Any]] = {}
    for m in metrics:
        first.setdefault(m["step"], m)
    steps = sorted(first)
    if steps != list(range(1, len(steps) + 1)):
        raise BenchError(f"{out}: committed steps {steps}")
    batch = [first[s]["samples"] - (first[s - 1]["samples"] if s > 1 else 0) for s in steps]
    step_end = [first[s]["time"] for s in steps]
    res: dict[str, Any] = {
        "loss": [first[s]["loss"] for s in steps],
        "step_end": step_end,
        "history": [(first[s]["time"], s, batch[s - 1]) for s in steps],
        "global_batch": batch,
        "wall_s": round(ended - began, 3),
        "launch_to_first_commit_s": round(step_end[0] - began, 3),
    }
    if kill:
        report = build_report(out)
        if len(report["incidents"]) != 1 or report["incidents"][0]["mttr_s"] is None:
            raise BenchError(f"{out}: expected one recovered incident: {report['incidents']}")
        inc = report["incidents"][0]
        res.update(
            kill_t=inc["fault_t"],
            fault_step=inc["fault_step"],
            mttr_s=inc["mttr_s"],
            first_step_after_fault=inc["first_commit_step"],
            refault_step_done_s=step_end[FAULT_STEP - 1] - inc["fault_t"],
            steps_lost=0,
            steps_redone=1,  # the in-flight step, recomputed by the survivors
            phases={p: inc[p] for p in PHASES},
            global_batch_after=batch[-1],
            world_after=inc["world_after"],
        )
    return res


def _rates(history: list[Any]) -> list[tuple[float, int, float]]:
    """(end time, step, samples/s) of every commit interval, in wall-clock order."""
    hist = sorted(history)
    pairs = zip(hist, hist[1:], strict=False)
    return [(t1, step, n / (t1 - t0)) for (t0, _, _), (t1, step, n) in pairs]


def _throughput(res: dict[str, Any]) -> dict[str, Any]:
    """Median samples/s per commit interval before the fault (steps 6-14) and after it."""
    rates, kill_t = _rates(res["history"]), res["kill_t"]
    pre = [r for t, step, r in rates if t < kill_t and WARMUP < step < FAULT_STEP]
    post = [r for t, _, r in rates if t > kill_t][2:]  # skip the recovery interval and warm-up
    if not pre or not post:
        raise BenchError(f"too few steps to measure throughput around the fault: {rates}")
    p, q = statistics.median(pre), statistics.median(post)
    return {"pre_samples_per_s": p, "post_samples_per_s": q, "post_over_pre": q / p}


def _throughput_control(res: dict[str, Any]) -> dict[str, Any]:
    """The same ratio in a fault-free run: steps 17-40 over steps 6-14 (drift, load, warm-up)."""
    rates = _rates(res["history"])
    p = statistics.median(r for _, step, r in rates if WARMUP < step < FAULT_STEP)
    q = statistics.median(r for _, step, r in rates if step >= FAULT_STEP + 2)
    return {"pre_samples_per_s": p, "post_samples_per_s": q, "post_over_pre": q / p}


def _deviation(loss: list[float], ref: list[float], tag: str) -> dict[str, float]:
    rel = relative_deviation(loss, ref)
    return {f"loss_dev_{tag}_max": max(rel), f"loss_dev_{tag}_mean": statistics.fmean(rel)}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("mttr_s", "refault_step_done_s", "post_over_pre", "pre_samples_per_s",
            "post_samples_per_s")  # fmt: skip
    out: dict[str, Any] = {k: summarize(r[k] for r in runs) for k in keys}
    for tag in ("own", "elaswave"):
        out[f"loss_dev_{tag}_max"] = max(r[f"loss_dev_{tag}_max"] for r in runs)
        out[f"loss_dev_{tag}_mean"] = statistics.fmean(r[f"loss_dev_{tag}_mean"] for r in runs)
    for k in ("steps_lost", "steps_redone", "global_batch_after", "world_after"):
        out[k] = sorted({r[k] for r in runs})
    if "phases" in runs[0]:
        out["phases"] = {p: summarize(r["phases"][p] for r in runs) for p in runs[0]["phases"]}
    return out


def _commands(config: Path) -> dict[str, str]:
    from bench import torchft_baseline as ft
    from bench import torchrun_baseline as tr

    rel = os.path.relpath(config, REPO_ROOT)
    run = " ".join(tr.torchrun_command(4, 0, "ID")[1:]).replace(":0", ":PORT")
    return {
        "elaswave": launch_command(config, ["--fault", FAULT]),
        "elaswave_script": launch_command(
            config, ["--script", "bench/crash_script.py", "--fault", FAULT]
        ),
        "torchrun": f"python {run} bench/torchrun_baseline.py --config {rel} --out DIR "
        f"--ckpt-every 10 --kill-at {FAULT_STEP}  (env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
        "torchft": " ".join(["torchft_lighthouse", *ft.lighthouse_command(0)[1:]])
        + " (127.0.0.1:0 = a free port); 4 x python bench/torchft_baseline.py --replica G "
        f"--replicas 4 --config {rel} --out DIR --kill-at {FAULT_STEP} (gloo timeout "
        f"{ft.PG_TIMEOUT_S} s, manager timeout {ft.MANAGER_TIMEOUT_S} s)",
        "torchft_tight": f"as torchft with {TIGHT}",
    }


def _range(s: dict[str, Any], fmt: Any = None) -> str:
    fmt = fmt or (lambda v: f"{v:.2f}")
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def _dev(s: dict[str, Any], tag: str) -> str:
    return f"{s[f'loss_dev_{tag}_max']:.1e} / {s[f'loss_dev_{tag}_mean']:.1e}"


def show(result: dict[str, Any]) -> None:
    names = [n for n in SYSTEMS if n in result["systems"]]  # JSON round trips sort the keys
    for name in names:
        console.print(f"[bold]{name}[/bold]: {result['systems'][name]}", highlight=False)
    recovery, after = [], []
    for name in names:
        s = result["summary"][name]
        lost = f"{'/'.join(map(str, s['steps_lost']))} / {'/'.join(map(str, s['steps_redone']))}"
        recovery.append((name, _range(s["mttr_s"]), _range(s["refault_step_done_s"]), lost,
                         "/".join(map(str, s["global_batch_after"]))))  # fmt: skip
        control = result["fault_free"][name]["post_over_pre"]
        after.append((name, _range(s["post_over_pre"]), f"{control:.2f}", _dev(s, "own"),
                      _dev(s, "elaswave")))  # fmt: skip
    title = f"Crash recovery, {result['repeat']} rounds ({result['fault']}), median (min–max)"
    print_table(title, ("system", "MTTR s", "step 15 again s", "lost / redone", "batch after"),
                recovery)  # fmt: skip
    print_table(
        "After the fault: samples/s post/pre, relative |Δloss| max / mean over 40 steps",
        ("system", "post/pre", "fault-free", "vs own fault-free", "vs ElasWave fault-free"),
        after,
    )
    for name in names:
        phases = result["summary"][name].get("phases", {})
        if phases:
            text = ", ".join(f"{p.removesuffix('_s')} {ms(v['median'])}" for p, v in phases.items())
            console.print(f"{name} MTTR phases (median ms): {text}")
    for key, ratio in result["mttr_ratios"].items():
        console.print(f"MTTR ratio {key}: {ratio:.4f} (1/{1 / ratio:.1f})")
    g = result["goal"]

    def verdict(ok: bool) -> str:
        return "[green]met[/green]" if ok else "[red]NOT met[/red]"

    console.print(
        f"goals: ElasWave/torchrun <= 1/20 {verdict(g['met_vs_torchrun'])}; ElasWave/TorchFT <= "
        f"1/2 {verdict(g['met_vs_torchft'])} (tight timeouts: {verdict(g['met_vs_torchft_tight'])}"
        f"); ElasWave loss deviation <= {g['elaswave_loss_dev_max']:g} "
        f"{verdict(g['met_loss_dev'])}"
    )
    for path in result.get("plots", []):
        console.print(f"plot: {os.path.relpath(path, REPO_ROOT)}")
