"""An embedded etcd member's data directory lives in a home marked with its owner process; a
home whose owner is gone (a launch SIGKILLed before its cleanup) is removed by the next member
that starts, and nothing else is; the daemon's control socket directory likewise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from elaswave.daemon.control_server import CONTROL_PREFIX
from elaswave.daemon.etcd_server import DATA_PREFIX, new_data_dir, sweep_data_dirs
from elaswave.owneddirs import OWNER, new_owned_dir, sweep_owned_dirs


def _home(root: Path, name: str, owner: str | None) -> Path:
    home = root / f"{DATA_PREFIX}{name}"
    (home / "data" / "member").mkdir(parents=True)
    if owner is not None:
        (home / OWNER).write_text(owner)
    return home


def test_only_the_homes_of_owners_that_are_gone_are_swept(tmp_path: Path) -> None:
    me = psutil.Process()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = f"{child.pid} {psutil.Process(child.pid).create_time()}"
    child.wait()
    homes = {
        "mine": _home(tmp_path, "mine", f"{me.pid} {me.create_time()}"),
        "dead": _home(tmp_path, "dead", dead),
        "reused": _home(tmp_path, "reused", f"{me.pid} {me.create_time() - 100}"),  # another
        "unmarked": _home(tmp_path, "unmarked", None),
        "garbled": _home(tmp_path, "garbled", "not a pid"),
    }
    other = tmp_path / "something-else"
    other.mkdir()
    removed = sweep_data_dirs(str(tmp_path))
    assert sorted(removed) == sorted([homes["dead"], homes["reused"]])
    assert {p.name for p in tmp_path.iterdir()} == {
        homes[k].name for k in ("mine", "unmarked", "garbled")
    } | {"something-else"}


def test_a_new_data_dir_is_marked_and_sweeps_first(tmp_path: Path) -> None:
    stale = _home(tmp_path, "stale", "999999999 1.0")
    data = Path(new_data_dir(str(tmp_path)))
    assert not stale.exists()
    assert data.name == "data" and data.is_dir() and not any(data.iterdir())
    pid, started = (data.parent / OWNER).read_text().split()
    me = psutil.Process()
    assert (int(pid), float(started)) == (me.pid, me.create_time())
    assert sweep_data_dirs(str(tmp_path)) == []  # its owner runs: kept


def test_a_control_socket_directory_is_owned_and_a_dead_owners_is_swept(tmp_path: Path) -> None:
    """The daemon's control socket lives in an owned directory too: one left by a daemon that
    died before its cleanup goes when the next daemon makes its own."""
    stale = tmp_path / f"{CONTROL_PREFIX}stale"
    stale.mkdir()
    (stale / "control.sock").touch()
    (stale / OWNER).write_text("999999999 1.0")
    fresh = new_owned_dir(CONTROL_PREFIX, str(tmp_path))
    assert not stale.exists()
    assert fresh.stat().st_mode & 0o777 == 0o700
    assert sweep_owned_dirs(CONTROL_PREFIX, str(tmp_path)) == []  # its owner runs: kept
