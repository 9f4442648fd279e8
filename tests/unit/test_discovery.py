"""The discovery record a launch leaves in the state directory (``status`` and ``inject-fault``
find a job on this machine by it): launches of other hosts may share that directory (a home on
a shared filesystem) and read it while it is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elaswave.daemon.discovery import discovery_path, find_job
from elaswave.errors import JobNotFound


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ELASWAVE_STATE_DIR", str(tmp_path))
    (tmp_path / "jobs").mkdir()
    return tmp_path


@pytest.mark.parametrize("text", ["", '{"job_id": "j", "pi', "not json"])
def test_a_torn_or_empty_record_is_no_job_and_no_traceback(state: Path, text: str) -> None:
    discovery_path("j").write_text(text)
    with pytest.raises(JobNotFound, match="no readable record of job 'j'"):
        find_job("j")


def test_a_live_launcher_is_found_and_a_dead_ones_record_removed(state: Path) -> None:
    path = discovery_path("j")
    path.write_text(json.dumps({"job_id": "j", "pid": os.getpid(), "etcd": ["h:1"]}))
    assert find_job("j")["etcd"] == ["h:1"]
    path.write_text(json.dumps({"job_id": "j", "pid": 2**22 + 12345}))  # above pid_max
    with pytest.raises(JobNotFound, match="no longer running"):
        find_job("j")
    assert not path.exists()
