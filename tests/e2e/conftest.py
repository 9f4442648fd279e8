"""Helpers for end-to-end tests: real `elaswave launch` processes, a real etcd, real signals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elaswave.events import distinct_records, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("gpt-test.yaml")  # a narrow, short gpt-tiny
REL_TOL = 1e-6


def elaswave_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elaswave", *args]


@pytest.fixture
def state_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["ELASWAVE_STATE_DIR"] = str(tmp_path / "state")
    env.pop("ELASWAVE_FAULTS", None)
    return env


def launch_cmd(run_dir: Path, *args: str, quiet: bool = True) -> list[str]:
    """``elaswave launch`` of the test config into ``run_dir`` (quiet: no progress, no
    summary), with ``args``."""
    return elaswave_cmd(
        "launch", str(CONFIG), "--run-dir", str(run_dir), *(["--quiet"] if quiet else []), *args
    )


def launch(
    run_dir: Path, *args: str, env: dict[str, str], timeout: float = 180, quiet: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a job to completion."""
    return subprocess.run(
        launch_cmd(run_dir, *args, quiet=quiet),
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def run_config(
    config: Path, run_dir: Path, env: dict[str, str], *args: str, timeout: float = 200
) -> Run:
    """Run the job of ``config`` to completion from the repository root (where a config's
    ``examples.*`` factories import from); it must succeed."""
    cmd = elaswave_cmd("launch", str(config), "--run-dir", str(run_dir), "--quiet", *args)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(run_dir)


def start(run_dir: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """Start a job in the background (for tests that talk to it while it runs)."""
    return subprocess.Popen(
        launch_cmd(run_dir, *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


class Run:
    """A finished run directory, parsed; several (one per host) are merged in time order."""

    def __init__(self, run_dir: Path, *more: Path) -> None:
        self.dir = run_dir
        dirs = (run_dir, *more)  # a record written twice (same writer token) counts once
        lines = distinct_records(m for d in dirs for m in read_jsonl(d / "metrics.jsonl"))
        self.metrics = [m for m in lines if "kind" not in m]  # committed steps
        self.evals = [m for m in lines if m.get("kind") == "eval"]  # held-out losses
        self.events = [e for d in dirs for e in read_jsonl(d / "events.jsonl")]
        if more:
            self.metrics.sort(key=lambda m: m["time"])
            self.events.sort(key=lambda e: e["t"])

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    @property
    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics}

    def spawned_pids(self) -> dict[str, int]:
        return {e["worker"]: e["pid"] for e in self.of("worker_spawned")}


def assert_clean_run(run: Run, steps: int, reference: Run) -> None:
    """The properties every run with faults must keep."""
    committed = [m["step"] for m in run.metrics]
    assert committed == list(range(1, steps + 1)), f"steps lost or duplicated: {committed}"
    ref = reference.losses
    for step, loss in run.losses.items():
        if step not in ref:
            continue  # past the reference run; the replicas' agreement below still holds
        assert abs(loss - ref[step]) <= REL_TOL * abs(ref[step]), (
            f"step {step}: loss {loss!r} deviates from fault-free {ref[step]!r}"
        )
    finals = run.of("final_state")
    assert finals, "no worker reported its final state"
    assert len({f["params_sha256"] for f in finals}) == 1, "replicas disagree on parameters"
    assert len({f["state_sha256"] for f in finals}) == 1, "replicas disagree on optimizer state"
    assert all(f["step"] == steps for f in finals)
    spawned = run.spawned_pids()
    for f in finals:  # a survivor is the very process that was spawned for it
        assert spawned[f["worker"]] == f["pid"]
    assert_no_orphans(run)


def assert_redid_only(
    run: Run, epoch: int, lost: set[str], *, may_have_committed: bool = False
) -> dict[str, list[int]]:
    """The step interrupted before ``epoch`` was redone in part: every rank of the plan agrees
    that the survivors kept their micro-batches and computed only those of the ``lost``
    workers' shares under the previous plan (each exactly once). Returns who redid what.

    ``may_have_committed``: a fault at an arbitrary time (a host killed) may land after some
    survivor's reduction completed; that survivor committed the step, the others copy it and
    nothing is redone (the sync's steps show it). Or it lands between two steps (in the checks
    after a commit): no survivor started the next step, and nothing is redone either; or some
    survivors had not started it (still in the checks after the commit before): they keep
    nothing, and their micro-batches are redone with the lost ones'."""
    plans = {p["epoch"]: p for p in run.of("plan_published")}
    before, after = plans[epoch - 1], plans[epoch]
    start, old = 0, {}
    for worker, n in zip(before["workers"], before["microbatches"], strict=True):
        old[worker] = list(range(start, start + n))
        start += n
    synced = [e for e in run.of("state_synced") if e["epoch"] == epoch]
    assert len(synced) == after["world"], "every rank reports its sync"
    if may_have_committed and all("redo_microbatches" not in e for e in synced):
        steps, resume = synced[0]["steps"], synced[0]["resume_step"]
        if min(steps) == max(steps) == resume:  # between two steps
            aborted = [
                e for e in run.of("step_aborted")
                if e["worker"] in after["workers"] and e["step"] == resume + 1
            ]  # fmt: skip
            assert aborted and all(e["during"] != "step" for e in aborted), aborted
        else:
            assert min(steps) < max(steps) == resume, synced[0]
        return {}
    (redo,) = {json.dumps(e["redo_microbatches"], sort_keys=True) for e in synced}
    (kept,) = {json.dumps(e["kept_microbatches"], sort_keys=True) for e in synced}
    redone, kept_by = json.loads(redo), json.loads(kept)
    idle: set[str] = set()  # survivors that had not started the step when the fault hit
    if may_have_committed:  # a fault at an arbitrary time: a survivor still in the checks
        idle = {w for w in after["workers"] if old.get(w) and kept_by.get(w) == 0}
    assert kept_by == {w: 0 if w in idle else len(old.get(w, [])) for w in after["workers"]}, (
        kept_by
    )
    done = sorted(i for ids in redone.values() for i in ids)
    assert done == sorted(i for w in lost | idle for i in old[w]), (redone, lost, idle)
    assert set(redone) <= set(after["workers"]) - lost
    return redone


def assert_no_orphans(run: Run) -> None:
    pids = [e["pid"] for e in run.of("worker_spawned")]
    pids += [e["embedded_etcd_pid"] for e in run.of("host_joined") if e.get("embedded_etcd_pid")]
    pids += [e["pid"] for e in run.of("etcd_restarted")]
    pids += [e["pid"] for e in (*run.of("template_ready"), *run.of("store_started"))]
    alive = [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, f"worker processes left running: {alive}"


def pipeline_groups(plan: dict) -> set[tuple[str, tuple[str, ...]]]:
    """The process groups a pipeline plan needs: the training and migration groups of every
    worker, and one group per set of two or more workers that hold one layer, each as (kind,
    its workers in rank order)."""
    workers = plan["workers"]
    held: dict[int, range] = {}
    for ranks, cut in zip(plan["replicas"], plan["bounds"], strict=True):
        for s, r in enumerate(ranks):
            held[r] = range(cut[s], cut[s + 1])
    layers = plan["bounds"][0][-1]
    holders = {tuple(workers[r] for r in sorted(held) if i in held[r]) for i in range(layers)}
    return {("dp", tuple(workers)), ("mig", tuple(workers))} | {
        ("grad", h) for h in holders if len(h) > 1
    }


def assert_groups_edited(run: Run, before: dict, after: dict) -> None:
    """Every worker of ``after`` kept exactly the groups both plans need, built the new ones and
    dropped the ones it no longer needs (the communicator is edited, not rebuilt)."""
    old, new = pipeline_groups(before), pipeline_groups(after)
    edits = {e["worker"]: e for e in run.of("comm_rebuilt") if e["epoch"] == after["epoch"]}
    assert sorted(edits) == sorted(after["workers"])
    for worker, e in edits.items():
        was = {g for g in old if worker in g[1]}
        now = {g for g in new if worker in g[1]}
        assert len(e["kept"]) == len(was & now), (worker, e, was & now)
        assert len(e["rebuilt"]) == len(now - was), (worker, e, now - was)
        assert len(e["dropped"]) == len(was - now), (worker, e, was - now)


def wait_for(predicate: Any, timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def cli(*args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run one ``elaswave`` command to completion."""
    return subprocess.run(
        elaswave_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout
    )


def status_json(job_id: str, env: dict[str, str], *extra: str) -> dict[str, Any] | None:
    r = cli("status", "--job-id", job_id, "--json", *extra, env=env)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)


F64 = {"ELASWAVE_TRAIN__REDUCE_DTYPE": "float64"}  # the deterministic mode


def paced(env: dict[str, str], device_time: float) -> dict[str, str]:
    """``env`` with emulated device time (``train.device_time``: seconds per micro-batch, slept
    beside the real compute): every step takes at least its micro-batches' share, whatever the
    CPU. For tests that act on a job while it runs (a second host joins, a fault lands after
    Slurm marks a node down): without it a faster machine ends the job before they act."""
    return {**env, "ELASWAVE_TRAIN__DEVICE_TIME": str(device_time)}


class Float64Runs:
    """Fault-free data-parallel runs in the deterministic mode (float64 reduction): the runs
    that faults of any kind, under any strategy, must match bit for bit. One run per
    configuration (steps and the settings given) per session, however many tests and files
    compare with it: the job id and the state directory change no bit of a run."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.runs: dict[tuple[int, tuple[tuple[str, str], ...]], Run] = {}

    def __call__(self, steps: int, settings: dict[str, str] | None = None) -> Run:
        """The run of ``steps`` steps with the environment ``settings`` (``ELASWAVE_*``
        overrides; the same config is the same run)."""
        key = (steps, tuple(sorted((settings or {}).items())))
        if key not in self.runs:
            job_id = f"f64-ref-{len(self.runs)}"
            base = self.factory.mktemp(job_id)
            env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}
            env.pop("ELASWAVE_FAULTS", None)
            env.update(settings or {})
            r = launch(base / "run", "--job-id", job_id, "--steps", str(steps), env=env)
            assert r.returncode == 0, r.stderr[-3000:]
            self.runs[key] = Run(base / "run")
        return self.runs[key]


@pytest.fixture(scope="session")
def float64_runs(tmp_path_factory: pytest.TempPathFactory) -> Float64Runs:
    return Float64Runs(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The fault-free run of the test model (40 steps, 4 workers) every fault run is compared
    with."""
    base = tmp_path_factory.mktemp("reference")
    env = dict(os.environ, ELASWAVE_STATE_DIR=str(base / "state"))
    r = launch(base / "run", "--job-id", "reference", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(base / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, 41))
    return run
