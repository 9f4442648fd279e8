"""What a launch does when its job id has run before: start, resume, say it is done, or refuse.

A job id whose records say steps were committed (the progress record in etcd, or the run
directory's ``metrics.jsonl``) is never trained from step 0 again, whoever launches it again (a
scheduler's requeue, a new batch job, a person re-running the command). It resumes from the newest
durable checkpoint (the steps after it are lost and trained again, recorded once), or, with no
checkpoint, stops with one line that says what would be lost and how to start over on purpose (a
new job id, or ``--fresh``). Pure: the daemon gathers the :class:`Records` and applies the
:class:`Verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Records", "Verdict", "merge_records", "relaunch_verdict"]


@dataclass(frozen=True)
class Records:
    """What earlier runs of a job id left behind."""

    committed: int  # the newest step recorded as committed (0: none)
    epoch: int  # the newest epoch recorded (plans of the relaunch come after it)
    where: str  # where the committed step was read ("run directory runs/x", "etcd")
    checkpoint: int | None = None  # the newest complete durable checkpoint's step
    checkpoint_dir: str = ""  # where checkpoints are looked for
    checkpoint_failed: str = ""  # newer checkpoints that failed their check, and which file
    config_diff: str = ""  # the first training setting that differs from the earlier run's


@dataclass(frozen=True)
class Verdict:
    action: str  # new | resume | done | refuse
    reason: str = ""
    committed: int = 0  # the job's committed step as the relaunch starts (its progress record)
    resume_step: int = 0  # the checkpoint's step it resumes from
    lost_steps: int = 0  # committed steps trained again (after the checkpoint)
    epoch: int = 0  # the newest epoch recorded: the relaunch's plans come after it


def merge_records(*found: Records | None) -> Records | None:
    """The newest view of several sources (etcd, the run directory): the highest committed
    step and epoch, the checkpoint and config difference of whichever source has them."""
    present = [
        r for r in found
        if r is not None and (r.committed or r.checkpoint is not None or r.checkpoint_failed)
    ]  # fmt: skip
    if not present:
        return None
    top = max(present, key=lambda r: r.committed)
    checkpoints = [r.checkpoint for r in present if r.checkpoint is not None]
    return Records(
        committed=top.committed,
        epoch=max(r.epoch for r in present),
        where=top.where,
        checkpoint=max(checkpoints, default=None),
        checkpoint_dir=next((r.checkpoint_dir for r in present if r.checkpoint_dir), ""),
        config_diff=next((r.config_diff for r in present if r.config_diff), ""),
        checkpoint_failed=next((r.checkpoint_failed for r in present if r.checkpoint_failed), ""),
    )


def relaunch_verdict(
    records: Records | None, *, job_id: str, total_steps: int, resume: bool = False
) -> Verdict:
    """The decision for a launch that finds ``records`` (None: the job id never committed a
    step). ``resume``: the user named a checkpoint to start from (``--resume``)."""
    if records is None or (
        records.committed == 0 and records.checkpoint is None and not records.checkpoint_failed
    ):
        return Verdict("new")
    fresh = "a new --job-id, or --fresh (moves its records and checkpoints aside), trains it "
    fresh += "from step 0"
    if records.config_diff:
        return Verdict(
            "refuse",
            f"job {job_id!r} ran before with other settings ({records.config_diff}); {fresh}",
            epoch=records.epoch,
        )
    committed = max(records.committed, records.checkpoint or 0)
    if resume:
        return Verdict("resume", "the checkpoint --resume names", committed=committed,
                       epoch=records.epoch)  # fmt: skip
    if committed >= total_steps:
        return Verdict(
            "done",
            f"job {job_id!r} already committed all {total_steps} steps ({records.where}): "
            f"nothing to train; --steps N trains it further, {fresh}",
            committed=committed,
            epoch=records.epoch,
        )
    if records.checkpoint is None and records.checkpoint_failed:
        return Verdict(
            "refuse",
            f"job {job_id!r} committed {committed} steps ({records.where}) and no durable "
            f"checkpoint in {records.checkpoint_dir} is intact ({records.checkpoint_failed}): "
            f"it will not train from step 0 again; {fresh}",
            committed=committed,
            epoch=records.epoch,
        )
    if records.checkpoint is None:
        return Verdict(
            "refuse",
            f"job {job_id!r} committed {records.committed} steps ({records.where}) and has no "
            f"durable checkpoint in {records.checkpoint_dir} to resume from: it will not train "
            f"from step 0 again; {fresh} (with --durable-every N a relaunch resumes)",
            committed=committed,
            epoch=records.epoch,
        )
    lost = committed - records.checkpoint
    failed = records.checkpoint_failed
    return Verdict(
        "resume",
        f"job {job_id!r} committed {committed} steps ({records.where}): resuming from the "
        f"checkpoint of step {records.checkpoint}, {lost} step(s) trained again"
        + (f" (a newer checkpoint failed its check: {failed})" if failed else ""),
        committed=committed,
        resume_step=records.checkpoint,
        lost_steps=lost,
        epoch=records.epoch,
    )
