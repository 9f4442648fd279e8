"""Chaos soak: long jobs take >= 30 random faults each and must still finish exactly.

Three hosts × two workers, every host a network namespace of the multi-host test bed
(elaswave.testing.netbed: real etcd, real daemons, gloo over veths), lease TTL 2 s, hang timeout
3 s,
respawn on (``--max-restarts``), hosts that may leave and come back (``--nnodes 2:3``), straggler
eviction off (a slow rank is re-shared, never evicted) and the restart-loop breaker off.

The schedule is drawn from a seeded generator (:func:`schedule`, printed and stored in the
result) over the variant's kinds, nine at most:

- kill, hang, corrupt, slow, nan, gradsdc: ``inject-fault --rank R`` on the live job (R drawn
  at random; ``nan`` turns that rank's loss and gradient NaN in its next step, which every rank
  skips; ``gradsdc`` is ``--kind corrupt --target grad``: the rank computes its next step's
  gradient with one bit wrong, a replay of every step (``--replay-every 1``) outvotes it and the
  rank is evicted for good, its slot empty until its host is launched again by a later host
  fault or preemption; ZeRO-3 and pipelines, where no rank holds a micro-batch's whole
  gradient, leave it out);
- preempt: SIGTERM to every launch (a scheduler's requeue): the job checkpoints its newest
  step and every launch exits 75; then every host is launched again and resumes from it;
- host: ``inject-fault --kind host`` on a non-leader host, which is then relaunched (a new daemon
  for the same host id) so that capacity comes back;
- partition: ``inject-fault --kind partition`` on a non-leader host, healed once the others
  have planned without it; then its daemon reads that plan, fences its old workers and brings
  new ones, which join by themselves.

A slow worker stays slow, so every ``slow`` is followed by a ``kill`` of that very worker (its
respawn is fast again); that kill counts as a fault of its own. Each fault waits for the previous
one to be answered: the job back at full size (six workers) under a plan newer than the fault,
and a step committed under it (corrupt: repaired, then a commit), plus a few steps of margin.

Variants (``CHAOS_VARIANTS=dp,zero,...``; all by default), one job each (``CHAOS_KEEP=DIR`` keeps
each bed's directory, the run directories of every host, under ``DIR``):

- ``dp``: data parallelism, every kind above; the gradient is reduced by tiers
  (``train.hierarchy: auto``, the default: inside each host, then lanes between them), through
  plans whose hosts hold different numbers of workers (``uneven_plans`` in the result);
- ``hier``: ``dp`` with racks: hosts h0 and h1 in rack A, h2 in rack B, each rack a bridge of
  its own joined by one link (``launch --rack``), so the gradient goes by three levels (hosts,
  lanes inside the racks, slices between them) whenever rack A has two hosts in the plan;
- ``zero``: ZeRO-1 (``--zero 1``), every kind;
- ``zero3``: ZeRO-3 (``--zero 3``: parameters, gradients and moments sharded), all but ``gradsdc``;
- ``pipeline``: dp 3 × pp 2 with ZeRO-1 inside the stages, all but ``gradsdc``;
- ``pipeline-zero3``: dp 3 × pp 2 with ZeRO-3 inside the stages (between steps a rank keeps only
  its parts, parameters with their moments; each step gathers its stage), as ``pipeline``;
- ``leader``: every host and partition fault hits the leader's host, every rank fault a worker
  on it: the leadership moves while the job recovers;
- ``etcd``: three etcd members; besides every kind above, ``etcd`` kills a member (the one every
  daemon talks to first, drawn) and starts it again on its data a few seconds later;
- ``recovery``: faults during recovery: ``recovery`` arms ``kill --phase recovery`` on one rank
  and then kills another, so the first dies as it starts applying the plan that answers the
  second (two faults); plus kill, hang and host.

A fault-free run on the same bed is the reference for the wall clock and the losses. In the
deterministic mode (``CHAOS_REDUCE_DTYPE=float64``, the default) one data-parallel reference
serves every variant: data parallelism, ZeRO and pipelines give the same bits there, so every
loss of every variant must equal the reference's exactly. With float32 reduction each variant
has its own reference (its sums run in its own order) and the goal is 1e-6 per step. The bed
needs root and iproute2; without them the single-host variant runs (one ``elaswave launch`` of
four workers on an embedded etcd, rank faults only) and the result says so in ``variant``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
    bench_env,
    console,
    print_table,
    read_jsonl,
    summarize,
    wait_until,
)
from elaswave.events import distinct_records
from elaswave.testing import netbed

DESCRIPTION = "chaos soak: >= 30 random faults per variant (dp, ZeRO-1, ZeRO-3, pipeline, ...)"
DEFAULT_REPEAT = 1
SEED = 5
FAULTS = 28  # drawn faults; each slow adds its curing kill, each recovery fault is two
STEPS = 1500
HOSTS = 3
NPROC = 2
LOCAL_NPROC = 4  # the single-host variant
LEASE_TTL = 2
HANG_TIMEOUT = 3.0
SLOW_DELAY = 0.3  # s per step: a 2-3× straggler on this model
SLOW_STEPS = 6  # steps a slow worker stays slow before it is killed
VERIFY_EVERY = 5
MARGIN_STEPS = 2  # steps committed at full size before the next fault
RECOVERY_TIMEOUT = 150.0
REL_TOL = 1e-6  # the per-step loss goal of the e2e tests
# float32 (default) or float64 gradient reduction; float64 makes the sum independent of the
# world size, so any loss deviation left is a bug rather than rounding (CHAOS_REDUCE_DTYPE=float64).
REDUCE_DTYPE = os.environ.get("CHAOS_REDUCE_DTYPE", "float64")
RANK_KINDS = ("kill", "hang", "corrupt", "slow", "nan", "gradsdc")
HOST_KINDS = ("host", "partition")
KINDS = (*RANK_KINDS, *HOST_KINDS, "preempt")
# a replay needs a micro-batch's whole gradient on one rank: not under ZeRO-3 or pipelines
SHARDED_KINDS = tuple(k for k in KINDS if k != "gradsdc")
REPLAY = ("--replay-every", "1")  # every step, so that every gradsdc meets a replay
ETCD_RESTART_AFTER = 4.0  # s a killed etcd member stays down
PREEMPT_GRACE = 30.0


@dataclass(frozen=True)
class Variant:
    name: str
    kinds: tuple[str, ...]
    flags: tuple[str, ...] = ()
    etcd_members: int = 1
    at_leader: bool = False  # host faults hit the leader's host, rank faults its workers
    racks: tuple[str, ...] = ()  # each host's rack (``launch --rack``; each rack a bridge)


VARIANTS = {
    v.name: v
    for v in (
        Variant("dp", KINDS, REPLAY),
        Variant("hier", KINDS, REPLAY, racks=("A", "A", "B")),
        Variant("zero", KINDS, ("--zero", "1", *REPLAY)),
        Variant("zero3", SHARDED_KINDS, ("--zero", "3")),
        Variant("pipeline", SHARDED_KINDS, ("--pp", "2", "--zero", "1")),
        Variant("pipeline-zero3", SHARDED_KINDS, ("--pp", "2", "--zero", "3")),
        Variant("leader", KINDS, REPLAY, at_leader=True),
        Variant("etcd", (*KINDS, "etcd"), REPLAY, etcd_members=3),
        Variant("recovery", ("kill", "hang", "host", "recovery")),
    )
}
COLUMNS = ("kind", "injected / recovered", "detection", "MTTR", "to full size")
COLUMNS += ("report detection", "report MTTR")


def schedule(seed: int, n: int, kinds: Sequence[str] = KINDS) -> list[dict[str, Any]]:
    """``n`` faults drawn from ``kinds`` (every kind at least once when ``n`` allows), in order.

    Targets are drawn as numbers and resolved when the fault fires: ``pick`` indexes the ranks
    of the plan then in force (rank faults) or the non-leader hosts (host faults), modulo their
    count. Every ``slow`` is followed by ``{"kind": "kill", "cure": True}``: the slowed worker is
    killed after :data:`SLOW_STEPS` steps so that its respawn is fast again.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    drawn = list(kinds[:n]) + [rng.choice(kinds) for _ in range(n - len(kinds[:n]))]
    rng.shuffle(drawn)
    out: list[dict[str, Any]] = []
    for kind in drawn:
        out.append({"kind": kind, "pick": rng.randrange(1 << 16)})
        if kind == "slow":
            out.append({"kind": "kill", "cure": True})
    return out


def fault_count(plan: Sequence[dict[str, Any]]) -> int:
    """Faults a schedule injects: a ``recovery`` entry is two (the armed one and its trigger)."""
    return sum(2 if f["kind"] == "recovery" else 1 for f in plan)


def describe(fault: dict[str, Any]) -> str:
    if fault.get("cure"):
        return "kill the slow worker"
    return f"{fault['kind']} (pick {fault['pick']})"


# ---- the run -----------------------------------------------------------------------------------
def selected_variants() -> list[Variant]:
    names = [n.strip() for n in os.environ.get("CHAOS_VARIANTS", ",".join(VARIANTS)).split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise BenchError(f"unknown chaos variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    return [VARIANTS[n] for n in names if n]


@contextlib.contextmanager
def _workdir(name: str) -> Iterator[str]:
    """A bed's directory: temporary, or ``$CHAOS_KEEP/name`` kept for inspection (its run
    directories hold every host's events, metrics and logs)."""
    keep = os.environ.get("CHAOS_KEEP")
    if not keep:
        with tempfile.TemporaryDirectory(prefix="elaswave-chaos-") as tmp:
            yield tmp
        return
    path = Path(keep) / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    yield str(path)


def run(repeat: int, config: Path) -> dict[str, Any]:
    reason = netbed.skip_reason()
    variants = selected_variants()
    if reason:
        console.print(f"[yellow]netns bed unavailable ({reason}): single host, rank faults[/]")
        bed_name = f"single host × {LOCAL_NPROC} workers, rank faults only ({reason})"
        hosts, nproc = 1, LOCAL_NPROC
        variants = [
            Variant(v.name, tuple(k for k in v.kinds if k in (*RANK_KINDS, "preempt")), v.flags)
            for v in variants
            if v.name in ("dp", "zero", "zero3", "pipeline", "pipeline-zero3")
        ]  # fmt: skip

        def make_bed(workdir: Path, members: int, racks: tuple[str, ...] = ()) -> Any:
            return _LocalBed(workdir, config)
    else:
        bed_name = f"netns: {HOSTS} hosts × {NPROC} workers"
        hosts, nproc = HOSTS, NPROC

        def make_bed(workdir: Path, members: int, racks: tuple[str, ...] = ()) -> Any:
            return netbed.NetBed(
                workdir, config=config, hosts=HOSTS, etcd_members=members, racks=racks
            )

    rounds = []
    for i in range(repeat):
        refs: dict[tuple[str, ...], dict[str, Any]] = {}
        by_variant = {}
        for v in variants:
            # float64: one data-parallel reference for all (same bits); float32: its own.
            key = () if REDUCE_DTYPE == "float64" else v.flags
            if key not in refs:
                with _workdir(f"ref-{i}") as tmp:
                    refs[key] = _on_bed(make_bed(Path(tmp) / "ref", 1), nproc,
                                        f"chaos-ref-{i}", [], Variant("ref", (), key))  # fmt: skip
            plan = schedule(SEED, FAULTS, v.kinds)
            console.print(
                f"[bold]{v.name}[/bold] schedule (seed {SEED}): "
                + "; ".join(describe(f) for f in plan)
            )
            with _workdir(f"{v.name}-{i}") as tmp:
                soak = _on_bed(make_bed(Path(tmp) / "soak", v.etcd_members, v.racks), nproc,
                               f"chaos-{v.name}-{i}", plan, v)  # fmt: skip
            ref = refs[key]
            skipped = sorted(m["step"] for m in soak["metrics"] if m.get("skipped"))
            if skipped:  # the fault-free run that skips the same steps' samples
                with _workdir(f"ref-{v.name}-{i}") as tmp:
                    ref = _on_bed(make_bed(Path(tmp) / "ref", 1), nproc, f"chaos-ref-{v.name}-{i}",
                                  [], Variant("ref", (), key),
                                  {"ELASWAVE_TRAIN__SKIP_STEPS": json.dumps(skipped)})  # fmt: skip
            by_variant[v.name] = {
                "flags": list(v.flags),
                "kinds": list(v.kinds),
                "etcd_members": v.etcd_members,
                "at_leader": v.at_leader,
                "racks": list(v.racks),
                "schedule": plan,
                "skipped_steps": skipped,
                **_figures(ref, soak),
            }
        rounds.append(by_variant)
    return {
        "scenario": "chaos",
        "variant": bed_name,
        "repeat": repeat,
        "seed": SEED,
        "steps": STEPS,
        "hosts": hosts,
        "nproc_per_node": nproc,
        "lease_ttl_s": LEASE_TTL,
        "hang_timeout_s": HANG_TIMEOUT,
        "slow_delay_s": SLOW_DELAY,
        "verify_every": VERIFY_EVERY,
        "reduce_dtype": REDUCE_DTYPE,
        "rounds": rounds,
    }


def _on_bed(
    bed: Any,
    nproc: int,
    job: str,
    plan: list[dict[str, Any]],
    variant: Variant,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    workdir = bed.workdir
    workdir.mkdir(parents=True)
    try:
        bed.start()
        env = bench_env(
            workdir / "state",
            {
                "ELASWAVE_TIMEOUTS__LEASE_TTL": str(LEASE_TTL),
                "ELASWAVE_TIMEOUTS__ETCD_CONNECT": "2",
                "ELASWAVE_TIMEOUTS__RENDEZVOUS": "60",
                "ELASWAVE_TRAIN__REDUCE_DTYPE": REDUCE_DTYPE,
                **(extra_env or {}),
            },
        )
        soak = _Soak(bed, nproc, job, env, variant)
        start = time.time()
        for host in bed.hosts:
            soak.launch(host)
        injected = soak.inject_all(plan)
        codes = _wait_exit(bed, timeout=900)
        wall = time.time() - start
        merged = _merged(bed, workdir / "merged")
        return {
            "wall_s": wall,
            "exit_codes": codes,
            "injected": injected,
            "merged": str(merged),
            "metrics": read_jsonl(merged / "metrics.jsonl"),
            "events": read_jsonl(merged / "events.jsonl"),
            "report": _report(merged),
            "outputs": {h: bed.output(h)[-600:] for h in bed.hosts if codes.get(h) != 0},
        }
    finally:
        bed.close()


class _Soak:
    """Injects the faults of one schedule into one live job, each after the last was answered."""

    def __init__(
        self, bed: Any, nproc: int, job: str, env: dict[str, str], variant: Variant
    ) -> None:
        self.bed, self.nproc, self.job, self.env, self.variant = bed, nproc, job, env, variant
        self.evicted: Counter[str] = Counter()  # host -> its slots a replay emptied
        self.slowed: str | None = None  # worker id made slow by the last slow fault

    @property
    def full(self) -> int:
        """Workers at full size: every slot but those evicted since their host's launch."""
        return len(self.bed.hosts) * self.nproc - sum(self.evicted.values())

    def launch(self, host: str) -> None:
        """A daemon for ``host`` (again): every slot of the host, the evicted ones too."""
        self.evicted.pop(host, None)
        self.bed.launch(
            host, "--job-id", self.job, "--nproc-per-node", str(self.nproc),
            "--nnodes", f"{max(1, len(self.bed.hosts) - 1)}:{len(self.bed.hosts)}",
            "--steps", str(STEPS),
            "--max-restarts", "100", "--hang-timeout", str(HANG_TIMEOUT),
            "--straggler-threshold", "0", "--loop-breaker", "0",
            "--verify-every", str(VERIFY_EVERY), "--preempt-grace", str(PREEMPT_GRACE),
            "--durable-dir", str(self.bed.workdir / "checkpoints"),  # shared: a preemption's
            *self.variant.flags, env=self.env,
        )  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        out = [e for h in self.bed.hosts for e in read_jsonl(self.bed.workdir / h / "events.jsonl")]
        return sorted(out, key=lambda e: e["t"])

    def metrics(self) -> list[dict[str, Any]]:
        out = [
            m for h in self.bed.hosts for m in read_jsonl(self.bed.workdir / h / "metrics.jsonl")
        ]
        return sorted(out, key=lambda m: m["time"])

    def step(self) -> int:
        return max((m["step"] for m in self.metrics()), default=0)

    def plans(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["kind"] == "plan_published"]

    def leader(self) -> str | None:
        elected = [e for e in self.events() if e["kind"] == "leader_elected"]
        return elected[-1]["host"] if elected else None

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.bed.daemons.values())

    def finished(self) -> bool:
        """Every daemon exited 0 with the last step committed: the job ended normally."""
        codes = [p.poll() for p in self.bed.daemons.values()]
        return all(c == 0 for c in codes) and self.step() >= STEPS

    def inject_all(self, plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
        def started() -> bool:  # every host in, a few steps at full size
            plans = self.plans()
            if not plans or plans[-1]["world"] != self.full:
                return False
            epoch = plans[-1]["epoch"]
            return sum(m["epoch"] >= epoch for m in self.metrics()) >= MARGIN_STEPS

        wait_until(started, 240, "the job did not start at full size")
        out = []
        for n, fault in enumerate(plan, 1):
            if not self.alive():
                break
            if self.step() > STEPS - 3 * MARGIN_STEPS - (
                SLOW_STEPS if fault["kind"] == "slow" else 0
            ):
                console.print(f"[yellow]out of steps before fault {n}[/yellow]")
                break
            record = self.inject(fault)
            console.print(f"fault {n}/{len(plan)}: {record['what']} at step {record['step']}")
            out.append(record)
            try:
                record.update(self.recover(record))
            except BenchError as exc:
                record["recovered"] = False
                record["error"] = str(exc)
                console.print(f"[red]fault {n} not recovered:[/red] {exc}")
                if not self.alive():
                    break
        return out

    def inject(self, fault: dict[str, Any]) -> dict[str, Any]:
        kind = fault["kind"]
        plan = self.plans()[-1]
        record: dict[str, Any] = {"kind": kind, "epoch_before": plan["epoch"], "step": self.step()}
        args = ["--kind", kind]
        leader = self.leader()
        if kind == "etcd":
            member = self.bed.members[fault["pick"] % len(self.bed.members)]
            record.update(member=member, what=f"etcd member {member} killed", t=time.time())
            self.bed.kill_etcd(member)
            return record
        if kind == "recovery":
            return self._inject_during_recovery(fault, plan, record, leader)
        if kind == "preempt":
            record.update(what="SIGTERM to every launch", t=time.time())
            for proc in self.bed.daemons.values():
                proc.send_signal(signal.SIGTERM)
            return record
        if kind in HOST_KINDS:
            hosts = [h for h in self.bed.hosts if (h == leader) == self.variant.at_leader]
            host = hosts[fault["pick"] % len(hosts)]
            args += ["--host", host]
            record.update(host=host, what=f"{kind} host {host}", leader=host == leader)
        else:
            if fault.get("cure"):
                worker = self.slowed
                self.slowed = None
                rank = plan["workers"].index(worker)
            else:
                ranks = self._ranks(plan, leader)
                rank = ranks[fault["pick"] % len(ranks)]
                worker = plan["workers"][rank]
            if kind == "slow":
                args += ["--delay", str(SLOW_DELAY)]
                self.slowed = worker
            elif kind == "gradsdc":
                args = ["--kind", "corrupt", "--target", "grad"]
            args += ["--rank", str(rank)]
            record.update(rank=rank, worker=worker, what=f"{kind} rank {rank} ({worker})")
            if fault.get("cure"):
                record["cure"] = True
        record["t"] = time.time()
        self._cli_inject(args)
        return record

    def _ranks(self, plan: dict[str, Any], leader: str | None) -> list[int]:
        """The ranks a rank fault may hit (``at_leader``: the workers on the leader's host)."""
        workers = plan["workers"]
        if self.variant.at_leader and leader is not None:
            mine = [r for r, w in enumerate(workers) if str(w).startswith(f"{leader}.")]
            if mine:
                return mine
        return list(range(len(workers)))

    def _inject_during_recovery(
        self, fault: dict[str, Any], plan: dict[str, Any], record: dict[str, Any], leader: Any
    ) -> dict[str, Any]:
        """Arm ``kill --phase recovery`` on one rank, then kill another: the armed one dies as
        it starts applying the plan that answers the first death."""
        ranks = self._ranks(plan, leader)
        first = ranks[fault["pick"] % len(ranks)]
        armed = (first + 1 + (fault["pick"] >> 8) % (len(plan["workers"]) - 1)) % len(
            plan["workers"]
        )
        step = self.step()
        self._cli_inject(["--kind", "kill", "--rank", str(armed), "--at-step", str(step + 1),
                          "--phase", "recovery"])  # fmt: skip
        time.sleep(0.5)  # delivered to the armed worker before the trigger fires
        record.update(
            rank=first, worker=plan["workers"][first], armed=plan["workers"][armed],
            what=f"kill rank {first}, and rank {armed} during its recovery", t=time.time(),
        )  # fmt: skip
        self._cli_inject(["--kind", "kill", "--rank", str(first)])
        return record

    def _cli_inject(self, args: list[str]) -> None:
        if self.bed.endpoints:  # the netns bed; a single host finds its job's embedded etcd
            args = [*args, "--etcd", self.bed.endpoints]
        r = self.bed.cli("inject-fault", "--job-id", self.job, "--json", *args, env=self.env)
        if r.returncode != 0:
            raise BenchError(f"inject-fault {' '.join(args)} failed: {r.stderr.strip()[-300:]}")

    def recover(self, record: dict[str, Any]) -> dict[str, Any]:
        """Wait until the fault is answered and the job is back at full size; the marks."""
        t0, kind = record["t"], record["kind"]
        if kind == "partition":
            wait_until(
                lambda: self._after("host_lost", t0, host=record["host"]), 60, "no host_lost"
            )
            self.bed.heal(record["host"])
            wait_until(lambda: self._after("host_fenced", t0, host=record["host"]), 60, "no fence")
        elif kind == "host":
            wait_until(
                lambda: self._after("host_lost", t0, host=record["host"]), 60, "no host_lost"
            )
            wait_until(
                lambda: self.bed.daemons[record["host"]].poll() is not None, 30, "host alive"
            )
            self.launch(record["host"])  # a new daemon for the lost host: capacity comes back
        elif kind == "slow":
            wait_until(lambda: self._after("straggler_detected", t0), 90, "no straggler verdict")
            target = self.step() + SLOW_STEPS
            wait_until(lambda: self.step() >= target or not self.alive(), 120, "no slow steps")
        elif kind == "corrupt":  # repaired from a replica, or, where a replay of the gradient
            # sees the wrong parameters first, outvoted and evicted
            answer = wait_until(
                lambda: self._after("sdc_rolled_back", t0) or self._after("sdc_repaired", t0)
                or self._after("replay_mismatch", t0),
                90, "corruption not answered",
            )  # fmt: skip
            if answer["kind"] == "replay_mismatch":
                self._evicted(answer, record["worker"])
        elif kind == "nan":
            wait_until(lambda: self._after("step_skipped", t0), 60, "the NaN step not skipped")
        elif kind == "gradsdc":  # outvoted, evicted: its slot stays empty
            found = wait_until(lambda: self._after("replay_mismatch", t0), 60, "no replay verdict")
            self._evicted(found, record["worker"])
        elif kind == "preempt":  # every launch checkpoints and exits 75; all are launched again
            procs = list(self.bed.daemons.values())
            wait_until(lambda: all(p.poll() is not None for p in procs),
                       PREEMPT_GRACE + 30, "a preempted launch did not exit")  # fmt: skip
            codes = sorted({p.returncode for p in procs})
            if codes != [75]:
                raise BenchError(f"preempted launches exited {codes}, not 75")
            for host in self.bed.hosts:
                self.launch(host)
        elif kind == "etcd":  # training goes on meanwhile; then the member comes back
            time.sleep(ETCD_RESTART_AFTER)
            self.bed.restart_etcd(record["member"])

        def full() -> dict[str, Any] | None:
            if not self.alive():
                if self.finished():  # answered and trained on, then the job reached its end
                    return {"finished": True}
                raise BenchError("a daemon exited")
            plans = [p for p in self.plans() if p["t"] > t0]
            if kind not in ("corrupt", "etcd", "nan") and not plans:
                return None
            last = self.plans()[-1]
            if last["world"] != self.full:
                return None
            after = [m for m in self.metrics() if m["epoch"] >= last["epoch"] and m["time"] > t0]
            return after[MARGIN_STEPS - 1] if len(after) >= MARGIN_STEPS else None

        commit = wait_until(
            full, RECOVERY_TIMEOUT, f"no recovery to full size after {record['what']}"
        )
        if commit.get("finished"):  # no time to full size: the job ended first
            return {"recovered": True, "full_size_s": None}
        return {"recovered": True, "full_size_s": commit["time"] - t0}

    def _evicted(self, verdict: dict[str, Any], worker: str) -> None:
        """A replay evicted ``worker``: its slot stays empty until its host is launched again.
        A host left with no worker leaves the job (exit 0) and is launched again at once."""
        if verdict.get("verdict") != "evict" or verdict.get("odd_workers") != [worker]:
            raise BenchError(f"replay verdict {verdict}, not the eviction of {worker}")
        host = worker.split(".")[0]
        self.evicted[host] += 1
        if self.evicted[host] < self.nproc:
            return
        proc = self.bed.daemons[host]
        wait_until(lambda: proc.poll() is not None, 60, f"{host}, drained, still running")
        if proc.returncode != 0:
            raise BenchError(f"drained host {host} exited {proc.returncode}")
        self.launch(host)

    def _after(self, kind: str, t0: float, **match: Any) -> dict[str, Any] | None:
        return next(
            (
                e
                for e in self.events()
                if e["kind"] == kind
                and e["t"] >= t0
                and all(e.get(k) == v for k, v in match.items())
            ),
            None,
        )


class _LocalBed:
    """The single-host stand-in for the netns bed: one ``elaswave launch`` on an embedded etcd."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config = workdir, config
        self.hosts = ["h0"]
        self.endpoints = ""
        self.daemons: dict[str, subprocess.Popen[str]] = {}

    def start(self) -> _LocalBed:
        return self

    def launch(self, host: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
        cmd = [
            sys.executable, "-m", "elaswave", "launch", str(self.config),
            "--run-dir", str(self.workdir / host), "--quiet", "--host-id", host, *args,
        ]  # fmt: skip
        out = open(self.workdir / f"{host}.out", "w")  # noqa: SIM115 - owned by the proc
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
        self.daemons[host] = proc
        return proc

    def cli(self, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "elaswave", *args]
        return subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
        )

    def heal(self, host: str) -> None:
        raise BenchError("no partitions on a single host")

    def output(self, host: str) -> str:
        path = self.workdir / f"{host}.out"
        return path.read_text()[-3000:] if path.exists() else ""

    def close(self) -> None:
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()


# ---- figures -----------------------------------------------------------------------------------
DETECTED_BY = {
    "kill": "worker_exit",
    "hang": "hang_detected",
    "corrupt": ("sdc_detected", "replay_mismatch"),
    "slow": "straggler_detected",
    "host": "host_lost",
    "partition": "host_lost",
    "recovery": "worker_exit",
    "nan": "step_skipped",
    "preempt": "preempt_requested",
    "gradsdc": "replay_mismatch",
}
# the report's incident kind, where it is not the fault's
REPORTED_AS = {"nan": "nonfinite", "preempt": "relaunch", "gradsdc": "grad_sdc"}


def _figures(ref: dict[str, Any], soak: dict[str, Any]) -> dict[str, Any]:
    steps = [m["step"] for m in soak["metrics"]]
    counts = {s: steps.count(s) for s in set(steps)}
    ref_loss = {m["step"]: m["loss"] for m in ref["metrics"]}
    dev = {
        m["step"]: abs(m["loss"] - ref_loss[m["step"]]) / abs(ref_loss[m["step"]])
        for m in soak["metrics"]
        if m["step"] in ref_loss and not m.get("skipped")  # a skipped step's loss: NaN
    }
    last = max(steps, default=0)
    injected = soak["injected"]
    survived = all(c == 0 for c in soak["exit_codes"].values()) and last == STEPS
    per_fault = [_marks(f, soak["events"], soak["metrics"]) for f in injected]
    ref_final = {(f["params_sha256"], f["state_sha256"]) for f in ref["events"]
                 if f["kind"] == "final_state"}  # fmt: skip
    by_kind = {}
    for kind in sorted({p["kind"] for p in per_fault}):
        mine = [p for p in per_fault if p["kind"] == kind]
        rep = [i for i in soak["report"]["incidents"] if i["kind"] == REPORTED_AS.get(kind, kind)]
        by_kind[kind] = {
            "injected": len(mine),
            "recovered": sum(1 for p in mine if p["recovered"]),
            "detection_s": summarize(p["detection_s"] for p in mine),
            "mttr_s": summarize(p["mttr_s"] for p in mine),
            "full_size_s": summarize(p["full_size_s"] for p in mine),
            "report_detection_s": summarize(i["detection_s"] for i in rep),
            "report_mttr_s": summarize(i["mttr_s"] for i in rep),
        }
    finals = [e for e in soak["events"] if e["kind"] == "final_state"]
    weight = {"recovery": 2}
    return {
        "faults_injected": sum(weight.get(f["kind"], 1) for f in injected),
        "faults_recovered": sum(weight.get(f["kind"], 1) for f in injected if f.get("recovered")),
        "unexpected_exits": _unexpected_exits(soak["events"]),
        "steps_bit_identical": sum(
            1 for m in soak["metrics"] if ref_loss.get(m["step"]) == m["loss"] or m.get("skipped")
        ),
        "final_state_identical": bool(finals)
        and {(f["params_sha256"], f["state_sha256"]) for f in finals} == ref_final,
        "survived": survived,
        "exit_codes": soak["exit_codes"],
        "last_step": last,
        "steps_lost": sorted(set(range(1, STEPS + 1)) - set(steps)),
        "steps_duplicated": sorted(s for s, c in counts.items() if c > 1),
        "final_loss": soak["metrics"][-1]["loss"] if soak["metrics"] else None,
        "final_loss_ref": ref["metrics"][-1]["loss"] if ref["metrics"] else None,
        "final_rel_dev": dev.get(STEPS),
        "max_rel_dev": max(dev.values(), default=None),
        "max_rel_dev_step": max(dev, key=dev.__getitem__) if dev else None,
        "steps_over_tol": sum(d > REL_TOL for d in dev.values()),
        "first_step_over_tol": min((s for s, d in dev.items() if d > REL_TOL), default=None),
        "rel_dev_by_100_steps": [
            max((d for s, d in dev.items() if lo < s <= lo + 100), default=None)
            for lo in range(0, last, 100)
        ],
        "replicas_agree": len({f["params_sha256"] for f in finals}) == 1 and bool(finals),
        "plans": sum(1 for e in soak["events"] if e["kind"] == "plan_published"),
        **_tiers(soak["events"]),
        "wall_ref_s": ref["wall_s"],
        "wall_soak_s": soak["wall_s"],
        "time_lost_per_fault_s": (soak["wall_s"] - ref["wall_s"]) / max(1, len(injected)),
        "by_kind": by_kind,
        "faults": per_fault,
        "report_totals": soak["report"]["totals"],
        "outputs": soak["outputs"],
    }


def _tiers(events: list[dict[str, Any]]) -> dict[str, int]:
    """How much of the soak ran reduced by tiers (``train.hierarchy: auto``, the default): the
    plans whose hosts had different worker counts, and the host and lane groups built."""
    plans = [e for e in events if e["kind"] == "plan_published"]
    uneven = sum(
        len(set(Counter(w.split(".")[0] for w in p["workers"]).values())) > 1 for p in plans
    )
    built = [g for e in events if e["kind"] == "comm_rebuilt" for g in e.get("rebuilt", [])]
    return {
        "uneven_plans": uneven,
        "tier_groups_built": sum(g.startswith(("dp.host", "dp.lane")) for g in built),
        "rack_groups_built": sum(g.startswith(("dp.rlane", "dp.xlane")) for g in built),
    }


def _marks(
    fault: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> dict[str, Any]:
    """Detection (fault → the event that sees it) and MTTR (fault → first commit after the
    answer: the first plan after the detection; corrupt: the repair)."""
    t0, kind = fault["t"], fault["kind"]

    def first(pred: Callable[[dict[str, Any]], bool], t: float) -> dict[str, Any] | None:
        return next((e for e in events if e["t"] >= t and pred(e)), None)

    if kind not in DETECTED_BY:  # an etcd member: nothing in the job detects or answers it
        return {
            "kind": kind, "what": fault["what"], "step": fault["step"],
            "recovered": bool(fault.get("recovered")), "error": fault.get("error"),
            "detection_s": None, "mttr_s": None, "full_size_s": fault.get("full_size_s"),
        }  # fmt: skip
    want = DETECTED_BY[kind]
    wanted = (want,) if isinstance(want, str) else want
    detected = first(
        lambda e: (
            e["kind"] in wanted and (e.get("host") == fault["host"] if kind in HOST_KINDS else True)
        ),
        t0,
    )
    answer = None
    if detected is not None:
        keys = {
            "corrupt": ("sdc_rolled_back", "sdc_repaired", "plan_published"),
            "nan": ("step_skipped",),
        }.get(kind, ("plan_published",))  # fmt: skip
        answer = first(lambda e: e["kind"] in keys, detected["t"])
    commit = None
    if answer is not None:
        commit = next((m for m in metrics if m["time"] >= answer["t"]), None)
    return {
        "kind": kind,
        "what": fault["what"],
        "step": fault["step"],
        "recovered": bool(fault.get("recovered")),
        "error": fault.get("error"),
        "detection_s": detected["t"] - t0 if detected else None,
        "mttr_s": commit["time"] - t0 if commit else None,
        "full_size_s": fault.get("full_size_s"),
    }


def _unexpected_exits(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers that exited on their own with a non-zero code (a survivor that died): every exit
    the soak causes is a signal (kill, a hang's kill) or a fenced host's stop."""
    return [
        {k: e.get(k) for k in ("worker", "exit_code", "reason")}
        for e in events
        if e["kind"] == "worker_exit" and (e.get("exit_code") or 0) > 0
    ]


# ---- helpers -----------------------------------------------------------------------------------
def _merged(bed: Any, out: Path) -> Path:
    """The hosts' run dirs merged into one, in time order (what ``elaswave report`` reads)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, key in (("events.jsonl", "t"), ("metrics.jsonl", "time")):
        rows = [r for h in bed.hosts for r in read_jsonl(bed.workdir / h / name)]
        rows.sort(key=lambda r: r[key])
        if name == "metrics.jsonl":
            rows = distinct_records(rows)
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _report(run_dir: Path) -> dict[str, Any]:
    from elaswave.report import build_report

    return build_report(run_dir)


def _wait_exit(bed: Any, timeout: float) -> dict[str, int | None]:
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for host, proc in bed.daemons.items():
        try:
            codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[host] = None  # still running: killed by close()
    return codes


def show(result: dict[str, Any]) -> None:
    def s(v: float | None, digits: int = 2) -> str:
        return "–" if v is None else f"{v:.{digits}f}"

    for rnd in result["rounds"]:
        rows = []
        for name, r in rnd.items():
            rows.append((
                name,
                f"{r['faults_injected']} / {r['faults_recovered']}",
                "yes" if r["survived"] else "NO",
                f"{len(r['steps_lost'])} / {len(r['steps_duplicated'])}",
                str(len(r["unexpected_exits"])),
                f"{r['steps_bit_identical']} / {r['last_step']}",
                "yes" if r["final_state_identical"] else "no",
                s(r["max_rel_dev"], 9),
                s(r["time_lost_per_fault_s"]),
            ))  # fmt: skip
        print_table(
            f"Chaos soak, {result['variant']}, {result['steps']} steps, seed {result['seed']}, "
            f"{result['reduce_dtype']} reduction",
            ("variant", "faults in / recovered", "survived", "steps lost / dup", "bad exits",
             "losses bit-identical", "final state identical", "max rel. dev.",
             "s lost / fault"),
            rows,
        )  # fmt: skip
        for name, r in rnd.items():
            kinds = []
            for kind, k in r["by_kind"].items():
                kinds.append((
                    kind, f"{k['injected']} / {k['recovered']}", s(k["detection_s"]["median"]),
                    s(k["mttr_s"]["median"]), s(k["full_size_s"]["median"]),
                    s(k["report_detection_s"]["median"]), s(k["report_mttr_s"]["median"]),
                ))  # fmt: skip
            print_table(f"{name}: per kind (medians, seconds)", COLUMNS, kinds)
            print(f"{name}: {r['uneven_plans']} of {r['plans']} plans with uneven hosts; "
                  f"{r['tier_groups_built']} host and lane groups built, "
                  f"{r['rack_groups_built']} rack lane and slice groups")  # fmt: skip
