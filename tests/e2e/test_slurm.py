"""docs/deploy.md's Slurm recipe, submitted with ``sbatch`` as it is written there, to a real
Slurm (Debian's slurmctld, slurmd and munge) on one machine (:mod:`elaswave.testing.slurmbed`: a
controller and five nodes, each a network namespace with its own hostname and ``/tmp``, the
test's directory their shared filesystem). The job is the test model (gpt-test.yaml) with one CPU
worker per node.

Through Slurm, not beside it: a node powered off mid-run and a replacement node joining, one
launch SIGKILLed on a healthy node, ``scancel``, ``scontrol requeue``. Each test checks what the
docs promise: the job's final state, every launch's exit code, host ids that are the node names,
a run directory per node, every step recorded once across them, the fault-free losses.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import CONFIG, Run, assert_clean_run, wait_for

from elaswave.events import read_jsonl
from elaswave.report import build_report
from elaswave.testing.slurmbed import SlurmBed, skip_reason

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.timeout(420),  # the requeue's (about 90 s on a loaded 2-core machine), and more
]

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
NO_GPUS = "--gpus-per-node=0"  # the docs' way to submit on nodes without GPUs
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def recipe(name: str) -> str:
    """The script of docs/deploy.md whose ``--job-name`` is ``name``, as it is written there."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    (script,) = [b for b in blocks if f"#SBATCH --job-name={name}\n" in b]
    return script


CHECKPOINT_EVERY = int(re.findall(r"--durable-every (\d+)", recipe("elaswave"))[0])


@pytest.fixture
def slurm(tmp_path: Path) -> Any:
    """``make(steps, nodes=5, device_time=0)`` → a started :class:`SlurmBed` whose shared
    directory holds ``job.yaml`` (the test model, one CPU worker per node, ``steps`` steps,
    ``train.device_time`` seconds of emulated device time per micro-batch: a test that acts on
    the job while it runs paces its steps so that no CPU ends it first) and the docs' scripts;
    always torn down, and checked to leave nothing behind."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"Slurm test bed unavailable: {reason}")
    beds: list[SlurmBed] = []

    def make(steps: int, nodes: int = 5, device_time: float = 0.0) -> SlurmBed:
        bed = SlurmBed(tmp_path, nodes=nodes)
        beds.append(bed)
        bed.env["ELASWAVE_STATE_DIR"] = str(tmp_path / "state")
        job = yaml.safe_load(CONFIG.read_text())
        job["train"].update(steps=steps, device="cpu", device_time=device_time)
        job["elastic"]["nproc_per_node"] = 1
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        for name in ("elaswave", "elaswave-join"):
            (tmp_path / f"{name}.sbatch").write_text(recipe(name))
        return bed.start()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()
            assert_torn_down(bed)


def assert_torn_down(bed: SlurmBed) -> None:
    """Nothing of the bed is left: no namespace of its own, no process in one (its nodes' mounts
    lived in their namespaces), no daemon."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in names.splitlines() if line.startswith(bed.net.tag)]
    assert not left, f"namespaces left: {left}"
    alive = [n for n, proc in bed.daemons.items() if proc.poll() is None]
    assert not alive, f"daemons left: {alive}"


def submit(bed: SlurmBed, script: str = "elaswave", *args: str, options: tuple = ()) -> int:
    return bed.sbatch(bed.workdir / f"{script}.sbatch", NO_GPUS, *options, args=args)


def run_dir(bed: SlurmBed, job_id: int) -> Path:
    return bed.workdir / "runs" / f"slurm-{job_id}"


def host_dirs(bed: SlurmBed, job_id: int) -> dict[str, Path]:
    """The per-node run directories of a job (those a launch wrote its config into)."""
    return {
        p.name: p for p in sorted(run_dir(bed, job_id).iterdir()) if (p / "config.json").exists()
    }


def exit_codes(bed: SlurmBed, job_id: int) -> dict[str, int]:
    return {
        node: int((d / "exit-code").read_text())
        for node, d in host_dirs(bed, job_id).items()
        if (d / "exit-code").exists()
    }


def committed(bed: SlurmBed, job_id: int) -> int:
    root = run_dir(bed, job_id)
    steps = [m["step"] for p in root.glob("*/metrics.jsonl") for m in read_jsonl(p)]
    return max(steps, default=0)


def planned(bed: SlurmBed, job_id: int) -> set[str]:
    """Every worker some plan of the job has named so far."""
    if not run_dir(bed, job_id).is_dir():
        return set()
    return {
        w for d in host_dirs(bed, job_id).values() if (d / "events.jsonl").exists()
        for e in read_jsonl(d / "events.jsonl") if e["kind"] == "plan_published"
        for w in e["workers"]
    }  # fmt: skip


def wait_committed(bed: SlurmBed, job_id: int, step: int, timeout: float = 120) -> int:
    def reached() -> int:
        state = bed.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, bed.output(job_id))
        return committed(bed, job_id) >= step

    wait_for(reached, timeout=timeout, interval=0.1)
    return committed(bed, job_id)


def finished(bed: SlurmBed, job_id: int, timeout: float = 180) -> dict[str, str]:
    job = bed.wait_job(job_id, ENDED, timeout)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, bed.output(job_id))
    return job


def nodes_of(job: dict[str, str]) -> list[str]:
    """``n[1-2,4]`` → ``['n1', 'n2', 'n4']`` (the bed's node names)."""
    m = re.fullmatch(r"n(?:\[(.*)\]|(\d+))", job["NodeList"])
    assert m, job["NodeList"]
    if m.group(2):
        return [f"n{m.group(2)}"]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        out += [f"n{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def assert_nothing_left(bed: SlurmBed, timeout: float = 30) -> float:
    """Wait until no node runs anything but its slurmd; how long that took."""
    start = time.monotonic()
    try:
        wait_for(lambda: not any(bed.left_running(n) for n in bed.nodes), timeout=timeout)
    except AssertionError:
        left = {n: bed.left_running(n) for n in bed.nodes}
        raise AssertionError(f"left running: {left}") from None
    return time.monotonic() - start


def assert_hosts_are_nodes(run: Run, dirs: dict[str, Path]) -> None:
    """The docs' promise: every launch is named after its node and writes its own directory."""
    joined = {e["host"] for e in run.of("host_joined")}
    assert joined == set(dirs), (joined, sorted(dirs))
    for node, d in dirs.items():
        assert {
            e["host"] for e in read_jsonl(d / "events.jsonl") if e["kind"] == "host_joined"
        } == {node}
    workers = {e["worker"] for e in run.of("worker_spawned")}
    assert workers == {f"{n}.w0" for n in dirs}, workers


def test_the_bed_tears_down_to_nothing_while_a_job_runs(tmp_path: Path) -> None:
    """What a failed test leaves: a job running on every node when the bed is closed."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"Slurm test bed unavailable: {reason}")
    bed = SlurmBed(tmp_path, nodes=2)
    try:
        bed.start()
        script = tmp_path / "sleep.sbatch"
        task = "touch /tmp/here-$(hostname); echo $(hostname) $(ls /tmp | grep here-); sleep 600"
        script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\nsrun bash -c '{task}'\n")
        job_id = bed.sbatch(script)
        wait_for(lambda: all(bed.find(n, r"sleep 600") for n in bed.nodes), timeout=30)
        seen = sorted((tmp_path / f"slurm-{job_id}.out").read_text().splitlines())
        # each node has its own hostname and a /tmp of its own, none of it the machine's
        assert seen == ["n1 here-n1", "n2 here-n2"]
        assert not list(Path("/tmp").glob("here-n*"))
        pids = [p.pid for n in bed.nodes for p in bed.find(n, r"sleep 600")]
    finally:
        bed.close()
    assert_torn_down(bed)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_the_recipe_as_written_completes_through_a_launch_killed_on_a_healthy_node(
    slurm: Any, reference: Run
) -> None:
    """The docs' script as written, on four nodes: etcd on the first three (its data in the run
    directory), one launch per node named after it with a run directory each. One launch is
    SIGKILLed on a healthy node mid-run: the others train to the end and the job is COMPLETED,
    every step once, on the fault-free curve."""
    # The job starts once three of the four nodes are ready (--nnodes 3:4), so n2's worker may
    # join later (its template imports the checkpoint module first): it is killed once it
    # trains, and the job is paced (at least 0.12 s a step) so that it is still running then.
    bed = slurm(steps=60, device_time=0.03)
    job_id = submit(bed)
    wait_for(lambda: "n2.w0" in planned(bed, job_id), timeout=120, interval=0.1)
    wait_committed(bed, job_id, 8)
    (launch,) = bed.find("n2", r"bin/elaswave launch ")
    launch.send_signal(signal.SIGKILL)
    job = finished(bed, job_id)
    nodes = nodes_of(job)
    assert nodes == ["n1", "n2", "n3", "n4"]
    dirs = host_dirs(bed, job_id)
    assert sorted(dirs) == nodes
    codes = exit_codes(bed, job_id)
    assert codes == {"n1": 0, "n2": 128 + signal.SIGKILL, "n3": 0, "n4": 0}, codes
    run = Run(*dirs.values())
    assert_clean_run(run, 60, reference)
    assert_hosts_are_nodes(run, dirs)
    members = sorted(p.name for p in (run_dir(bed, job_id) / "etcd").iterdir())
    assert members == nodes[:3]  # etcd on the first three nodes, its data in the run directory
    assert_nothing_left(bed)


def test_a_node_lost_mid_run_and_a_replacement_joining(slurm: Any, reference: Run) -> None:
    """n3 (an etcd member's node) loses power: Slurm marks it DOWN, the job goes on without it
    and completes; a replacement submitted with the docs' join script on the spare node n5
    joins the running job at a step boundary and trains to the end."""
    # The job still runs when Slurm has marked n3 down (about 14 s after the power-off, here)
    # and n5 has joined: 0.12 s a step on four nodes, 0.16 s on three, so at least 22 s of
    # training are left after the loss at step 10 however fast the CPU.
    steps = 150
    bed = slurm(steps=steps, device_time=0.03)
    job_id = submit(bed)
    wait_committed(bed, job_id, 10)
    bed.power_off("n3")
    lost_at = time.time()
    join_id = submit(bed, "elaswave-join", str(job_id), options=("--nodelist=n5",))
    bed.wait_nodes(["n3"], "down", timeout=60)
    assert bed.job(job_id)["JobState"] == "RUNNING"
    finished(bed, job_id)
    finished(bed, join_id, timeout=60)

    dirs = host_dirs(bed, job_id)
    assert sorted(dirs) == ["n1", "n2", "n3", "n4", "n5"]
    # the survivors' launches exited 0 (n3's never wrote one; n5's is its own job's state)
    assert exit_codes(bed, job_id) == {"n1": 0, "n2": 0, "n4": 0}
    run = Run(*dirs.values())
    assert_clean_run(run, steps, reference)
    assert_hosts_are_nodes(run, dirs)
    lost = [e for e in run.of("host_lost") if e.get("host") == "n3"]
    assert lost, "the leader recorded n3's loss"
    joined = next(e for e in run.of("host_joined") if e["host"] == "n5")
    assert joined["t"] > lost_at
    after = [p for p in run.of("plan_published") if p["t"] > joined["t"]]
    assert any("n5.w0" in p["workers"] for p in after), "n5's worker is in a later plan"
    mine = [
        m["step"] for m in read_jsonl(dirs["n5"] / "events.jsonl") if m["kind"] == "final_state"
    ]
    assert mine == [steps], "n5 trained to the end"
    assert_nothing_left(bed)


def test_the_first_node_lost_mid_run(slurm: Any, reference: Run) -> None:
    """n1 runs the batch script, every srun and an etcd member: powered off, the other nodes'
    launches train to the end (etcd keeps its quorum: its log does not go through the lost srun,
    and the node dies at once: its srun cannot end the etcd step on the others)
    and exit 0. Slurm keeps such a job RUNNING (the docs say so); scancel ends it."""
    bed = slurm(steps=40)
    job_id = submit(bed)
    wait_committed(bed, job_id, 8)
    bed.power_off("n1")
    survivors = ["n2", "n3", "n4"]
    wait_for(lambda: sorted(exit_codes(bed, job_id)) == survivors, timeout=180)
    assert exit_codes(bed, job_id) == dict.fromkeys(survivors, 0)
    dirs = host_dirs(bed, job_id)
    run = Run(*dirs.values())
    assert_clean_run(run, 40, reference)
    assert_hosts_are_nodes(run, dirs)
    assert bed.job(job_id)["JobState"] == "RUNNING"
    assert all(bed.find(n, r"etcd --name") for n in ("n2", "n3")), "etcd kept its quorum"
    bed.scancel(job_id)
    assert bed.wait_job(job_id, ENDED, timeout=30)["JobState"] == "CANCELLED"
    assert_nothing_left(bed)


def test_scancel_leaves_nothing_running(slurm: Any) -> None:
    bed = slurm(steps=400, device_time=0.03)  # ≥ 48 s: running when scancel comes
    job_id = submit(bed)
    wait_committed(bed, job_id, 5)
    for node in ("n1", "n2", "n3", "n4"):  # what must stop: launches, workers, etcd
        assert bed.find(node, r"bin/elaswave launch "), node
        assert bed.find(node, r"elaswave\.runtime"), node
    assert all(bed.find(node, r"etcd --name") for node in ("n1", "n2", "n3"))
    cancelled = time.monotonic()
    bed.scancel(job_id)
    assert bed.wait_job(job_id, ENDED, timeout=30)["JobState"] == "CANCELLED"
    assert_nothing_left(bed, timeout=30)
    took = time.monotonic() - cancelled
    print(f"scancel: nothing left running after {took:.1f} s")
    assert took < 20, took  # SIGTERM, the launches' shutdown, KillWait (5 s here), SIGKILL
    assert committed(bed, job_id) < 400


def test_a_requeue_resumes_from_the_checkpoint(slurm: Any, reference: Run) -> None:
    """``scontrol requeue`` signals the running job (SIGTERM to every process of it, SIGKILL
    after KillWait) and runs the script again under its job id (on the same four nodes: the bed
    has four): the launches take the SIGTERM as a preemption, checkpoint the newest committed
    step and exit 75 (the periodic checkpoint is further back); etcd comes back with the job's
    records from its data directory, the launches resume from that step, none is trained again
    and none is recorded twice."""
    # Long enough that the job still trains when the requeue's signal reaches it (Slurm takes
    # a second or more), and before the recipe's periodic checkpoint: 40 steps of at least
    # 0.12 s, signalled three steps after the last node's worker joined.
    steps = 40
    assert CHECKPOINT_EVERY > steps
    bed = slurm(steps=steps, nodes=4, device_time=0.03)
    job_id = submit(bed)
    # Signalled once every node's worker trains, so that every node's launch checkpoints (a
    # worker still joining would leave at once, holding nothing: test_relaunch's standby host).
    wait_for(lambda: len(planned(bed, job_id)) == 4, timeout=120, interval=0.1)
    done_before = wait_committed(bed, job_id, committed(bed, job_id) + 3, timeout=180)
    bed.requeue(job_id)
    wait_for(lambda: bed.job(job_id).get("Restarts") == "1", timeout=30)
    finished(bed, job_id, timeout=240)

    dirs = host_dirs(bed, job_id)
    run = Run(*dirs.values())
    steps_recorded = [m["step"] for m in run.metrics]
    assert steps_recorded == list(range(1, steps + 1)), f"a step lost or twice: {steps_recorded}"
    ref = reference.losses
    for step, loss in run.losses.items():
        if step in ref:
            assert abs(loss - ref[step]) <= 1e-6 * abs(ref[step]), (step, loss, ref[step])
    (again,) = run.of("relaunched")  # one host decided, the others joined it
    preempted = {e["step"] for e in run.of("preempted") if e["t"] < again["t"]}
    assert preempted == {again["resume_step"]} == {again["committed"]}, (preempted, again)
    assert again["committed"] >= done_before and again["lost_steps"] == 0
    assert {e["step"] for e in run.of("durable_restored")} == preempted
    assert exit_codes(bed, job_id) == dict.fromkeys(dirs, 0)
    report = build_report(*dirs.values())
    assert [i["kind"] for i in report["incidents"]].count("relaunch") == 1
    assert report["totals"]["duplicate_steps"] == [] and report["totals"]["missing_steps"] == []
    assert_nothing_left(bed)
