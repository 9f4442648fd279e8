"""A job id launched again: the decision as a table, and what an earlier run left on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elaswave.config import JobConfig
from elaswave.config.jobs import run_record
from elaswave.daemon.earlier import archive, etcd_records, run_dir_records
from elaswave.planning.relaunch import Records, merge_records, relaunch_verdict
from elaswave.runtime.durable.layout import file_sums, newest_intact, write_manifest


def rec(
    committed: int, checkpoint: int | None = None, diff: str = "", epoch: int = 3, failed: str = ""
) -> Records:
    return Records(committed=committed, epoch=epoch, where="run directory r",
                   checkpoint=checkpoint, checkpoint_dir="r/checkpoints",
                   config_diff=diff, checkpoint_failed=failed)  # fmt: skip


ROTTEN = "step-00000015: rank-00001/__0_0.distcp has 10 of its 4096 bytes"


@pytest.mark.parametrize(
    ("records", "resume", "action", "committed", "resume_step", "lost", "words"),
    [
        (None, False, "new", 0, 0, 0, ""),
        (rec(0), False, "new", 0, 0, 0, ""),
        (rec(17, 15), False, "resume", 17, 15, 2, "resuming from the checkpoint of step 15"),
        (rec(15, 15), False, "resume", 15, 15, 0, "0 step(s) trained again"),
        (rec(17), False, "refuse", 17, 0, 0, "will not train from step 0 again"),
        (rec(17, 15, diff="model.n_layer: it had 2, this host 3"), False, "refuse", 0, 0, 0,
         "ran before with other settings (model.n_layer"),
        (rec(40, 40), False, "done", 40, 0, 0, "already committed all 40 steps"),
        (rec(40), False, "done", 40, 0, 0, "--steps N trains it further"),
        # the kill raced the records: a checkpoint newer than the last line is the truth
        (rec(12, 15), False, "resume", 15, 15, 0, ""),
        (rec(0, 10), False, "resume", 10, 10, 0, ""),
        (rec(17), True, "resume", 17, 0, 0, "--resume"),  # the user's checkpoint
        # the newest checkpoint failed its check: the one before it, and the line says why
        (rec(17, 10, failed=ROTTEN), False, "resume", 17, 10, 7,
         f"step 10, 7 step(s) trained again (a newer checkpoint failed its check: {ROTTEN})"),
        (rec(17, None, failed=ROTTEN), False, "refuse", 17, 0, 0,
         f"no durable checkpoint in r/checkpoints is intact ({ROTTEN})"),
        (rec(0, None, failed=ROTTEN), False, "refuse", 0, 0, 0, "is intact"),
    ],
)  # fmt: skip
def test_relaunch_verdict(
    records: Records | None, resume: bool, action: str, committed: int, resume_step: int,
    lost: int, words: str,
) -> None:  # fmt: skip
    v = relaunch_verdict(records, job_id="j", total_steps=40, resume=resume)
    assert (v.action, v.committed, v.resume_step, v.lost_steps) == (
        action, committed, resume_step, lost
    )  # fmt: skip
    assert words in v.reason
    if action == "refuse":
        assert "--fresh" in v.reason and "new --job-id" in v.reason
        assert "\n" not in v.reason
    if records is not None and action != "new":
        assert v.epoch == records.epoch  # the relaunch's plans come after its epochs


def test_merge_takes_the_newest_of_etcd_and_the_run_directory() -> None:
    run = rec(12, 10, epoch=2)
    etcd = Records(committed=17, epoch=4, where="its progress record in etcd")
    merged = merge_records(run, etcd)
    assert merged is not None
    assert (merged.committed, merged.epoch, merged.checkpoint) == (17, 4, 10)
    assert merged.where == "its progress record in etcd"
    assert merge_records(None, None) is None
    assert merge_records(Records(committed=0, epoch=0, where="x"), None) is None
    assert etcd_records(None, 0) is None
    assert etcd_records({"step": 9}, 2) == Records(committed=9, epoch=2,
                                                   where="its progress record in etcd")  # fmt: skip


def _job(tmp_path: Path, **model: object) -> JobConfig:
    return JobConfig.from_dict({"job_id": "j", "run_dir": str(tmp_path / "run"),
                                "model": {"n_layer": 2, **model}})  # fmt: skip


def _checkpoint(root: Path, step: int, *, complete: bool = True) -> None:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_text("x")
        write_manifest(path, file_sums(path, [".metadata"]))
    (root / "LATEST").write_text(path.name)


def test_what_an_earlier_run_left(tmp_path: Path) -> None:
    cfg = _job(tmp_path)
    run = cfg.resolved_run_dir
    assert run_dir_records(run, cfg.resolved_durable_dir, cfg) is None  # never ran
    run.mkdir(parents=True)
    lines = [{"step": s, "epoch": 1 + (s > 5), "loss": 1.0} for s in range(1, 9)]
    lines.append({"kind": "eval", "step": 20, "eval_loss": 1.0})  # not a committed step
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run / "config.json").write_text(json.dumps(run_record(cfg, run)))
    found = run_dir_records(run, cfg.resolved_durable_dir, cfg)
    where = f"run directory {run}"
    assert found == Records(8, 2, where, None, str(cfg.resolved_durable_dir))
    _checkpoint(cfg.resolved_durable_dir, 5)
    assert newest_intact(cfg.resolved_durable_dir).step == 5
    other = _job(tmp_path, n_layer=3)
    changed = run_dir_records(run, other.resolved_durable_dir, other)
    assert changed is not None and changed.checkpoint == 5
    assert changed.config_diff == "model.n_layer: it had 2, this host 3"
    more_steps = JobConfig.from_dict({**cfg.to_dict(), "train": {"steps": 80}})
    again = run_dir_records(run, cfg.resolved_durable_dir, more_steps)
    assert again is not None and again.config_diff == ""  # training settings may change
    stranger = JobConfig.from_dict({**cfg.to_dict(), "job_id": "k"})
    theirs = run_dir_records(run, cfg.resolved_durable_dir, stranger)
    assert theirs is not None and theirs.config_diff == "the run directory holds job 'j'"


def test_an_incomplete_checkpoint_is_not_one(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 5, complete=False)
    found = newest_intact(tmp_path)
    assert found.step is None
    why = "checksums.json is missing (the checkpoint was never finished)"
    assert found.failures() == f"step-00000005: {why}"


def test_fresh_moves_records_and_checkpoints_aside(tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    for name in ("metrics.jsonl", "events.jsonl", "config.json"):
        (run / name).write_text("x\n")
    (run / "logs").mkdir()
    _checkpoint(run / "checkpoints", 10)
    _checkpoint(outside, 7)
    (outside / "notes.txt").write_text("kept")
    first = archive(run, outside)
    assert first is not None and first.parent == run / "previous"
    assert sorted(p.name for p in run.iterdir()) == ["previous"]
    assert (first / "metrics.jsonl").is_file() and (first / "checkpoints" / "LATEST").is_file()
    assert newest_intact(outside).path is None and (outside / "notes.txt").is_file()
    (moved,) = (outside / "previous").iterdir()
    assert (moved / "step-00000007" / ".metadata").is_file()
    (run / "metrics.jsonl").write_text("y\n")
    second = archive(run, outside)  # a second --fresh keeps the first one's records
    assert second is not None and second != first and (second / "metrics.jsonl").is_file()
    assert archive(tmp_path / "nothing", tmp_path / "none") is None
