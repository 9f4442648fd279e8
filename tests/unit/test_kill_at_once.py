"""``kill_at_once``: the test beds' power loss. Processes of one node must not act on each
other's deaths: every one is stopped before any dies, and the deaths go children first, so no
exit leaves a stopped process group orphaned (the kernel would wake it with SIGHUP)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elaswave.testing import netbed
from elaswave.testing.netbed import alive, kill_at_once

# A session leader whose child leads a process group of its own: while the leader lives the
# group is not orphaned; were the leader to die while the group is stopped, the kernel would
# send the group SIGHUP and SIGCONT. The child notes a SIGHUP, and its own child's death.
TREE = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[1]
    if os.fork() == 0:
        os.setpgid(0, 0)
        signal.signal(signal.SIGHUP, lambda *_: open(out + "/hup", "w").close())
        signal.signal(signal.SIGCHLD, lambda *_: open(out + "/child-died", "w").close())
        if os.fork() == 0:
            time.sleep(600)
        open(out + "/ready", "w").close()
        while True:
            time.sleep(0.01)
    time.sleep(600)
    """
)


def test_a_tree_dies_with_no_process_acting_on_another_death(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[int, int]] = []
    real = netbed._signal

    def signal_and_note(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        real(pid, sig)

    monkeypatch.setattr(netbed, "_signal", signal_and_note)
    leader = subprocess.Popen([sys.executable, "-c", TREE, str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and leader.poll() is None
            time.sleep(0.05)
        tree = [leader.pid, *(p.pid for p in psutil.Process(leader.pid).children(recursive=True))]
        assert len(tree) == 3

        def listed() -> list[int]:
            return [p for p in tree if alive(p)]

        killed = kill_at_once(listed)
        assert sorted(killed) == sorted(tree)
        # every process stopped, parents first, before the first SIGKILL; then children first
        stops = [pid for pid, sig in sent if sig == signal.SIGSTOP]
        kills = [pid for pid, sig in sent if sig == signal.SIGKILL]
        assert stops == tree and sent[: len(stops)] == [(p, signal.SIGSTOP) for p in stops]
        assert kills == tree[::-1]
        assert not listed()
        assert leader.wait(timeout=10) == -9
        time.sleep(0.2)  # a handler woken now would still write its file
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


@pytest.mark.parametrize(
    ("parents", "depths"),
    [
        ({}, {}),
        ({10: 1}, {10: 0}),  # a parent outside the set: a root
        ({10: 1, 11: 10, 12: 11, 13: 10}, {10: 0, 11: 1, 12: 2, 13: 1}),
        ({10: 1, 20: 1, 21: 20}, {10: 0, 20: 0, 21: 1}),  # two trees
        ({1: 0, 5: 1}, {1: 0, 5: 1}),  # init's parent is 0
    ],
)
def test_depths(parents: dict[int, int], depths: dict[int, int]) -> None:
    assert netbed.depths(parents) == depths
