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

This computes the report; :mod:`elaswave.report_text` (json, csv, md) and
:mod:`elaswave.report_html` lay it out.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elaswave.events import EVENTS_FILE, METRICS_FILE, RUN_CONFIG, distinct_records, read_jsonl

PHASES = ("detection_s", "plan_s", "comm_s", "state_s", "redo_s")
HOST_KINDS = ("host", "partition")  # whole-host faults: detected by the leader's host_lost


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
    for i, ev in enumerate(events):
        kind = ev.get("fault", {}).get("kind")
        if ev["kind"] == "fault_injected" and kind == "corrupt":
            if ev["fault"].get("target") == "grad":
                continue  # its incident starts from the replay that found it (or none)
            incidents.append(_corruption(ev, events[i:], metrics))
        elif ev["kind"] == "replay_mismatch":
            incidents.append(_grad_sdc(ev, events[:i], plans, metrics))
        elif ev["kind"] == "host_lost":
            cause = _host_fault(events[:i], ev["host"])
            incidents.append(
                _incident(
                    cause, ev, None, events=events, plans=plans, metrics=metrics, host=ev["host"]
                )
            )
        elif ev["kind"] == "relaunched":
            incidents.append(_relaunch(ev, events, plans, metrics=metrics))
        elif ev["kind"] == "fault_injected" and kind in HOST_KINDS:
            continue  # the victim's own record; its incident starts from the leader's host_lost
        elif ev["kind"] == "fault_injected" and kind == "nan":
            continue  # its incident starts from the step it made non-finite (step_skipped)
        elif ev["kind"] == "step_skipped" and ev.get("reason") == "nonfinite":
            incidents.append(_nonfinite(ev, events, metrics))
        elif ev["kind"] == "fault_injected":
            victim = ev.get("worker")
            exit_ev = _first(
                events[i:], lambda e, w=victim: e["kind"] == "worker_exit" and e.get("worker") == w
            )
            if exit_ev is not None:
                used_exits.add(id(exit_ev))
            incidents.append(
                _incident(
                    ev, exit_ev, ev.get("worker"), events=events, plans=plans, metrics=metrics
                )
            )
    for ev in events:
        if ev["kind"] == "worker_exit" and id(ev) not in used_exits:
            incidents.append(
                _incident(None, ev, ev.get("worker"), events=events, plans=plans, metrics=metrics)
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


def _host_fault(before: list[dict[str, Any]], host: str) -> dict[str, Any] | None:
    """The request of the host fault that made ``host`` lost, if any: the first record of it
    (the victim's own, or another daemon's record of the request) since ``host`` was last lost
    (a host can be lost, come back and be lost again)."""
    last_lost = max(
        (e["t"] for e in before if e["kind"] == "host_lost" and e.get("host") == host),
        default=float("-inf"),
    )
    causes = [
        e for e in before
        if e["t"] > last_lost
        and e["kind"] in ("fault_injected", "fault_requested")
        and e.get("fault", {}).get("kind") in HOST_KINDS
        and e.get("fault", {}).get("host") == host
    ]  # fmt: skip
    return min(causes, key=lambda e: e["t"]) if causes else None


def _first(items: Iterable[dict[str, Any]], pred: Any) -> dict[str, Any] | None:
    return next((e for e in items if pred(e)), None)


def _corruption(
    fault: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> dict[str, Any]:
    """A silent-corruption incident: injected → detected by verification → rolled back to the
    known-good state and redone up to the detecting step (or, without one, repaired)."""
    t0 = fault["t"]
    detected = _first(events, lambda e: e["kind"] == "sdc_detected" and e["t"] >= t0)
    after = (detected or fault)["t"]
    repaired = _first(events, lambda e: e["kind"] == "sdc_repaired" and e["t"] >= after)
    inc: dict[str, Any] = dict.fromkeys(PHASES)
    inc.update(
        kind="corrupt",
        worker=fault.get("worker"),
        rank=fault.get("rank"),
        fault_step=fault.get("step"),
        fault_t=t0,
        reason=f"corrupted {fault.get('corrupted')}",
        epoch=None,
        world_after=None,
        first_commit_step=None,
        detected_step=detected.get("step") if detected else None,
        mttr_s=None,
    )
    if detected:
        inc["detection_s"] = round(detected["t"] - t0, 6)
        inc["reason"] += f"; detected at step {detected.get('step')} ({detected.get('what')})"
    rolled = _first(
        events, lambda e: e["kind"] == "sdc_rolled_back" and e["t"] >= after
    ) if detected else None  # fmt: skip
    if detected and rolled:
        # Back on the fault-free trajectory once the detecting step is committed again.
        again = _first(
            metrics, lambda m: m.get("step") == rolled["step"] and m.get("time", 0) >= rolled["t"]
        )
        inc["state_s"] = round(rolled["t"] - detected["t"], 6)
        inc["recomputed_steps"] = rolled.get("redone_steps")
        inc["reason"] += (
            f" → rolled back to the known-good step {rolled.get('to_step')}, "
            f"{rolled.get('redone_steps')} steps redone"
        )
        if again is not None:
            inc["redo_s"] = round(again["time"] - rolled["t"], 6)
            inc["mttr_s"] = round(again["time"] - t0, 6)
            inc["first_commit_step"] = again["step"]
    elif detected and repaired:
        inc["state_s"] = round(repaired["t"] - detected["t"], 6)
        inc["mttr_s"] = round(repaired["t"] - t0, 6)
        inc["reason"] += " → repaired from a good copy"
    return inc


def _grad_sdc(
    found: dict[str, Any],
    before: list[dict[str, Any]],
    plans: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> dict[str, Any]:
    """A replay found a rank miscomputing a gradient (``replay_mismatch``): the step was not
    applied, the odd rank evicted, the step redone; it ends when that step is committed."""
    step, odd = found["step"], found.get("odd_workers") or []
    fault = _first(
        reversed(before),
        lambda e: e["kind"] == "fault_injected" and e.get("fault", {}).get("target") == "grad"
        and e.get("step") == step,
    )  # fmt: skip
    plan = _first(plans, lambda p: p["t"] >= found["t"] and set(odd) & set(p.get("evicted", [])))
    commit = _first(metrics, lambda m: m.get("step") == step and m["time"] >= found["t"])
    t0 = (fault or found)["t"]
    inc: dict[str, Any] = dict.fromkeys(PHASES)
    inc.update(
        kind="grad_sdc",
        worker=odd[0] if odd else None,
        rank=(found.get("odd_ranks") or [None])[0],
        fault_step=step,
        fault_t=t0,
        detected_step=step,
        reason=plan["reason"]
        if plan
        else f"step {step}: replayed gradients disagree ({found.get('verdict')})",
        evicted=odd,
        epoch=plan["epoch"] if plan else None,
        world_after=plan["world"] if plan else None,
        first_commit_step=commit["step"] if commit else None,
        mttr_s=round(commit["time"] - t0, 6) if commit else None,
        recomputed_steps=1 if commit else 0,
    )
    return inc


def _nonfinite(
    skipped: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> dict[str, Any]:
    """A step whose reduced loss or gradient was not finite: not applied on any rank. Its
    reason names the ranks' micro-batches and samples that brought the non-finite values
    (their ``nonfinite_local`` events), and an injected ``nan`` fault where one caused it."""
    step = skipped["step"]
    fault = _first(
        (e for e in reversed(events) if e["t"] <= skipped["t"]),
        lambda e: e["kind"] == "fault_injected" and e.get("fault", {}).get("kind") == "nan"
        and e.get("step") == step,
    )  # fmt: skip
    local = [e for e in events if e["kind"] == "nonfinite_local" and e.get("step") == step]
    named = "; ".join(
        f"rank {e.get('rank')}: micro-batches {e.get('microbatches')}, samples "
        f"{e.get('samples')}{' …' if e.get('samples_total', 0) > len(e.get('samples', [])) else ''}"
        for e in local
    )
    nxt = _first(metrics, lambda m: m.get("step") == step + 1 and m["time"] >= skipped["t"])
    t0 = (fault or skipped)["t"]
    inc: dict[str, Any] = dict.fromkeys(PHASES)
    inc.update(
        kind="nonfinite",
        worker=(fault or (local[0] if local else skipped)).get("worker"),
        rank=local[0].get("rank") if local else None,
        fault_step=step,
        fault_t=t0,
        reason=f"step {step} not applied: its loss or gradient was not finite"
        + (f" ({named})" if named else ""),
        epoch=None,
        world_after=None,
        first_commit_step=nxt["step"] if nxt else None,
        mttr_s=round(nxt["time"] - t0, 6) if nxt else None,
        recomputed_steps=0,
        microbatches={e.get("rank"): e.get("microbatches") for e in local},
        samples={e.get("rank"): e.get("samples") for e in local},
    )
    return inc


def _incident(
    fault: dict[str, Any] | None,
    exit_ev: dict[str, Any] | None,
    worker: str | None,
    *,
    events: list[dict[str, Any]],
    plans: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    host: str | None = None,
) -> dict[str, Any]:
    """A crash, hang, straggler or (``host``) a lost host: ``exit_ev`` is what detected it (the
    worker's exit, or the leader's ``host_lost``)."""
    start = fault or exit_ev
    assert start is not None
    t0 = start["t"]
    plan, detected = _answer(
        t0, fault, exit_ev, worker=worker, host=host, events=events, plans=plans
    )
    inc: dict[str, Any] = {
        "kind": (fault or {}).get("fault", {}).get("kind", "host" if host else "crash"),
        "host": host,
        "worker": worker,
        "rank": start.get("rank"),
        "fault_step": start.get("step"),
        "fault_t": t0,
        "reason": plan["reason"] if plan else _detected_reason(exit_ev, host),
        "epoch": plan["epoch"] if plan else None,
        "world_after": plan["world"] if plan else None,
    }
    recovery, commit, redone = _recovery(t0, detected, plan, events=events, metrics=metrics)
    inc.update(recovery)
    _note_rollback(inc, t0, redone, events=events)
    inc["first_commit_step"] = commit["step"] if commit else None
    inc["mttr_s"] = round(commit["time"] - t0, 6) if commit else None
    inc.update(_stacks(t0, worker, events))
    inc["spare"] = _spare(t0, worker, events)
    return inc


def _spare(t0: float, worker: str | None, events: list[dict[str, Any]]) -> str | None:
    """The warm spare that took ``worker``'s place (``spare_activated``), if one did."""
    if worker is None:
        return None
    ev = _first(
        events,
        lambda e: e["kind"] == "spare_activated" and e.get("replaces") == worker and e["t"] >= t0,
    )
    return str(ev["worker"]) if ev is not None else None


def _stacks(t0: float, worker: str | None, events: list[dict[str, Any]]) -> dict[str, Any]:
    """A worker killed as hung: its threads' stacks as it was killed (``stacks``) and their file
    in its host's run directory (``stacks_file``)."""
    taken = _first(
        events, lambda e: e["kind"] == "hang_stacks" and e.get("worker") == worker and e["t"] >= t0
    ) if worker is not None else None  # fmt: skip
    if taken is None:
        return {}
    return {"stacks": taken.get("stacks"), "stacks_file": taken.get("path")}


def _relaunch(
    ev: dict[str, Any],
    events: list[dict[str, Any]],
    plans: list[dict[str, Any]],
    *,
    metrics: list[dict[str, Any]],
) -> dict[str, Any]:
    """The job launched again under its id after it died whole (a scheduler's requeue, a
    person): from the relaunch to the first step committed past what it had recorded, the
    steps after its checkpoint trained again on the way (``recomputed_steps``)."""
    t0 = ev["t"]
    plan = _first(plans, lambda p: p["t"] >= t0)
    recovery, commit, _ = _recovery(
        t0, t0, plan, events=events, metrics=metrics
    )  # seen as it starts
    inc: dict[str, Any] = {
        "kind": "relaunch",
        "host": ev.get("host"),
        "worker": None,
        "rank": None,
        "fault_step": int(ev["committed"]) + 1,
        "fault_t": t0,
        "reason": ev["reason"],
        "epoch": plan["epoch"] if plan else None,
        "world_after": plan["world"] if plan else None,
    }
    inc.update(recovery)
    inc["recomputed_steps"] = int(ev.get("lost_steps", 0))
    inc["first_commit_step"] = commit["step"] if commit else None
    inc["mttr_s"] = round(commit["time"] - t0, 6) if commit else None
    return inc


def _answer(
    t0: float,
    fault: dict[str, Any] | None,
    exit_ev: dict[str, Any] | None,
    *,
    worker: str | None,
    host: str | None,
    events: list[dict[str, Any]],
    plans: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, float | None]:
    """The plan that answered an incident that started at ``t0`` (the first plan since then in
    which the lost worker or host departed) and when the incident was detected, each ``None`` if
    never.
    A straggler is detected by the leader's verdict instead, and answered by the plan of that
    verdict (a re-share or an eviction), unless it was so slow that its daemon killed it as
    hung."""
    detected = exit_ev["t"] if exit_ev else None

    def departed(p: dict[str, Any]) -> bool:
        gone = p.get("departed", [])
        if host is not None:
            return f"host {host} lost" in p.get("reason", "") or any(
                str(w).startswith(host + ".") for w in gone
            )
        return worker in gone

    plan = _first(plans, lambda p: p["t"] >= t0 and departed(p))
    hung = _first(  # a worker slowed past the hang timeout is killed: a crash, not a straggler
        events,
        lambda e: e["kind"] == "hang_detected" and e.get("worker") == worker and e["t"] >= t0,
    )
    if (fault or {}).get("fault", {}).get("kind") == "slow" and hung is None:
        verdict = _first(
            events,
            lambda e: (
                e["kind"] == "straggler_detected"
                and e["t"] >= t0
                and worker in e.get("stragglers", []) + e.get("evict", [])
            ),
        )
        detected = verdict["t"] if verdict else None
        answer = verdict["plan_reason"] if verdict else None
        plan = _first(plans, lambda p: p["t"] >= t0 and p.get("reason") == answer)
    return plan, detected


def _recovery(
    t0: float,
    detected: float | None,
    plan: dict[str, Any] | None,
    *,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """How the job recovered under ``plan``: (the incident's comm and state fields then its
    phases, the first step committed under the plan, the committed steps redone after a
    rollback to a snapshot). Without a plan, only the detection phase is known (if detected)."""
    fields: dict[str, Any] = dict.fromkeys(
        (
            "comm_rebuild_max_s",
            "state_bytes",
            "state_resume_step",
            "state_pairs",
            "state_max_over_mean",
            "state_promoted_bytes",
            "kept_microbatches",
            "redone_microbatches",
            "redone_by",
        )
    )
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    if detected is not None:  # known even if no plan ever answered the fault
        phases["detection_s"] = round(detected - t0, 6)
    commit = None
    redone = 0  # committed steps rolled back to a snapshot (``--snapshot-every K > 1``)
    if plan is not None:
        epoch = plan["epoch"]
        comm = [e for e in events if e["kind"] == "comm_rebuilt" and e.get("epoch") == epoch]
        state = [e for e in events if e["kind"] == "state_synced" and e.get("epoch") == epoch]
        commit = _first(metrics, lambda m: m.get("epoch", 0) >= epoch and m["time"] >= plan["t"])
        t_comm = max((e["t"] for e in comm), default=None)
        t_state = max((e["t"] for e in state), default=None)
        marks = [t0, detected, plan["t"], t_comm, t_state, commit["time"] if commit else None]
        for name, a, b in zip(PHASES, marks, marks[1:], strict=False):
            phases[name] = round(b - a, 6) if a is not None and b is not None else None
        fields["comm_rebuild_max_s"] = max((e.get("seconds", 0.0) for e in comm), default=None)
        fields.update(_state_sync(epoch, state, events))
        redone = max((e.get("redone_steps", 0) for e in state), default=0)
    fields.update(phases)
    return fields, commit, redone


def _state_sync(
    epoch: int, state: list[dict[str, Any]], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The state fields of an incident from the ``state_synced`` records of ``epoch``: bytes
    moved, pairs, balance, resume step, the pipelines' layer migration, ZeRO's promoted bytes."""
    fields: dict[str, Any] = {}
    # ZeRO ranks each report the whole plan's transfer totals; replicated sync reports
    # what each receiving rank got.
    planned = [e["bytes"] for e in state if "transfers" in e]
    fields["state_bytes"] = max(planned) if planned else sum(e.get("bytes", 0) for e in state)
    fields["state_pairs"] = max((e.get("pairs", 0) for e in state), default=0)
    fields["state_max_over_mean"] = max((e.get("max_over_mean", 1.0) for e in state), default=None)
    fields["state_resume_step"] = state[0].get("resume_step") if state else None
    modes = {e["migration"] for e in state if "migration" in e}
    if modes:  # pipelines: layers of a lost stage moved (async: while training went on)
        fields["migration"] = modes.pop()
        done = _first(events, lambda e: e["kind"] == "migration_done" and e["epoch"] == epoch)
        fields["migration_s"] = (
            done["seconds"]
            if done
            else max((e.get("migration_seconds", 0.0) for e in state), default=None)
        )
    promoted = [e["promoted_bytes"] for e in state if "promoted_bytes" in e]  # ZeRO only
    fields["state_promoted_bytes"] = max(promoted) if promoted else None
    staged = _first(state, lambda e: "redo_replicas" in e)  # pipelines: by replica
    if staged is not None:
        by = {f"replica {d}": len(ids) for d, ids in enumerate(staged["redo_replicas"]) if ids}
        fields["redone_by"] = by
        fields["redone_microbatches"] = sum(by.values())
        fields["kept_microbatches"] = staged["microbatches"] - fields["redone_microbatches"]
    redo = _first(state, lambda e: "redo_microbatches" in e)  # every rank reports the same
    if redo is not None:
        by = {w: len(ids) for w, ids in redo["redo_microbatches"].items()}
        fields["redone_by"] = by
        fields["redone_microbatches"] = sum(by.values())
        fields["kept_microbatches"] = sum(redo["kept_microbatches"].values())
    return fields


def _note_rollback(
    inc: dict[str, Any], t0: float, redone: int, *, events: list[dict[str, Any]]
) -> None:
    """Record in ``inc`` the steps computed again after the incident: from a durable checkpoint
    when the in-memory copies were lost (the first restore since ``t0``), else the ``redone``
    steps after a rollback to a snapshot."""
    relaunch = _first(events, lambda e: e["kind"] == "relaunched" and e["t"] >= t0)
    until = relaunch["t"] if relaunch else float("inf")  # a relaunch's restore is its own
    restored = _first(
        events,
        lambda e: (
            e["kind"] == "durable_restored" and t0 <= e["t"] < until and e.get("reason") != "resume"
        ),
    )
    inc["recomputed_steps"] = restored["recomputed_steps"] if restored else redone
    if redone and not restored:
        inc["reason"] += (
            f"; rolled back to snapshot step {inc['state_resume_step']}, {redone} step(s) redone"
        )
    if restored:
        inc["_restored_t"] = restored["t"]
        inc["reason"] += (
            f"; in-memory copies lost, restored checkpoint step {restored['step']}, "
            f"{restored['recomputed_steps']} step(s) recomputed"
        )


def _detected_reason(exit_ev: dict[str, Any] | None, host: str | None) -> str:
    if host is not None and exit_ev is not None:
        return f"host {host} lost ({exit_ev.get('reason', '')})"
    return (exit_ev or {}).get("reason", "")


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
