"""Errors shared by the CLI, the daemon and the runtime.

Every error a user can cause derives from :class:`ElasWaveError`; the CLI turns it into a single
line on stderr and a non-zero exit code. :class:`ShardLost` is the runtime's own: the layers of
a worker that raise it (strategies, durable checkpoints) and the loop that ends the worker on it
all import it from here. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

# A worker's exit code when every in-memory copy of some state is gone and there is no durable
# checkpoint to fall back on: the job cannot go on from where it was, and a respawned worker
# would only start it over from step 0. The daemon never respawns it; the job stops.
EXIT_STATE_LOST = 5
# A worker's exit code when the user's script (``launch --script``) raised, exited non-zero or
# returned early: a respawned worker would run the same code into the same error. Never
# respawned; the job stops with the reason.
EXIT_SCRIPT_FAILED = 6
# A worker's exit code when the job stops on a step that is not finite (``train.nonfinite:
# stop``, or more skipped steps in a row than ``train.nonfinite_limit``): every rank saw the
# same reduced values, so every rank stops alike.
# Never respawned: a new worker would meet the same data.
EXIT_NONFINITE = 7
# A worker's exit code when a replay of a micro-batch (``replay_every``) finds three different
# gradients: no majority names the rank that miscomputes, and no gradient can be vouched for.
EXIT_UNDECIDED = 8
# A worker's exit code, and a launch's, when the job was preempted (``launch --preempt-signal``,
# SIGTERM by default): the newest committed step is checkpointed durably and launching the job
# again resumes from it with no step lost. EX_TEMPFAIL: "try again"; a Slurm script requeues on
# it (docs/deploy.md). Never respawned.
EXIT_PREEMPTED = 75


class ShardLost(RuntimeError):
    """Both copies of (part of) a shard are gone (an owner and a replica holder died together),
    or every copy of some state is gone and no durable checkpoint replaces it: the worker ends
    with :data:`EXIT_STATE_LOST`."""


def one_line(exc: BaseException) -> str:
    """A user's code's error in a one-line message: its type and the first line of its text."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class ElasWaveError(Exception):
    """A user-facing error: its message is one line that says what to fix."""

    exit_code = 2


class ConfigError(ElasWaveError):
    """The job configuration (file, environment or flags) is invalid."""


class FaultSpecError(ElasWaveError):
    """A fault specification could not be parsed or does not fit the job."""


class EtcdUnavailable(ElasWaveError):
    """The membership store could not be reached within its timeout."""

    exit_code = 3


class JobNotFound(ElasWaveError):
    """No job with the given id is known to this machine or to etcd."""


class JobStopped(ElasWaveError):
    """The leader stopped the whole job on purpose (e.g. a restart loop); the reason says why."""

    exit_code = 4


class JobFailed(ElasWaveError):
    """The job ended without committing all of its steps."""

    exit_code = 1


class StartOverRefused(ElasWaveError):
    """A job id that committed steps was launched again with nothing to resume from: it would
    train from step 0 again (the message says how to do that on purpose)."""

    exit_code = EXIT_STATE_LOST


class JobComplete(ElasWaveError):
    """A job id that committed all its steps was launched again: nothing to train."""

    exit_code = 0


class HostDrained(ElasWaveError):
    """Every worker this host ran was evicted: it leaves, and the job goes on without it."""

    exit_code = 0


class EtcdAccessDenied(ElasWaveError):
    """etcd refused an operation: the user has no role on the job's key prefix."""

    exit_code = 3


class LeaseExpired(ElasWaveError):
    """etcd refused a write under this host's lease: the lease has expired (the host registers
    again; the daemon handles it, the user never sees it)."""


class RunDirFull(ElasWaveError):
    """Records of a finished run could not be written to its run directory (a full disk)."""

    exit_code = 6


class JobPreempted(ElasWaveError):
    """The job was preempted and its newest committed step checkpointed: launch it again to
    resume."""

    exit_code = EXIT_PREEMPTED


class VerdictStop(RuntimeError):
    """Every rank reached the same verdict that the job cannot go on: the message is the one
    line that says which and why, ``event`` the record's kind, and the workers end with
    ``exit_code`` (never respawned: a new worker would meet the same step)."""

    event = "verdict_stop"
    exit_code = EXIT_NONFINITE


class NonFiniteStop(VerdictStop):
    """The job stops on a non-finite step (:data:`EXIT_NONFINITE`)."""

    event = "nonfinite_stop"
    exit_code = EXIT_NONFINITE


class ReplayUndecided(VerdictStop):
    """A replayed micro-batch's gradient differs on three ranks (:data:`EXIT_UNDECIDED`)."""

    event = "replay_undecided"
    exit_code = EXIT_UNDECIDED
