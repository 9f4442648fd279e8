"""A daemon adopting a newer plan fences its live workers that the plan dropped, also when it
skipped the epoch that dropped them (its host was cut off while the others planned twice)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from elaswave.daemon.supervisor import HostDaemon
from elaswave.planning.plan import Plan


def _plan(epoch: int, workers: list[str], departed: tuple[str, ...] = ()) -> Plan:
    return Plan(
        epoch=epoch, workers=tuple(workers), hosts=tuple(w.split(".")[0] for w in workers),
        microbatches=(1,) * len(workers), store="s:1", departed=departed,
    )  # fmt: skip


def _daemon(current: Plan, live: list[str]) -> tuple[Any, list[list[str]]]:
    fenced: list[list[str]] = []
    d = SimpleNamespace(
        plan=current,
        workers={
            wid: SimpleNamespace(
                worker_id=wid, proc=SimpleNamespace(returncode=None), stopping=False, ready=True
            )
            for wid in live
        },  # fmt: skip
        channel=SimpleNamespace(send_plan=lambda plan: None),  # no worker connected
        prom=None,  # no metrics server
        stream=None,  # no TensorBoard, no W&B
        faults=SimpleNamespace(dispatch=lambda: None),
    )
    d.pool = SimpleNamespace(
        fence=lambda workers, plan: fenced.append([w.worker_id for w in workers]),
        evict=lambda wid, plan: None,
    )
    return d, fenced


E1 = _plan(1, ["h0.w0", "h1.w0", "h2.w0", "h2.w1"])


def test_the_next_epoch_fences_its_departures() -> None:
    d, fenced = _daemon(E1, ["h2.w0", "h2.w1"])
    HostDaemon._adopt(d, _plan(2, ["h0.w0", "h1.w0"], departed=("h2.w0", "h2.w1")))
    assert fenced == [["h2.w0", "h2.w1"]]


def test_a_skipped_epoch_still_fences_what_it_dropped() -> None:
    d, fenced = _daemon(E1, ["h2.w0", "h2.w1"])
    # Epoch 2 dropped h2's workers; epoch 3 (a re-cut) departs nobody: h2 sees only epoch 3.
    HostDaemon._adopt(d, _plan(3, ["h1.w0", "h0.w0"]))
    assert fenced == [["h2.w0", "h2.w1"]]
    assert d.plan.epoch == 3


def test_workers_still_in_the_plan_or_already_gone_are_not_fenced() -> None:
    d, fenced = _daemon(E1, ["h2.w0", "h2.w1"])
    d.workers["h2.w1"].proc.returncode = -9  # died: its departure is not a fence
    HostDaemon._adopt(d, _plan(3, ["h0.w0", "h1.w0", "h2.w0"]))
    assert fenced == []


def test_an_older_plan_changes_nothing() -> None:
    d, fenced = _daemon(E1, ["h2.w0", "h2.w1"])
    HostDaemon._adopt(d, _plan(1, ["h0.w0"], departed=("h2.w0",)))
    assert fenced == [] and d.plan is E1
