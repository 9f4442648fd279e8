"""Typed job configuration and its one loader.

Precedence, lowest to highest: dataclass defaults < YAML file < ``ELASWAVE_*`` environment <
command-line flags. Environment names are ``ELASWAVE_<SECTION>__<FIELD>`` for section fields
(``ELASWAVE_TRAIN__STEPS=40``) and ``ELASWAVE_<FIELD>`` for top-level ones (``ELASWAVE_JOB_ID``).
This module is the only place that reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elaswave.errors import ConfigError, FaultSpecError
from elaswave.faults import FaultKind, FaultSpec
from elaswave.runtime.device import DEVICE_KINDS

ENV_PREFIX = "ELASWAVE_"


@dataclass(kw_only=True)
class ModelConfig:
    """The workload. ``source: gpt`` (default) is the built-in GPT, shaped by the fields below;
    ``source: module`` calls ``factory`` (``"package.module:function"``) with ``args`` and trains
    the :class:`~elaswave.Workload` it returns; ``source: hf`` trains a Hugging Face causal LM
    (needs transformers) on ``seq_len`` tokens, either a new one from ``hf`` (an HF config, with
    its ``model_type``) or one to fine-tune from ``pretrained`` (a ``save_pretrained``
    directory)."""

    source: str = "gpt"  # "gpt" | "module" | "hf"
    factory: str | None = None  # source=module: "package.module:function"
    args: dict[str, Any] = field(default_factory=dict)  # source=module: the factory's arguments
    hf: dict[str, Any] = field(default_factory=dict)  # source=hf: AutoConfig.for_model(**hf)
    pretrained: str | None = None  # source=hf: a local save_pretrained directory
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.source not in ("gpt", "module", "hf"):
            raise ConfigError(
                f"model.source must be 'gpt' or 'module' or 'hf', got {self.source!r}"
            )
        if self.source == "module" and not _FACTORY.fullmatch(self.factory or ""):
            raise ConfigError(
                "model.source=module needs model.factory as 'package.module:function', "
                f"got {self.factory!r}"
            )
        if self.source != "module" and (self.factory or self.args):
            raise ConfigError("model.factory and model.args need model.source: module")
        self._check_hf()
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _positive(f"model.{name}", getattr(self, name))
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    def _check_hf(self) -> None:
        if self.source != "hf":
            if self.hf or self.pretrained is not None:
                raise ConfigError("model.hf and model.pretrained need model.source: hf")
            return
        if bool(self.hf) == (self.pretrained is not None):
            raise ConfigError(
                "model.source: hf needs exactly one of model.hf (an HF config with its "
                "model_type) or model.pretrained (a save_pretrained directory)"
            )
        if self.hf and not self.hf.get("model_type"):
            raise ConfigError("model.hf needs a model_type key (e.g. llama, gpt2)")
        if self.pretrained is not None and not self.pretrained.strip():
            raise ConfigError("model.pretrained must be a directory, got an empty string")


_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from. ``synthetic`` is seeded and needs no files."""

    source: str = "synthetic"  # "synthetic" | "tokens"
    path: str | None = None  # flat uint16/uint32 token file for source=tokens
    dtype: str = "uint16"
    num_samples: int = 8192  # synthetic data set size
    # Held out for evaluation (train.eval_every): the data set's last eval_samples samples,
    # which training never draws.
    eval_samples: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "tokens"):
            raise ConfigError(f"data.source must be 'synthetic' or 'tokens', got {self.source!r}")
        if self.source == "tokens" and not self.path:
            raise ConfigError("data.source=tokens needs data.path (a flat .bin token file)")
        if self.dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.dtype must be 'uint16' or 'uint32', got {self.dtype!r}")
        _positive("data.num_samples", self.num_samples)
        if self.eval_samples < 0:
            raise ConfigError(f"data.eval_samples must be >= 0, got {self.eval_samples}")


@dataclass(kw_only=True)
class ParamGroup:
    """Parameters whose global name (``layers.<index>.<name>``) matches one of ``params``
    (shell-style globs) get this weight decay; the first matching group wins."""

    params: list[str]
    weight_decay: float

    def __post_init__(self) -> None:
        if not self.params:
            raise ConfigError("train.param_groups: a group needs at least one params pattern")
        if not self.weight_decay >= 0:  # also rejects NaN
            raise ConfigError(
                f"train.param_groups: weight_decay must be >= 0, got {self.weight_decay}"
            )


@dataclass(kw_only=True)
class TrainConfig:
    """The optimisation problem. ``global_batch`` is fixed whatever the membership does."""

    steps: int = 40
    global_batch: int = 32
    micro_batch_size: int = 2
    lr: float = 3e-3
    # The learning rate of step s is a pure function of s (a redone step gets the same one):
    # constant, or linear warmup over warmup_steps then cosine decay to min_lr at the last step.
    lr_schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    # Gradient clipping by the global norm of the batch's mean gradient over the whole model
    # (every replica and stage see the same reduced gradient, so the same factor); 0: off.
    grad_clip: float = 0.0
    optimizer: str = "adamw"  # "adamw" | "sgd" (with momentum, as torch.optim.SGD)
    momentum: float = 0.9  # sgd only
    # AdamW: decoupled; SGD: L2 added to the gradient. By default biases, norm scales and
    # positional tables get none; param_groups set it by parameter name (first match wins).
    weight_decay: float = 0.0
    param_groups: list[ParamGroup] = field(default_factory=list)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 1234
    # Keep the final state (a durable checkpoint of the last step, written by rank 0 once the
    # job ends) so that ``elaswave export`` can write the trained model without checkpoints
    # every K steps.
    save_final: bool = True
    # bf16: layers run under torch.autocast(bfloat16); parameters, gradients, the reduction and
    # the optimizer state stay float32 (or the reduce_dtype). off: float32 throughout.
    autocast: str = "off"
    # Every eval_every committed steps, the loss on the held-out samples (data.eval_samples) is
    # a metrics.jsonl line of its own ({"kind": "eval", "step", "eval_loss", ...}); 0: never.
    eval_every: int = 0
    # Gradients are accumulated and reduced in this dtype. float32 (default) keeps losses within
    # ~1e-7 of the fault-free run after a resize; float64 is the deterministic mode: the sum no
    # longer depends on how micro-batches are spread over ranks, so losses and parameters are
    # bit-identical to the fault-free run, at ~10% step time on CPU (twice the reduced bytes).
    reduce_dtype: str = "float32"
    # A fault in the middle of a step: survivors keep the micro-batches they finished and only
    # the lost ones are computed again (data parallelism and ZeRO-1; pipelines redo the step).
    # false: the whole step is redone (for comparisons).
    partial_redo: bool = True
    threads_per_worker: int = 1
    # Where workers compute: auto (an accelerator when the host has one, else the CPU), cpu,
    # cuda (NCCL) or npu (HCCL, through torch_npu). One worker per device, pinned by its slot.
    device: str = "auto"
    # Emulated accelerator seconds per micro-batch (forward + backward through the whole model):
    # each worker sleeps its share, so that N workers on fewer cores behave like N devices.
    # For benchmarks of post-change throughput on small machines; 0 (default) = off.
    device_time: float = 0.0
    # Emulated bandwidth (MB/s) of the links that pipeline layer state migrates over: a receiver
    # waits bytes / bandwidth after its copy lands, as if moving a large model's state over a
    # real link. For benchmarks of migration MTTR on small machines; 0 (default) = off.
    state_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch_size", "threads_per_worker"):
            _positive(f"train.{name}", getattr(self, name))
        if self.global_batch % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch ({self.global_batch}) must be a multiple of "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        if self.reduce_dtype not in ("float32", "float64"):
            raise ConfigError(
                f"train.reduce_dtype must be float32 or float64, got {self.reduce_dtype!r}"
            )
        for name in ("device_time", "state_bandwidth"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:  # also rejects NaN
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(
                f"train.lr_schedule must be constant or cosine, got {self.lr_schedule!r}"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr <= self.lr:  # also rejects NaN
            raise ConfigError(f"train.min_lr must be in [0, train.lr], got {self.min_lr}")
        if self.autocast not in ("off", "bf16"):
            raise ConfigError(f"train.autocast must be off or bf16, got {self.autocast!r}")
        if self.device not in DEVICE_KINDS:
            choices = ", ".join(DEVICE_KINDS)
            raise ConfigError(f"train.device must be one of {choices}, got {self.device!r}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"train.optimizer must be adamw or sgd, got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:  # also rejects NaN
            raise ConfigError(f"train.momentum must be in [0, 1), got {self.momentum}")
        if not self.weight_decay >= 0:  # also rejects NaN
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if len({g.weight_decay for g in self.param_groups} | {self.weight_decay, 0.0}) > 255:
            raise ConfigError("train.param_groups: at most 253 distinct weight decays")
        if not self.grad_clip >= 0:  # also rejects NaN
            raise ConfigError(f"train.grad_clip must be >= 0 (0: off), got {self.grad_clip}")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch_size


@dataclass(kw_only=True)
class ElasticConfig:
    """Membership: how many workers, how many hosts, and the respawn policy."""

    nproc_per_node: int = 4
    nnodes: str = "1:1"  # MIN:MAX hosts; a single number means MIN=MAX
    max_restarts: int = 0  # respawns of crashed workers per host (0 = continue without them)
    min_workers: int = 1  # below this many live workers the job stops
    # A rank whose compute time per micro-batch exceeds this multiple of the median rank's is
    # evicted (0: never evict; slower ranks still get fewer micro-batches).
    straggler_threshold: float = 3.0
    # Stop the whole job after this many worker failures in a row without a new committed step
    # (0: never).
    loop_breaker: int = 5

    def __post_init__(self) -> None:
        _positive("elastic.nproc_per_node", self.nproc_per_node)
        _positive("elastic.min_workers", self.min_workers)
        if self.max_restarts < 0:
            raise ConfigError(f"elastic.max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.straggler_threshold == 0 or 1 < self.straggler_threshold < float("inf")):
            raise ConfigError(
                "elastic.straggler_threshold must be 0 (off) or a finite number > 1, "
                f"got {self.straggler_threshold}"
            )
        if self.loop_breaker < 0:
            raise ConfigError(f"elastic.loop_breaker must be >= 0, got {self.loop_breaker}")
        self.nnodes_range  # validates  # noqa: B018

    @property
    def nnodes_range(self) -> tuple[int, int]:
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(self.nnodes))
        if not m:
            raise ConfigError(f"elastic.nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if lo < 1 or hi < lo:
            raise ConfigError(f"elastic.nnodes needs 1 <= MIN <= MAX, got {self.nnodes!r}")
        return lo, hi


@dataclass(kw_only=True)
class Timeouts:
    """Every blocking call's limit, in seconds. Tests shorten them; nothing waits forever."""

    etcd_connect: float = 5.0
    lease_ttl: int = 5  # host lease; a host silent this long is considered gone
    rendezvous: float = 60.0  # initial membership and each process-group build
    collective: float = 120.0  # one collective (a hang is caught earlier by the daemon)
    plan_wait: float = 60.0  # a worker waiting for the plan that follows an error
    shutdown_grace: float = 5.0  # SIGTERM -> SIGKILL
    heartbeat: float = 0.2  # worker → daemon heartbeat interval
    hang: float = 10.0  # no heartbeat, or one compute phase, for this long = hung: killed

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:  # also rejects NaN
                raise ConfigError(f"timeouts.{f.name} must be > 0, got {getattr(self, f.name)}")
        if self.hang < 2 * self.heartbeat:
            raise ConfigError(
                f"timeouts.hang ({self.hang:g}) must be at least twice timeouts.heartbeat "
                f"({self.heartbeat:g})"
            )


@dataclass(kw_only=True)
class EtcdTLSConfig:
    """TLS towards etcd: PEM file paths. User and password never live here: they come only from
    ``ELASWAVE_ETCD_USER`` / ``ELASWAVE_ETCD_PASSWORD`` (see :func:`etcd_credentials`)."""

    cacert: str | None = None  # CA that signed etcd's server certificate; set = TLS on
    cert: str | None = None  # client certificate (etcd --client-cert-auth), with ``key``
    key: str | None = None
    server_cert: str | None = None  # embedded etcd only: serve TLS with this certificate, with
    server_key: str | None = None  # ``server_key``; clients then need a cert signed by ``cacert``

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError(
                "etcd_tls: give the client cert and key together (--etcd-cert and --etcd-key)"
            )
        if bool(self.server_cert) != bool(self.server_key):
            raise ConfigError("etcd_tls: give server_cert and server_key together")
        if (self.cert or self.server_cert) and not self.cacert:
            raise ConfigError("etcd_tls: a certificate needs the CA too (--etcd-cacert)")
        if self.server_cert and not self.cert:
            raise ConfigError(
                "etcd_tls: an embedded etcd with TLS admits only client certificates; "
                "give --etcd-cert/--etcd-key for this host's daemon"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.cacert)


@dataclass(kw_only=True)
class JobConfig:
    """Everything a job needs. Build it with :func:`load_config`."""

    job_id: str = "elaswave"
    run_dir: str | None = None  # default runs/<job_id>
    etcd: list[str] = field(default_factory=list)  # empty: start an embedded etcd
    etcd_port: int = 0  # embedded etcd client port (0 = any free port)
    # Each daemon serves Prometheus metrics on this port (0: a free one, printed and recorded
    # in events.jsonl); None: no metrics server.
    metrics_port: int | None = None
    etcd_tls: EtcdTLSConfig = field(default_factory=EtcdTLSConfig)
    zero: int = 0  # 1: ZeRO-1, optimizer state sharded over the data-parallel ranks (with
    #                pp > 1: over each layer's holders, two live copies, no snapshots)
    pp: int = 1  # pipeline stages per replica (1: pure data parallelism)
    dp: int = 0  # data-parallel replicas (0: world / pp); dp × pp must be the starting world
    migration: str = "async"  # pipelines: layers of a lost stage move "async" or "blocking"
    stage_loss: str = "reshard"  # pipelines: "reshard" the replica, or "drop" it (TorchFT-like)
    grad_reduce: str = "holders"  # pipelines: each layer's gradient summed among its "holders",
    #                               or the whole model's over "all" ranks (for comparisons)
    dvfs: str = "off"  # pipelines: frequency actuator off | sim | nvml | npu
    layer_costs: str = "estimate"  # pipelines: partition by a FLOP "estimate", a start-up
    #                                "profile" of each layer's time (measured by every worker),
    #                                or "online": the profile, then times measured while training
    cost_every: int = 10  # layer_costs=online: workers report their layers' times every K steps
    verify_every: int = 10  # compare replicas' checksums every K committed steps (0: never)
    snapshot_every: int = 1  # ZeRO (pp = 1): replicate each shard (spread over the peers) every K
    #                          committed steps; a fault rolls back to the last snapshot step
    #                          (0: none; then a lost shard only comes back from a checkpoint)
    durable_every: int = 0  # torch.distributed.checkpoint every N committed steps (0: never)
    durable_dir: str | None = None  # default <run_dir>/checkpoints (shared storage across hosts)
    resume: str | None = None  # start from the newest durable checkpoint in this directory
    host_id: str | None = None  # default: hostname-pid
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    faults: list[FaultSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.job_id):
            raise ConfigError(f"job_id must be 1-64 of [A-Za-z0-9_.-], got {self.job_id!r}")
        if self.snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.durable_every < 0:
            raise ConfigError(f"durable_every must be >= 0, got {self.durable_every}")
        if self.cost_every < 1:
            raise ConfigError(f"cost_every must be >= 1, got {self.cost_every}")
        if self.verify_every < 0:
            raise ConfigError(f"verify_every must be >= 0, got {self.verify_every}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if self.zero not in (0, 1):
            raise ConfigError(f"zero must be 0 or 1, got {self.zero}")
        self._check_pipeline()
        if self.train.eval_every and not self.data.eval_samples:
            raise ConfigError("train.eval_every needs held-out samples: set data.eval_samples")
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

    def _check_pipeline(self) -> None:
        choices = {"migration": ("async", "blocking"), "stage_loss": ("reshard", "drop"),
                   "grad_reduce": ("holders", "all"),
                   "dvfs": ("off", "sim", "nvml", "npu"),
                   "layer_costs": ("estimate", "profile", "online")}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        needs = {"nvml": "pynvml", "npu": "torch_npu"}
        if self.dvfs in needs and importlib.util.find_spec(needs[self.dvfs]) is None:
            raise ConfigError(f"dvfs={self.dvfs} needs the {needs[self.dvfs]} package")
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
        return _build(cls, dict(data), "")


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
    "nproc_per_node": "elastic.nproc_per_node",
    "device": "train.device",
    "nnodes": "elastic.nnodes",
    "max_restarts": "elastic.max_restarts",
    "straggler_threshold": "elastic.straggler_threshold",
    "loop_breaker": "elastic.loop_breaker",
    "steps": "train.steps",
    "hang_timeout": "timeouts.hang",
    "zero": "zero",
    "pp": "pp",
    "dp": "dp",
    "migration": "migration",
    "stage_loss": "stage_loss",
    "dvfs": "dvfs",
    "verify_every": "verify_every",
    "snapshot_every": "snapshot_every",
    "durable_every": "durable_every",
    "durable_dir": "durable_dir",
    "resume": "resume",
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


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> JobConfig:
    """Defaults < YAML at ``path`` < ``ELASWAVE_*`` env < ``overrides`` (``train.steps``)."""
    return JobConfig.from_dict(config_values(path, overrides=overrides, env=env))


def config_values(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What :func:`load_config` builds the config from: the values the YAML, the environment
    and the overrides give (nested by section), without the defaults."""
    merged: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.load(p.read_text(), Loader=_YamlLoader) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({_first_line(exc)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        merged = loaded
    env = os.environ if env is None else env
    for key, raw in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in _NOT_CONFIG_ENV:
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(merged, dotted, yaml.load(raw, Loader=_YamlLoader) if raw else raw)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(merged, dotted, value)
    return merged


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without YAML 1.1 base-60 numbers, so ``nnodes: 1:2`` stays ``"1:2"``,
    and with only ``true``/``false`` as booleans (YAML 1.2), so ``autocast: off`` is ``"off"``."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and ":" in str(value) and tag.endswith((":int", ":float")):
            return "tag:yaml.org,2002:str"
        if kind is yaml.ScalarNode and tag.endswith(":bool") and value.lower() not in BOOLS:
            return "tag:yaml.org,2002:str"
        return tag


BOOLS = ("true", "false")


# Environment variables that are not config fields (read by :func:`state_dir` and
# :func:`etcd_credentials`).
_NOT_CONFIG_ENV = {"ELASWAVE_STATE_DIR", "ELASWAVE_ETCD_USER", "ELASWAVE_ETCD_PASSWORD"}


def etcd_credentials(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """etcd user and password from ``ELASWAVE_ETCD_USER`` / ``ELASWAVE_ETCD_PASSWORD``.

    Credentials come from the environment only, never from flags or YAML, so that they do not
    show up in ``ps``, shell history or a config file checked into a repository.
    """
    env = os.environ if env is None else env
    user = env.get("ELASWAVE_ETCD_USER") or None
    password = env.get("ELASWAVE_ETCD_PASSWORD") or None
    if user is None and password is None:
        return None
    if user is None or password is None:
        missing = "ELASWAVE_ETCD_USER" if user is None else "ELASWAVE_ETCD_PASSWORD"
        raise ConfigError(f"etcd credentials: {missing} is not set (set both or neither)")
    return user, password


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Per-user directory where running jobs leave their discovery files."""
    env = os.environ if env is None else env
    if env.get("ELASWAVE_STATE_DIR"):
        return Path(env["ELASWAVE_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "elaswave"


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = target
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {part!r} is not a section")
        node = child
    node[leaf] = value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {where + unknown[0]!r} (known: {', '.join(sorted(names))})"
        )
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"config key {where + missing[0]!r} is required")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], where + name)
    try:
        return cls(**kwargs)
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if tp is FaultSpec:
        if isinstance(value, FaultSpec):
            return value
        try:
            if isinstance(value, str):
                return FaultSpec.parse(value)
            if isinstance(value, dict):
                return FaultSpec.from_dict(value, source=f"fault spec {key}")
        except FaultSpecError as exc:
            raise ConfigError(str(exc)) from None
        raise ConfigError(f"config key {key!r} must be a fault spec")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a section (mapping)")
        return _build(tp, value, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping")
        return dict(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            sep = ";" if item_tp is FaultSpec else ","
            value = [v for v in value.split(sep) if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        try:
            number = tp(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"config key {key!r} must be a string")
        return str(value)
    return value


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
