"""The MTTR report, computed by replaying a run directory's ``events.jsonl`` and ``metrics.jsonl``.

An incident starts at the fault (``fault_injected``; for an unplanned crash, its detection) and
ends at the first step committed under the plan that answered it. Its phases:

detection  fault → the daemon saw the worker exit
plan       detection → the leader published the next epoch
comm       plan → the last rank rebuilt its process groups
state      comm → the last rank agreed on the resume step and received any missing state
redo       state → the first committed step after the change (the redone in-flight step)

A job launched again under its id after it died whole is an incident too (``relaunch``): from the
relaunch to the first step committed past what it had recorded, with the steps after its durable
checkpoint trained again on the way.

An interrupted step is redone in part where the strategy can: the report says how many of its
micro-batches the survivors kept and how many were computed again, by whom
(``kept_microbatches``, ``redone_microbatches``, ``redone_by``: by worker, or by replica in
pipelines, where every stage of a replica runs the redone micro-batches; ``None`` where the
strategy does not report it, e.g. ZeRO-3, which redoes the whole step).

A worker its daemon killed as hung carries the stacks of its threads as it was killed
(``stacks``, from the ``hang_stacks`` event) and their file in its host's run directory
(``stacks_file``, ``stacks/<worker>-step<N>.txt``); a worker slowed past the hang timeout is such
a crash too, not a straggler.

Control-plane outages (etcd unreachable or restarted, a daemon paused) are incidents too, with
their downtime and the steps trained meanwhile instead of phases: training does not stop for them,
so they have no MTTR.

A pruning run (``train.prune``) also reports where its group sparsity ended against its target,
and, once the job is done below it, one line naming the setting that would change that
(:func:`pruning`).

This computes the report: it replays the records, adds the control-plane outages and the run's
totals; :mod:`elaswave.report_incidents` builds each other kind of incident from the records
that start it, and :mod:`elaswave.report_text` (json, csv, md) and :mod:`elaswave.report_html`
lay it out.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from elaswave.events import EVENTS_FILE, METRICS_FILE, RUN_CONFIG, distinct_records, read_jsonl
from elaswave.report_incidents import (
    HOST_KINDS,
    PHASES,
    corruption,
    first,
    grad_sdc,
    host_fault,
    incident,
    nonfinite,
    relaunch,
)


def build_report(run_dir: str | Path, *more: str | Path) -> dict[str, Any]:
    """The report of one run directory, or of several merged in time order (one per host of a
    multi-host job: each host's daemon logs what it saw)."""
    dirs = [Path(d) for d in (run_dir, *more)]
    events = sorted(
        (e for d in dirs for e in read_jsonl(d / EVENTS_FILE)), key=lambda e: e.get("t", 0.0)
    )
    lines = distinct_records(m for d in dirs for m in read_jsonl(d / METRICS_FILE))
    metrics = [m for m in lines if "kind" not in m]  # committed steps only
    if more:
        metrics.sort(key=lambda m: m.get("time", 0.0))
    plans = [e for e in events if e["kind"] == "plan_published"]
    incidents = []
    used_exits: set[int] = set()
    outvoted: set[int] = set()  # replays that answered a state corruption (its incident)
    for i, ev in enumerate(events):
        kind = ev.get("fault", {}).get("kind")
        if ev["kind"] == "fault_injected" and kind == "corrupt":
            if ev["fault"].get("target") == "grad":
                continue  # its incident starts from the replay that found it (or none)
            incidents.append(corruption(ev, events[i:], plans, metrics, claimed=outvoted))
        elif ev["kind"] == "replay_mismatch":
            if id(ev) not in outvoted:
                incidents.append(grad_sdc(ev, events[:i], plans, metrics))
        elif ev["kind"] == "host_lost":
            cause = host_fault(events[:i], ev["host"])
            incidents.append(
                incident(
                    cause, ev, None, events=events, plans=plans, metrics=metrics, host=ev["host"]
                )
            )
        elif ev["kind"] == "relaunched":
            incidents.append(relaunch(ev, events, plans, metrics=metrics))
        elif ev["kind"] == "fault_injected" and kind in HOST_KINDS:
            continue  # the victim's own record; its incident starts from the leader's host_lost
        elif ev["kind"] == "fault_injected" and kind == "nan":
            continue  # its incident starts from the step it made non-finite (step_skipped)
        elif ev["kind"] == "step_skipped" and ev.get("reason") == "nonfinite":
            incidents.append(nonfinite(ev, events, metrics))
        elif ev["kind"] == "fault_injected":
            victim = ev.get("worker")
            exit_ev = first(
                events[i:], lambda e, w=victim: e["kind"] == "worker_exit" and e.get("worker") == w
            )
            if exit_ev is not None:
                used_exits.add(id(exit_ev))
            incidents.append(
                incident(ev, exit_ev, ev.get("worker"), events=events, plans=plans, metrics=metrics)
            )
    for ev in events:
        if ev["kind"] == "worker_exit" and id(ev) not in used_exits:
            incidents.append(
                incident(None, ev, ev.get("worker"), events=events, plans=plans, metrics=metrics)
            )
    incidents += control_plane_outages(events, metrics)
    incidents.sort(key=lambda x: x["fault_t"])
    claimed: set[float] = set()
    for inc in incidents:  # one restore answers one incident (the first it follows)
        t = inc.pop("_restored_t", None)
        if t is not None and t in claimed:
            inc["recomputed_steps"] = 0
            inc["reason"] = inc["reason"].split("; in-memory copies lost")[0]
        elif t is not None:
            claimed.add(t)
    for n, inc in enumerate(incidents, 1):
        inc["id"] = n
    totals = _totals(events, metrics, incidents)
    totals["memory"] = memory_by_worker(events)
    prune = pruning(dirs[0], metrics, done=any(e["kind"] == "job_done" for e in events))
    if prune is not None:
        totals["prune"] = prune
    evals = sorted((m for m in lines if m.get("kind") == "eval"), key=lambda m: m["step"])
    if evals:
        last = evals[-1]
        totals["eval_loss"] = {"step": last["step"], "loss": last["eval_loss"],
                               "accuracy": last.get("eval_accuracy")}  # fmt: skip
    return {"run_dir": ", ".join(str(d) for d in dirs), "incidents": incidents, "totals": totals}


def pruning(run_dir: Path, metrics: list[dict[str, Any]], *, done: bool) -> dict[str, Any] | None:
    """Where a pruning run stands (None: the run does not prune, or its config cannot be read):
    its method, the group sparsity of its newest committed step, its target, and where the job
    is ``done`` below it, the one line that says so (``below_target``; None otherwise)."""
    from elaswave.config import JobConfig
    from elaswave.errors import ElasWaveError

    cfg = None
    with contextlib.suppress(OSError, ValueError, TypeError, ElasWaveError):
        cfg = JobConfig.from_dict(json.loads((run_dir / RUN_CONFIG).read_text()))
    if cfg is None or cfg.train.prune is None:
        return None
    p = cfg.train.prune
    last = metrics[-1] if metrics else {}
    sparsity = last.get("sparsity")
    below = p.shortfall(sparsity, last_step=int(last.get("step", 0))) if done else None
    return {"method": p.method, "sparsity": sparsity, "target": p.target_sparsity,
            "below_target": below}  # fmt: skip


def recovered_incident(run_dir: str | Path, epoch: int) -> dict[str, Any] | None:
    """The incident the plan of ``epoch`` answered, with its MTTR, from ``run_dir``: None until
    the run directory holds the first step committed under that plan, and when the incident is
    not in it (recorded on another host). What ``launch``'s progress and the job's event stream
    say an incident took."""
    for inc in build_report(run_dir)["incidents"]:
        if inc.get("epoch") == epoch and inc.get("mttr_s") is not None:
            return dict(inc)
    return None


MEMORY_FIELDS = (
    "param_bytes", "grad_bytes", "optimizer_bytes", "replica_bytes", "gathered_bytes",
    "layer_grad_bytes", "transient_bytes", "verify_bytes",
)  # fmt: skip
# ZeRO-3's peaks of gathered parameters and of layer gradients: parts of ``transient_bytes``
PEAK_PARTS = ("gathered_bytes", "layer_grad_bytes")


def memory_by_worker(events: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """What each worker last said it holds (bytes by purpose, and the epoch it said it under)."""
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if e["kind"] == "memory" and e.get("worker"):
            out[e["worker"]] = {k: e[k] for k in ("epoch", *MEMORY_FIELDS) if k in e}
    return out


CONTROL_PLANE = "control plane"
# what an outage is called when several hosts or records saw it: the most telling cause first
CAUSES = ("embedded etcd restarted", "daemon paused", "etcd unreachable")


def outage_spans(events: list[dict[str, Any]]) -> list[tuple[float, float, str, str]]:
    """``(start, end, what, host)`` of every control-plane outage a host recorded. Pure."""
    spans = []
    for e in events:
        host = str(e.get("host", ""))
        if e["kind"] == "etcd_restarted":
            spans.append((e["t"] - e["downtime"], e["t"], "embedded etcd restarted", host))
        elif e["kind"] == "etcd_reachable":
            spans.append((e["since"], e["t"], "etcd unreachable", host))
        elif e["kind"] == "daemon_paused":
            spans.append((e["t"] - e["seconds"], e["t"], "daemon paused", host))
    return spans


def merge_spans(
    spans: list[tuple[float, float, str, str]],
) -> list[tuple[float, float, list[str], list[str]]]:
    """Overlapping outages as one (every host sees the same etcd go away): ``(start, end, whats,
    hosts)`` in time order, each list in first-seen order. Pure."""
    merged: list[tuple[float, float, list[str], list[str]]] = []
    for start, end, what, host in sorted(spans):
        if merged and start <= merged[-1][1]:
            s0, e0, whats, hosts = merged[-1]
            merged[-1] = (s0, max(e0, end), whats, hosts)
        else:
            merged.append((start, end, [], []))
            whats, hosts = merged[-1][2], merged[-1][3]
        if what not in whats:
            whats.append(what)
        if host and host not in hosts:
            hosts.append(host)
    return merged


def control_plane_outages(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One incident per control-plane outage: its downtime and the steps committed meanwhile."""
    out = []
    for start, end, whats, hosts in merge_spans(outage_spans(events)):
        before = [m["step"] for m in metrics if m.get("time", 0.0) < start]
        trained = sorted({m["step"] for m in metrics if start <= m.get("time", 0.0) <= end})
        inc: dict[str, Any] = dict.fromkeys(PHASES)
        inc.update(
            kind=CONTROL_PLANE,
            what=min(whats, key=lambda w: CAUSES.index(w) if w in CAUSES else len(CAUSES)),
            host=", ".join(hosts) or None,
            worker=None,
            rank=None,
            fault_step=max(before, default=0) + 1,
            fault_t=start,
            epoch=None,
            world_after=None,
            first_commit_step=None,
            mttr_s=None,  # training went on: nothing to recover from
            downtime_s=round(end - start, 3),
            steps_trained=len(trained),
            reason=(
                f"{' + '.join(whats)} for {end - start:.1f} s on {', '.join(hosts) or 'the job'}; "
                f"{len(trained)} steps trained meanwhile"
            ),
        )
        out.append(inc)
    return out


def _totals(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], incidents: list[dict[str, Any]]
) -> dict[str, Any]:
    steps = [m["step"] for m in metrics]
    counts = Counter(steps)
    last = max(steps, default=0)
    mttrs = [i["mttr_s"] for i in incidents if i["mttr_s"] is not None]
    wall = (metrics[-1]["time"] - metrics[0]["time"]) if len(metrics) >= 2 else 0.0
    return {
        "committed_steps": len(counts),
        "last_step": last,
        "duplicate_steps": sorted(s for s, c in counts.items() if c > 1),
        "missing_steps": sorted(set(range(1, last + 1)) - set(counts)),
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "final_world_size": metrics[-1]["world_size"] if metrics else None,
        "wall_s": round(wall, 3),
        "incidents": len(incidents),
        "plans": sum(1 for e in events if e["kind"] == "plan_published"),
        "mttr_median_s": round(statistics.median(mttrs), 6) if mttrs else None,
        "mttr_max_s": round(max(mttrs), 6) if mttrs else None,
        "stopped": next(
            (e["reason"] for e in events if e["kind"] in ("loop_breaker", "plan_refused")), None
        ),
        "evicted": [w for e in events if e["kind"] == "worker_evicted" for w in [e["worker"]]],
    }
