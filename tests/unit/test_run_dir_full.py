"""A run directory that fills up: the JSON-lines writers lose nothing and never tear a line.

The disk is a real one: a small tmpfs mounted for the test (root, as in CI), filled by the writer
itself and by a filler file that is deleted to give the space back.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elaswave.events import JsonlWriter, read_jsonl


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a torn line was left in the file"
    return list(read_jsonl(path))


def test_a_full_disk_holds_records_back_and_writes_them_when_space_returns(
    small_disk: Path,
) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 40_000)
    errors: list[OSError] = []
    writer = JsonlWriter(small_disk / "metrics.jsonl", on_error=lambda p, e: errors.append(e))
    for step in range(1, 301):
        writer.write({"step": step, "pad": "x" * 120})
    assert len(errors) == 1 and errors[0].errno == 28  # ENOSPC, reported once
    on_disk = _whole_lines(small_disk / "metrics.jsonl")
    assert writer.unwritten == 300 - len(on_disk) > 0
    assert [r["step"] for r in on_disk] == list(range(1, len(on_disk) + 1))

    filler.unlink()  # space returns: the next write takes the backlog first, in order
    writer.write({"step": 301, "pad": ""})
    assert writer.unwritten == 0
    writer.close()
    steps = [r["step"] for r in _whole_lines(small_disk / "metrics.jsonl")]
    assert steps == list(range(1, 302)), "records lost, duplicated or out of order"


def test_a_rollback_filters_held_back_records_too(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 50_000)
    writer = JsonlWriter(small_disk / "metrics.jsonl", on_error=lambda p, e: None)
    for step in range(1, 201):
        writer.write({"step": step, "pad": "x" * 60})
    assert writer.unwritten > 0
    filler.unlink()
    writer.keep_only(lambda r: r["step"] <= 150)  # a rollback to step 150
    writer.write({"step": 151, "pad": "redone"})
    writer.close()
    records = _whole_lines(small_disk / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 152))
    assert records[-1]["pad"] == "redone"
