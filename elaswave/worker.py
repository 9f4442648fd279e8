"""Worker process entry point: ``python -m elaswave.worker --control SOCK --worker-id ID``.

Started by the host daemon; receives its configuration over the control channel, builds the model,
reports ``ready`` and runs the engine until the job's last step is committed. A job of a script
(``launch --script``) runs the script instead, which drives the engine from its own loop
(:mod:`elaswave.runtime.loop`).

A warm spare (``--spare``) builds as far as it can without a device slot (on the CPU: the whole
engine, model and data), reports ``ready`` and waits: told to stop (or preempted), it leaves;
activated (:class:`~elaswave.wire.Activate`), it takes the slot it is given and trains as any
newcomer.

This is where a worker is put together: the runtime knows pruning only through its hook
(:mod:`elaswave.runtime.prunehook`), and the concrete pruner
(:class:`~elaswave.prune.pruner.Pruner`) is chosen here, outside the runtime. :func:`preflight`
is what the worker template (:mod:`elaswave.runtime.template`) checks before any worker of a
job starts.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.procutil import die_with_parent, exit_now, stacks_on_signal
from elaswave.prune.groups import find_groups
from elaswave.prune.pruner import Pruner
from elaswave.runtime.comm.control_client import ControlClient
from elaswave.runtime.device import place, probe, spare_builds_ahead, worker_device
from elaswave.runtime.engine import Engine
from elaswave.runtime.loop import Session, run_script
from elaswave.runtime.workload.base import build_layers
from elaswave.runtime.workload.load import check_data, load_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elaswave-worker")
    parser.add_argument("--control", required=True, help="daemon control socket path")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--slot", type=int, default=0, help="local slot (picks the device)")
    parser.add_argument("--shield", type=int, help="a signal to ignore (the daemon's to answer)")
    parser.add_argument("--stacks", help="where the stacks go when the daemon kills it as hung")
    parser.add_argument("--spare", action="store_true", help="a warm spare: wait to be activated")
    args = parser.parse_args(argv)
    if args.shield is not None:  # the preemption signal: a scheduler sends it to every process
        signal.signal(args.shield, signal.SIG_IGN)  # of the job, and the daemon answers it
    die_with_parent()  # never outlive the daemon, even if it is SIGKILLed
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.worker_id} %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.stacks:
        try:
            stacks_on_signal(args.stacks)  # this process's own file (a forked one's too)
        except OSError as exc:  # no stacks of a hang then; training goes on
            logging.getLogger(__name__).warning("no stacks file %s: %s", args.stacks, exc)
    control = ControlClient(args.control, args.worker_id)
    if not control.wait_for(lambda: control.config is not None, timeout=60):
        logging.getLogger(__name__).error("no configuration from the daemon within 60s")
        return 3
    assert control.config is not None
    cfg = JobConfig.from_dict(control.config.config)
    per_device = cfg.elastic.workers_per_device  # > 1: slots share a device, over gloo
    kind = place(cfg.train.device, probe()).kind
    slot: int | None = args.slot
    if args.spare and not spare_builds_ahead(kind, script=cfg.script is not None):
        slot = activated(control)  # imported and configured; nothing built
        if slot is None:
            return 0
    device = worker_device(kind, slot if slot is not None else 0, per_device)
    if cfg.script is not None:  # the user's own loop drives the engine (elaswave.init())
        session = Session(cfg, control, args.worker_id, control.config.host_addr, device)
        code = run_script(session)
        control.flush(timeout=10.0)
        return code
    engine = Engine(
        cfg, control, worker_id=args.worker_id, host_addr=control.config.host_addr,
        device=device, pruning=Pruner.build,
    )  # fmt: skip
    # pipelines: the layer costs the leader cuts by
    control.send(wire.Ready(worker_id=args.worker_id, **engine.strategy.ready()))
    if args.spare and control.activation is None and activated(control) is None:
        return 0  # a spare the job never needed
    code = engine.run()
    engine.close()  # no checkpoint write of this rank is left in flight
    control.flush(timeout=10.0)  # the last reports (final state, done) reach the daemon
    return code


def activated(control: ControlClient) -> int | None:
    """A warm spare's wait: the slot it was given when activated, or None when told to stop
    or its host is preempted (it holds nothing to checkpoint). The daemon ends it like any
    worker (its reader thread exits when the daemon goes away)."""
    control.wait_for(
        lambda: (
            control.activation is not None
            or control.stop_requested
            or control.preempt_requested is not None
        ),
        None,
    )
    if control.activation is None:
        return None
    logging.getLogger(__name__).info(
        "activated: slot %d, in place of %s", control.activation.slot, control.activation.replaces
    )
    return control.activation.slot


def preflight(cfg: JobConfig) -> None:
    """What the workers of ``cfg`` would meet first, checked before any of them starts: the
    model builds, the data fits it (:func:`~elaswave.runtime.workload.load.check_data`), and a
    pruned model has groups to prune. Raises the first problem (an
    :class:`~elaswave.errors.ElasWaveError`, or the job's own code's error)."""
    if cfg.script is not None:  # the script builds its model: nothing to check before
        return
    workload = load_workload(cfg)
    check_data(cfg, workload)
    if cfg.train.prune is not None:  # a model with nothing to prune: before any worker
        model = build_layers(workload, cfg.train.seed, keep=range(0))  # shapes: on meta
        find_groups(workload, model, cfg.train.prune.kinds)


if __name__ == "__main__":
    exit_now(main())  # nothing is in flight: skip the seconds of torch's teardown
