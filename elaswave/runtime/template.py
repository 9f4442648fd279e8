"""The worker template: one process per host that imports torch and the runtime once and forks
every worker of the host from that state (``python -m elaswave.runtime.template``).

``launch`` starts it before anything else, so its imports (about two seconds of torch) overlap
etcd's start and the daemon's join, and each worker then starts in milliseconds instead of
importing torch again: four workers importing at once on two cores took seven seconds.
Nothing here starts a thread or touches an accelerator before a fork (a child forked from a
threaded or CUDA-initialised process is unsafe): the template only imports modules; whatever
runs code of the job (the preflight, a worker, the store) runs in a forked child.

Protocol: JSON lines, requests on stdin and replies on stdout, one reply per request, in order.

- first line out: ``{"ready": true, "pid": P, "seconds": S}`` once torch and the runtime are
  imported;
- ``{"op": "log", "path": PATH}`` → ``{"ok": true}``: stderr to the job's log from now on (a
  template started before the run directory was known);
- ``{"op": "preload", "modules": [...]}`` → ``{"ok": true}``: the job's modules imported (the
  workload's, e.g. transformers for a Hugging Face model, and what a ZeRO-3 backward imports),
  so that every worker finds them;
- ``{"op": "preflight", "config": {...}}`` → ``{"ok": true}`` or ``{"error": "one line"}``: the
  worker entry's :func:`~elaswave.worker.preflight` (the model builds, the data fits it, a
  pruned model has groups to prune), checked in a forked child;
- ``{"op": "spawn", "entry": "worker" | "store", "argv": [...], "log": PATH, "parent": PID,
  "env": {...}}`` → ``{"pid": P}`` (a store adds ``"port"``) or ``{"error": "..."}``;
- ``{"op": "warm"}`` → ``{"ok": true}``: start importing the ``--warm`` modules (below);
- end of input: the template exits.

A spawned process is forked twice, so that it is the daemon's child and not the template's: the
middle process exits at once and the daemon, a child subreaper
(:func:`~elaswave.procutil.become_subreaper`), adopts the grandchild, waits for it and reads its
exit status like that of any child it started itself. The child waits until it is adopted before
it asks to die with its parent (the middle one's exit would otherwise be that death).

After a ``{"op": "warm"}`` request (the daemon sends it before it asks for the workers of a job
that resumes from a checkpoint or writes them every ``durable_every`` steps), the template
imports the ``--warm`` modules one at a time between requests: what a worker needs only in
some jobs, such as ``torch.distributed.checkpoint``, so that the workers forked after it find
them imported; a request that arrives meanwhile waits for one module at most.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from elaswave.procutil import die_with_parent, exit_now

# What each entry runs: a module whose ``main(argv) -> int`` is the process.
ENTRIES = {"worker": "elaswave.worker", "store": "elaswave.runtime.storeserver"}
REPORT_TIMEOUT = 30.0  # a store reports its port within this (it binds a socket, no more)


@dataclass(frozen=True)
class Child:
    """What a forked grandchild runs once it is back at the top of the template's module."""

    entry: str
    argv: list[str]
    log: str
    env: dict[str, str]  # set in the child's environment (a worker's device settings)
    parent: int  # the daemon: the child's parent once it is adopted
    middle: int  # the middle process, its parent until it exits
    report_fd: int | None  # a store writes its port here


def main(argv: list[str] | None = None) -> int | Child:
    """Serve requests until stdin closes (returns the exit code), or return the :class:`Child`
    this process became in a fork."""
    parser = argparse.ArgumentParser(prog="elaswave-template")
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    parser.add_argument("--warm", action="append", default=[], help="import when asked")
    args = parser.parse_args(argv)
    die_with_parent()
    if os.getppid() != args.parent:
        return 1  # the daemon died before we could ask to die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the daemon's to handle
    started = time.monotonic()
    importlib.import_module(ENTRIES["worker"])
    _reply({"ready": True, "pid": os.getpid(), "seconds": time.monotonic() - started})
    warm: list[str] = []  # filled by a "warm" request
    lines = _Lines(sys.stdin.fileno())
    while True:
        while warm and not lines.ready():
            _warm(warm.pop(0))
        line = lines.next()
        if line is None:
            return 0
        request = json.loads(line)
        op = request.get("op")
        if op == "preflight":
            _reply(_preflight(request["config"]))
        elif op == "spawn":
            child = _spawn(request)
            if child is not None:
                return child
        elif op == "warm":
            warm = list(args.warm)
            _reply({"ok": True})
        elif op == "log":
            _log_to(str(request["path"]))
            _reply({"ok": True})
        elif op == "preload":
            _reply(_preload([str(m) for m in request.get("modules", [])]))
        else:
            _reply({"error": f"unknown request {op!r}"})


def _log_to(path: str) -> None:
    """From now on this process's stderr goes to ``path`` (appended)."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _preload(modules: list[str]) -> dict[str, Any]:
    """Import the job's modules now (workload, ZeRO-3), so that every worker finds them imported."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a missing optional dependency: the preflight says so
            print(f"template: cannot import {module}: {exc}", file=sys.stderr, flush=True)
    return {"ok": True}


def _warm(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # optional: a worker that needs it meets the error itself
        print(f"template: cannot pre-import {module}: {exc}", file=sys.stderr, flush=True)


def _reply(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class _Lines:
    """Lines from a file descriptor, read unbuffered so that :meth:`ready` (a ``select``) never
    misses a line already read into a buffer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def ready(self) -> bool:
        if b"\n" in self.buf or self.eof:
            return True
        return bool(select.select([self.fd], [], [], 0)[0])

    def next(self) -> str | None:
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.eof = True
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


def _preflight(config: dict[str, Any]) -> dict[str, Any]:
    """Build the workload and check the data against it in a forked child (the job's code
    must not run in the template: it may start threads or set torch's global state)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: check, write the verdict, leave without cleanup
        os.close(r)
        try:
            verdict = _check(config)
            os.write(w, json.dumps(verdict).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = _read_all(r)
    os.waitpid(pid, 0)
    if not data:
        return {"error": "the preflight check died without a verdict"}
    return dict(json.loads(data))


def _check(config: dict[str, Any]) -> dict[str, Any]:
    """The worker entry's ``preflight(cfg)`` on ``config``, as a verdict."""
    from elaswave.config import JobConfig
    from elaswave.errors import ElasWaveError

    try:
        importlib.import_module(ENTRIES["worker"]).preflight(JobConfig.from_dict(config))
    except ElasWaveError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the job's own code: its error, on one line
        text = str(exc).strip().splitlines()
        return {"error": f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__}
    return {"ok": True}


def _spawn(request: dict[str, Any]) -> Child | None:
    """Fork the requested process twice (see the module docstring). Returns the
    :class:`Child` in the grandchild, None in the template (after replying)."""
    entry = str(request["entry"])
    if entry not in ENTRIES:
        _reply({"error": f"unknown entry {entry!r}"})
        return None
    report_r, report_w = os.pipe() if entry == "store" else (None, None)
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        return _middle(request, entry, (r, w), report=(report_r, report_w))
    os.close(w)
    if report_w is not None:
        os.close(report_w)
    data = _read_all(r)
    os.waitpid(middle, 0)
    if not data:
        _reply({"error": "fork failed"})
        return None
    reply: dict[str, Any] = {"pid": int(data)}
    if report_r is not None:
        port = _read_line(report_r, REPORT_TIMEOUT)
        if port is None:
            reply = {"error": f"the {entry} (pid {reply['pid']}) reported no port"}
        else:
            reply["port"] = int(port)
    _reply(reply)
    return None


def _middle(
    request: dict[str, Any],
    entry: str,
    pipe: tuple[int, int],
    *,
    report: tuple[int | None, int | None],
) -> Child:
    """The middle process: fork the grandchild, tell the template its pid, exit at once.
    Returns only in the grandchild."""
    r, w = pipe
    me = os.getpid()  # before the fork: once this process has exited, getppid() is the daemon
    try:
        os.close(r)
        pid = os.fork()
    except BaseException:
        os._exit(1)
    if pid == 0:
        os.close(w)
        if report[0] is not None:
            os.close(report[0])
        return Child(
            entry=entry, argv=[str(a) for a in request["argv"]], log=str(request["log"]),
            env={str(k): str(v) for k, v in dict(request.get("env") or {}).items()},
            parent=int(request["parent"]), middle=me, report_fd=report[1],
        )  # fmt: skip
    try:
        os.write(w, str(pid).encode())
    finally:
        os._exit(0)


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def _read_line(fd: int, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            data += chunk
        return data.split(b"\n", 1)[0].decode().strip()
    finally:
        os.close(fd)


def run_child(child: Child) -> int:
    """The grandchild's life: wait to be adopted, die with the daemon, take the log as
    stdout/stderr, then run the entry's ``main``."""
    while os.getppid() == child.middle:  # the middle process exits at once
        time.sleep(0.0002)
    die_with_parent()
    if os.getppid() != child.parent:
        os._exit(70)  # the daemon is gone (or adopted nothing): nobody would wait for us
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any new interpreter
    os.environ.update(child.env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(child.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    module = importlib.import_module(ENTRIES[child.entry])
    argv = list(child.argv)
    if child.report_fd is not None:
        argv += ["--report-fd", str(child.report_fd)]
    return int(module.main(argv))


if __name__ == "__main__":
    outcome = main()
    if isinstance(outcome, Child):  # a worker or the store, done: nothing of it is in flight
        exit_now(run_child(outcome))
    exit_now(outcome)
