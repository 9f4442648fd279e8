"""How the MTTR report builds each kind of incident from a run's records, one function per kind:
a crash, hang, straggler or lost host (:func:`incident`), the whole job launched again
(:func:`relaunch`), a silent corruption (:func:`corruption`), a gradient a replay found
miscomputed (:func:`grad_sdc`), a step not applied for a non-finite loss or gradient
(:func:`nonfinite`); and the recovery phases every incident carries (:data:`PHASES`).

Apart from :mod:`elaswave.report`, which replays a run directory, decides which records start an
incident, and adds the control-plane outages and the run's totals: each function here reads the
records it is given and returns one incident, and none reads a file.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PHASES = ("detection_s", "plan_s", "comm_s", "state_s", "redo_s")
HOST_KINDS = ("host", "partition")  # whole-host faults: detected by the leader's host_lost


def host_fault(before: list[dict[str, Any]], host: str) -> dict[str, Any] | None:
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


def first(items: Iterable[dict[str, Any]], pred: Any) -> dict[str, Any] | None:
    """The first of ``items`` that ``pred`` holds for, if any."""
    return next((e for e in items if pred(e)), None)


def corruption(
    fault: dict[str, Any],
    events: list[dict[str, Any]],
    plans: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    *,
    claimed: set[int],
) -> dict[str, Any]:
    """A silent-corruption incident: injected → detected by verification → rolled back to the
    known-good state and redone up to the detecting step (or, without one, repaired); or, where
    a replay (``replay_every``) met the corrupted parameters first, outvoted and evicted
    (:func:`evicted_by_replay`; that replay's id goes into ``claimed``)."""
    t0 = fault["t"]
    detected = first(events, lambda e: e["kind"] == "sdc_detected" and e["t"] >= t0)
    outvoted = first(
        events,
        lambda e: e["kind"] == "replay_mismatch" and e["t"] >= t0
        and fault.get("worker") in (e.get("odd_workers") or []),
    )  # fmt: skip
    if outvoted is not None and (detected is None or outvoted["t"] < detected["t"]):
        claimed.add(id(outvoted))  # one incident, not a grad_sdc of its own too
        return evicted_by_replay(fault, outvoted, plans, metrics)
    after = (detected or fault)["t"]
    repaired = first(events, lambda e: e["kind"] == "sdc_repaired" and e["t"] >= after)
    inc: dict[str, Any] = dict.fromkeys(PHASES)
    inc.update(
        _corrupted(fault),
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
    rolled = first(
        events, lambda e: e["kind"] == "sdc_rolled_back" and e["t"] >= after
    ) if detected else None  # fmt: skip
    if detected and rolled:
        # Back on the fault-free trajectory once the detecting step is committed again.
        again = first(
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


def grad_sdc(
    found: dict[str, Any],
    before: list[dict[str, Any]],
    plans: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> dict[str, Any]:
    """A replay found a rank miscomputing a gradient (``replay_mismatch``): the step was not
    applied, the odd rank evicted, the step redone; it ends when that step is committed."""
    step, odd = found["step"], found.get("odd_workers") or []
    fault = first(
        reversed(before),
        lambda e: e["kind"] == "fault_injected" and e.get("fault", {}).get("target") == "grad"
        and e.get("step") == step,
    )  # fmt: skip
    plan = first(plans, lambda p: p["t"] >= found["t"] and set(odd) & set(p.get("evicted", [])))
    commit = first(metrics, lambda m: m.get("step") == step and m["time"] >= found["t"])
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


def _corrupted(fault: dict[str, Any]) -> dict[str, Any]:
    """A corruption incident's start: who was corrupted, when."""
    return {"kind": "corrupt", "worker": fault.get("worker"), "rank": fault.get("rank"),
            "fault_step": fault.get("step"), "fault_t": fault["t"]}  # fmt: skip


def evicted_by_replay(
    fault: dict[str, Any],
    found: dict[str, Any],
    plans: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> dict[str, Any]:
    """A corrupted rank whose parameters gave a replayed micro-batch another gradient than its
    peers': the replay outvoted it before the checksums saw it, so the step was not applied, the
    rank was evicted and the step redone (the replay's incident, with the corruption's start)."""
    inc = grad_sdc(found, [], plans, metrics)
    t0 = fault["t"]
    commit = first(metrics, lambda m: m.get("step") == found["step"] and m["time"] >= found["t"])
    inc.update(
        _corrupted(fault),
        detection_s=round(found["t"] - t0, 6),
        mttr_s=round(commit["time"] - t0, 6) if commit else None,
        reason=f"corrupted {fault.get('corrupted')}; outvoted on a replayed micro-batch of step "
        f"{found['step']} → evicted → epoch {inc['epoch']}, world {inc['world_after']}",
    )
    return inc


def nonfinite(
    skipped: dict[str, Any], events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> dict[str, Any]:
    """A step whose reduced loss or gradient was not finite: not applied on any rank. Its
    reason names the ranks' micro-batches and samples that brought the non-finite values
    (their ``nonfinite_local`` events), and an injected ``nan`` fault where one caused it."""
    step = skipped["step"]
    fault = first(
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
    nxt = first(metrics, lambda m: m.get("step") == step + 1 and m["time"] >= skipped["t"])
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


def incident(
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
    ev = first(
        events,
        lambda e: e["kind"] == "spare_activated" and e.get("replaces") == worker and e["t"] >= t0,
    )
    return str(ev["worker"]) if ev is not None else None


def _stacks(t0: float, worker: str | None, events: list[dict[str, Any]]) -> dict[str, Any]:
    """A worker killed as hung: its threads' stacks as it was killed (``stacks``) and their file
    in its host's run directory (``stacks_file``)."""
    taken = first(
        events, lambda e: e["kind"] == "hang_stacks" and e.get("worker") == worker and e["t"] >= t0
    ) if worker is not None else None  # fmt: skip
    if taken is None:
        return {}
    return {"stacks": taken.get("stacks"), "stacks_file": taken.get("path")}


def relaunch(
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
    plan = first(plans, lambda p: p["t"] >= t0)
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

    plan = first(plans, lambda p: p["t"] >= t0 and departed(p))
    hung = first(  # a worker slowed past the hang timeout is killed: a crash, not a straggler
        events,
        lambda e: e["kind"] == "hang_detected" and e.get("worker") == worker and e["t"] >= t0,
    )
    if (fault or {}).get("fault", {}).get("kind") == "slow" and hung is None:
        verdict = first(
            events,
            lambda e: (
                e["kind"] == "straggler_detected"
                and e["t"] >= t0
                and worker in e.get("stragglers", []) + e.get("evict", [])
            ),
        )
        detected = verdict["t"] if verdict else None
        answer = verdict["plan_reason"] if verdict else None
        plan = first(plans, lambda p: p["t"] >= t0 and p.get("reason") == answer)
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
        commit = first(metrics, lambda m: m.get("epoch", 0) >= epoch and m["time"] >= plan["t"])
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
        done = first(events, lambda e: e["kind"] == "migration_done" and e["epoch"] == epoch)
        fields["migration_s"] = (
            done["seconds"]
            if done
            else max((e.get("migration_seconds", 0.0) for e in state), default=None)
        )
    promoted = [e["promoted_bytes"] for e in state if "promoted_bytes" in e]  # ZeRO only
    fields["state_promoted_bytes"] = max(promoted) if promoted else None
    staged = first(state, lambda e: "redo_replicas" in e)  # pipelines: by replica
    if staged is not None:
        by = {f"replica {d}": len(ids) for d, ids in enumerate(staged["redo_replicas"]) if ids}
        fields["redone_by"] = by
        fields["redone_microbatches"] = sum(by.values())
        fields["kept_microbatches"] = staged["microbatches"] - fields["redone_microbatches"]
    redo = first(state, lambda e: "redo_microbatches" in e)  # every rank reports the same
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
    relaunched = first(events, lambda e: e["kind"] == "relaunched" and e["t"] >= t0)
    until = relaunched["t"] if relaunched else float("inf")  # a relaunch's restore is its own
    restored = first(
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
