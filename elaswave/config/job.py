"""The job's whole config (:class:`JobConfig`: the sections plus the parallel layout, durability and
recovery knobs) and the ``launch`` flags that set its keys."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from elaswave.config.cluster import ElasticConfig, EtcdTLSConfig, Timeouts
from elaswave.config.model import DataConfig, ModelConfig
from elaswave.config.observe import LoggingConfig
from elaswave.config.schema import build
from elaswave.config.train import TrainConfig
from elaswave.errors import ConfigError
from elaswave.faults import FaultKind, FaultSpec

# The values of the pipelines' fixed-choice fields (each checked by JobConfig._check_pipeline).
Migration = Literal["async", "blocking"]
StageLoss = Literal["reshard", "drop", "recycle"]
GradReduce = Literal["holders", "all"]
Dvfs = Literal["off", "sim", "nvml", "npu"]
LayerCosts = Literal["estimate", "profile", "online"]


@dataclass(kw_only=True)
class JobConfig:
    """Everything a job needs. Build it with :func:`load_config`."""

    job_id: str = "elaswave"
    """The job's name: 1-64 of [A-Za-z0-9_.-]; hosts launched with the same one form the job."""
    run_dir: str | None = None
    """Default runs/<job_id>."""
    etcd: list[str] = field(default_factory=list)
    """host:port of etcd's endpoints; empty: start an embedded etcd."""
    etcd_port: int = 0
    """Embedded etcd client port (0 = any free port)."""
    metrics_port: int | None = None
    """Each daemon serves Prometheus metrics on this port (0: a free one, printed and recorded
    in events.jsonl); None: no metrics server."""
    etcd_tls: EtcdTLSConfig = field(default_factory=EtcdTLSConfig)
    """TLS towards etcd (off unless a CA is given)."""
    zero: int = 0
    """1: ZeRO-1, optimizer state sharded over the data-parallel ranks (with pp > 1: over each
    layer's holders, two live copies, no snapshots); 3: ZeRO-3, parameters, gradients and
    optimizer state sharded (pp = 1 only, for now)."""
    pp: int = 1
    """Pipeline stages per replica (1: pure data parallelism)."""
    dp: int = 0
    """Data-parallel replicas (0: world / pp); dp × pp must be the starting world."""
    migration: Migration = "async"
    """Pipelines: layers of a lost stage move "async" or "blocking"."""
    stage_loss: StageLoss = "reshard"
    """Pipelines: "reshard" the replica, "drop" it (TorchFT-like) or "recycle" (ReCycle-like:
    a lost stage's micro-batches run on the ranks that run that stage in the other replicas)."""
    grad_reduce: GradReduce = "holders"
    """Pipelines: each layer's gradient summed among its "holders", or the whole model's over
    "all" ranks (for comparisons)."""
    dvfs: Dvfs = "off"
    """Pipelines: frequency actuator off | sim | nvml | npu."""
    layer_costs: LayerCosts = "estimate"
    """Pipelines: partition by a FLOP "estimate", a start-up "profile" of each layer's time
    (measured by every worker), or "online": the profile, then times measured while training."""
    cost_every: int = 10
    """layer_costs=online: workers report their layers' times every K steps."""
    stage_balance: float = 1.10
    """Pipelines: a cut keeps every stage's bytes (parameters, gradients, Adam moments) within
    stage_balance × an even share of the model's where some cut can (else × the smallest
    largest stage any cut reaches; 0: compute alone decides), and never above max_stage_bytes."""
    max_stage_bytes: int = 0
    """Pipelines: no stage's bytes above this (0: no limit; a start no cut fits is refused, a
    replica whose survivors could not fit is dropped)."""
    verify_every: int = 10
    """Compare replicas' checksums every K committed steps (0: never)."""
    replay_every: int = 0
    """Every K steps a peer recomputes one micro-batch of each rank and the gradients' digests
    are compared before the reduction; a rank that miscomputes is evicted and the step redone
    without it (0: never; data parallelism and ZeRO-1 only)."""
    snapshot_every: int = 1
    """ZeRO (pp = 1): replicate each shard (spread over the peers) every K committed steps; a
    fault rolls back to the last snapshot step (0: none; then a lost shard only comes back from
    a checkpoint)."""
    durable_every: int = 0
    """torch.distributed.checkpoint every N committed steps (0: never)."""
    durable_dir: str | None = None
    """Default <run_dir>/checkpoints (shared storage across hosts)."""
    resume: str | None = None
    """Start from the newest durable checkpoint in this directory."""
    fresh: bool = False
    """A job id that committed steps before resumes from its newest durable checkpoint (or, with
    none, refuses to train from step 0 again); fresh: move that run's records and checkpoints
    aside (<run_dir>/previous/) and train from step 0 on purpose."""
    host_id: str | None = None
    """Default: hostname-pid."""
    rack: str = ""
    """This host's tier above hosts (a rack, a switch: ``launch --rack``; empty: none). Ranks are
    laid out rack by rack, and copies kept for a rank go to another rack where the job spans
    two."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """What is trained."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the samples come from."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """How it is trained: the optimisation problem, its numerics and the device."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Membership: how many workers, how many hosts, and the respawn policy."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Every blocking call's limit, in seconds."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard, W&B."""
    faults: list[FaultSpec] = field(default_factory=list)
    """Faults to inject while the job runs (testing recovery)."""
    script: str | None = None
    """A user's own training loop (``launch --script FILE -- ARGS``): every worker runs this
    Python file with these arguments; its model, data and optimizer are the script's
    (``elaswave.init()``), and the model and data sections above do not apply."""
    script_args: list[str] = field(default_factory=list)
    """The script's arguments (after ``--``)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.job_id):
            raise ConfigError(f"job_id must be 1-64 of [A-Za-z0-9_.-], got {self.job_id!r}")
        if self.rack and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.rack):
            raise ConfigError(f"rack must be 1-64 of [A-Za-z0-9_.-], got {self.rack!r}")
        if self.snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.durable_every < 0:
            raise ConfigError(f"durable_every must be >= 0, got {self.durable_every}")
        if self.cost_every < 1:
            raise ConfigError(f"cost_every must be >= 1, got {self.cost_every}")
        if self.verify_every < 0:
            raise ConfigError(f"verify_every must be >= 0, got {self.verify_every}")
        self._check_replay()
        self._check_ablations()
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if self.zero not in (0, 1, 3):
            raise ConfigError(f"zero must be 0, 1 or 3, got {self.zero}")
        self._check_script()
        if self.zero == 3 and self.pp > 1:
            self._check_zero3_stages()
        self._check_pipeline()
        if self.train.shard_scope == "host" and self.zero != 3:
            raise ConfigError(
                f"train.shard_scope host shards ZeRO-3's state inside each host: it needs zero: 3 "
                f"(got zero: {self.zero})"
            )
        if self.train.shard_scope == "host" and self.train.zero3_gather == "tiers":
            raise ConfigError(
                "train.zero3_gather tiers gathers across hosts; with train.shard_scope host every "
                "gather stays inside the host"
            )
        if self.train.grad_compress == "int8" and self.pp > 1:
            raise ConfigError(
                "train.grad_compress int8 compresses the reduction by tiers of data parallelism "
                f"(replicated, ZeRO-1, ZeRO-3), not pipelines' holder groups (got pp: {self.pp})"
            )
        if self.train.eval_every and not self.data.eval_samples:
            raise ConfigError("train.eval_every needs held-out samples: set data.eval_samples")
        if self.data.source == "text" and self.model.source == "module":
            raise ConfigError(
                "data.source: text is tokenized for a language model (model.source gpt or hf); "
                "a model.source: module workload reads its own data"
            )
        if self.data.source == "synthetic" and self.data.eval_samples >= self.data.num_samples:
            raise ConfigError(
                f"data.eval_samples ({self.data.eval_samples}) leaves no training samples of "
                f"data.num_samples ({self.data.num_samples})"
            )
        if not 0 <= self.etcd_port < 65536:
            raise ConfigError(f"etcd_port must be in 0..65535, got {self.etcd_port}")
        if self.etcd_tls.server_cert and self.etcd:
            raise ConfigError(
                "etcd_tls.server_cert is for the embedded etcd; with --etcd, TLS is the "
                "external cluster's own setting"
            )
        _, max_nodes = self.elastic.nnodes_range
        most = self.elastic.nproc_per_node * max_nodes
        if most > self.train.num_microbatches:
            raise ConfigError(
                f"inconsistent sizes: up to {most} workers but only "
                f"{self.train.num_microbatches} micro-batches (global_batch "
                f"{self.train.global_batch} / micro_batch_size {self.train.micro_batch_size})"
            )
        for fault in self.faults:
            if fault.at_step is not None and fault.at_step > self.train.steps:
                raise ConfigError(
                    f"fault '{fault.describe()}' is after the last step ({self.train.steps})"
                )
            if fault.kind is FaultKind.PARTITION:
                raise ConfigError(
                    f"fault '{fault.describe()}': partitions are injected with "
                    "'elaswave inject-fault' (it cuts the link), not from a job config"
                )
            if fault.rank is not None and fault.rank >= most:
                raise ConfigError(
                    f"fault '{fault.describe()}': rank out of range (job has ranks 0..{most - 1})"
                )

    def _check_replay(self) -> None:
        """``replay_every`` compares whole-model gradients of one micro-batch: the data path of
        replicated data parallelism and ZeRO-1 only."""
        if self.replay_every < 0:
            raise ConfigError(f"replay_every must be >= 0, got {self.replay_every}")
        if not self.replay_every:
            return
        if self.zero == 3:
            raise ConfigError(
                "replay_every: zero: 3 reduce-scatters each layer's gradient as it is computed, "
                "so no rank holds a micro-batch's whole gradient to compare (use zero 0 or 1)"
            )
        if self.pp > 1:
            raise ConfigError(
                f"replay_every: pp={self.pp} stages each hold part of the model, so no rank "
                "can recompute a peer's micro-batch (use data parallelism)"
            )
        if self.script is not None:
            raise ConfigError(
                "replay_every: a script's own loop computes its micro-batches itself, so the "
                "engine cannot recompute one on a peer (use a config job)"
            )

    def _check_ablations(self) -> None:
        """``train.rng: rank`` and ``train.batch: shrink`` (``bench convergence``): data
        parallelism's whole-model path only."""
        t = self.train
        for name, on in (
            ("train.rng: rank", t.rng == "rank"),
            ("train.batch: shrink", t.batch == "shrink"),
        ):
            if not on:
                continue
            if self.pp > 1 or self.zero == 3 or self.script is not None or self.replay_every:
                raise ConfigError(
                    f"{name} is an ablation for data parallelism's whole-model path "
                    "(replicated or ZeRO-1, a config job, no replay_every)"
                )

    def _check_script(self) -> None:
        """What a user's own loop does not run, refused in one line each."""
        if self.script is None:
            if self.script_args:
                raise ConfigError("script_args needs a script (launch --script FILE -- ARGS)")
            return
        if self.pp > 1:
            raise ConfigError(
                f"pp={self.pp}: a script's own loop runs data parallelism (replicated or ZeRO-1); "
                "pipelines cut the model into stages: train it as a config job"
            )
        if self.zero == 3:
            raise ConfigError(
                "zero: 3 gathers each layer's parameters around its forward, which a script's "
                "own model call does not let it do: use zero 1 (or a config job for ZeRO-3)"
            )
        if self.train.prune is not None:
            raise ConfigError("train.prune needs a config job (the script's loop keeps its model)")
        if self.train.eval_every:
            raise ConfigError("train.eval_every: a script evaluates in its own loop")

    def _check_zero3_stages(self) -> None:
        """What ZeRO-3 inside pipeline stages does not do yet, refused in one line each."""
        unsupported = {
            "train.prune": self.train.prune is not None,
            "grad_reduce: all": self.grad_reduce == "all",
            # data-parallel ZeRO-3's layer-wise options: a stage is gathered whole for a step
            "train.shard_scope: host": self.train.shard_scope == "host",
            "train.zero3_gather: tiers": self.train.zero3_gather == "tiers",
        }
        for name, used in unsupported.items():
            if used:
                raise ConfigError(
                    f"{name} is not supported with zero: 3 inside pipeline stages (pp={self.pp}); "
                    "use zero: 1 there"
                )

    def _check_pipeline(self) -> None:
        choices = {"migration": get_args(Migration), "stage_loss": get_args(StageLoss),
                   "grad_reduce": get_args(GradReduce), "dvfs": get_args(Dvfs),
                   "layer_costs": get_args(LayerCosts)}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.dvfs in ("nvml", "npu") and self.elastic.workers_per_device > 1:
            raise ConfigError(
                f"dvfs={self.dvfs} clocks each worker's own device: it cannot be used with "
                f"elastic.workers_per_device {self.elastic.workers_per_device} (shared devices)"
            )
        needs = {"nvml": "pynvml", "npu": "torch_npu"}
        if self.dvfs in needs and importlib.util.find_spec(needs[self.dvfs]) is None:
            raise ConfigError(f"dvfs={self.dvfs} needs the {needs[self.dvfs]} package")
        recycle_without = {f"zero: {self.zero}": self.zero != 0, "train.prune": self.train.prune,
                           f"dvfs: {self.dvfs}": self.dvfs != "off"}  # fmt: skip
        for name, used in recycle_without.items():
            if self.stage_loss == "recycle" and self.pp > 1 and used:
                raise ConfigError(
                    f"{name} is not supported with stage_loss recycle (the ReCycle baseline "
                    "runs replicated stages at their own clocks)"
                )
        if not (self.stage_balance == 0 or 1.0 <= self.stage_balance < float("inf")):
            raise ConfigError(f"stage_balance must be 0 or >= 1, got {self.stage_balance}")
        if self.max_stage_bytes < 0:
            raise ConfigError(f"max_stage_bytes must be >= 0, got {self.max_stage_bytes}")
        if self.pp < 1 or self.dp < 0:
            raise ConfigError(f"pp must be >= 1 and dp >= 0, got pp={self.pp} dp={self.dp}")
        layers = self.model.n_layer + 2  # embedding, blocks, head (a module's: at load)
        if self.model.source == "gpt" and self.pp > layers:
            raise ConfigError(
                f"pp={self.pp} stages but the model has only {layers} layers "
                f"(embedding + {self.model.n_layer} blocks + head)"
            )
        start = self.elastic.nproc_per_node * self.elastic.nnodes_range[0]
        if self.pp > 1 and start % self.pp:
            raise ConfigError(f"{start} starting workers cannot be cut into pp={self.pp} stages")
        if self.dp and self.dp * self.pp != start:
            raise ConfigError(
                f"dp × pp = {self.dp} × {self.pp} = {self.dp * self.pp}, "
                f"but the job starts with {start} workers"
            )

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.job_id

    @property
    def resolved_durable_dir(self) -> Path:
        return Path(self.durable_dir) if self.durable_dir else self.resolved_run_dir / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["faults"] = [f.to_dict() for f in self.faults]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobConfig:
        """Build from a plain mapping (YAML/JSON); unknown keys are errors."""
        return build(cls, dict(data), "")


# ``elaswave launch``'s flags: the parameter's name -> the config key it sets. The one place
# they meet the schema: ``schema_type`` checks every key (a unit test does, for every flag).
LAUNCH_FLAGS: dict[str, str] = {
    "job_id": "job_id",
    "run_dir": "run_dir",
    "etcd": "etcd",
    "etcd_port": "etcd_port",
    "metrics_port": "metrics_port",
    "etcd_cacert": "etcd_tls.cacert",
    "etcd_cert": "etcd_tls.cert",
    "etcd_key": "etcd_tls.key",
    "etcd_server_cert": "etcd_tls.server_cert",
    "etcd_server_key": "etcd_tls.server_key",
    "host_id": "host_id",
    "rack": "rack",
    "nproc_per_node": "elastic.nproc_per_node",
    "device": "train.device",
    "workers_per_device": "elastic.workers_per_device",
    "nnodes": "elastic.nnodes",
    "max_restarts": "elastic.max_restarts",
    "spares": "elastic.spares",
    "straggler_threshold": "elastic.straggler_threshold",
    "loop_breaker": "elastic.loop_breaker",
    "script": "script",  # made absolute by launch (workers may start elsewhere)
    "steps": "train.steps",
    "global_batch": "train.global_batch",
    "micro_batch_size": "train.micro_batch_size",
    "hang_timeout": "timeouts.hang",
    "preempt_signal": "elastic.preempt_signal",
    "preempt_grace": "timeouts.preempt_grace",
    "zero": "zero",
    "pp": "pp",
    "dp": "dp",
    "migration": "migration",
    "stage_loss": "stage_loss",
    "dvfs": "dvfs",
    "verify_every": "verify_every",
    "replay_every": "replay_every",
    "snapshot_every": "snapshot_every",
    "durable_every": "durable_every",
    "durable_dir": "durable_dir",
    "resume": "resume",
    "fresh": "fresh",
    "tensorboard": "logging.tensorboard",
}


def schema_type(dotted: str) -> Any:
    """The type the config schema gives ``dotted`` (``train.steps``); KeyError if it has none."""
    tp: Any = JobConfig
    for part in dotted.split("."):
        if not (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
            raise KeyError(dotted)
        hints = typing.get_type_hints(tp)
        if part not in hints:
            raise KeyError(dotted)
        tp = hints[part]
    return tp
