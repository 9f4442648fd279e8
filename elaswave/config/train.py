"""How it is trained: the optimisation problem, its numerics and the device it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from elaswave.config.prune import PruneConfig
from elaswave.config.schema import CLASS, FUNCTION, positive
from elaswave.errors import ConfigError

LOSSES = ("cross_entropy", "mse")  # train.loss's built-in losses

# Where workers compute (``train.device``); the runtime resolves ``auto`` on each host.
Device = Literal["auto", "cpu", "cuda", "npu"]
DEVICE_KINDS: tuple[Device, ...] = get_args(Device)

# The values of the other fixed-choice fields (each checked by TrainConfig.__post_init__).
Autocast = Literal["off", "bf16"]
ReduceDtype = Literal["float32", "float64"]
Hierarchy = Literal["auto", "flat"]
GradCompress = Literal["off", "int8"]
Hpz = Literal["auto", "off"]
Zero3Gather = Literal["flat", "tiers"]
ShardScope = Literal["job", "host"]
NonFinite = Literal["skip", "stop"]
Rng = Literal["sample", "rank"]
Batch = Literal["fixed", "shrink"]


@dataclass(kw_only=True)
class ParamGroup:
    """Parameters whose global name (``layers.<index>.<name>``) matches one of ``params``
    (shell-style globs) get this weight decay; the first matching group wins."""

    params: list[str]
    """Shell-style globs over global parameter names (``layers.<index>.<name>``); at least one."""
    weight_decay: float
    """The weight decay of the parameters that match (>= 0)."""

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
    """Committed steps to train (> 0)."""
    global_batch: int = 32
    """Samples per step, whatever the world size (a multiple of ``micro_batch_size``)."""
    micro_batch_size: int = 2
    """Samples per micro-batch, the unit of work spread over the ranks."""
    lr: float = 3e-3
    """The learning rate (> 0): a constant schedule's, the peak of a cosine one."""
    lr_schedule: str = "constant"
    """constant | cosine | a dotted class. The learning rate of step s is a pure function of s (a
    redone step gets the same one): constant, or linear warmup over warmup_steps then cosine
    decay to min_lr at the last step; or a torch.optim.lr_scheduler class (e.g.
    torch.optim.lr_scheduler.OneCycleLR) with lr_schedule_args, stepped once per committed step
    (replayed: elaswave.runtime.optimizers)."""
    lr_schedule_args: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments of a scheduler class (lr_schedule a class only)."""
    warmup_steps: int = 0
    """constant and cosine: steps of linear warmup to lr (0: none)."""
    min_lr: float = 0.0
    """cosine: the learning rate at the last step (in [0, lr])."""
    grad_clip: float = 0.0
    """Gradient clipping by the global norm of the batch's mean gradient over the whole model
    (every replica and stage see the same reduced gradient, so the same factor); 0: off."""
    optimizer: str = "adamw"
    """adamw | sgd (with momentum, as torch.optim.SGD) | a dotted torch.optim.Optimizer class
    (torch.optim.RMSprop, a user's class) with optimizer_args: element-wise ones, whose state
    is at most two tensors shaped like the parameter (checked by running it at launch)."""
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments of an optimizer class (optimizer a class only)."""
    loss: str = "cross_entropy"
    """A plain module's loss (a Workload has its own): cross_entropy, mse (squared error summed
    over every element, counted per element: torch's mean), or "package.module:function",
    fn(output, target) -> (sum over the micro-batch, how many terms it counts)."""
    momentum: float = 0.9
    """sgd only: the momentum (in [0, 1))."""
    weight_decay: float = 0.0
    """AdamW: decoupled; SGD: L2 added to the gradient. By default biases, norm scales and
    positional tables get none; param_groups set it by parameter name (first match wins)."""
    param_groups: list[ParamGroup] = field(default_factory=list)
    """Weight decay by parameter name (adamw and sgd): the first group that matches wins."""
    beta1: float = 0.9
    """AdamW: the decay of the first moment (the gradient's running mean)."""
    beta2: float = 0.95
    """AdamW: the decay of the second moment (the squared gradient's running mean)."""
    eps: float = 1e-8
    """AdamW: added to the second moment's root in the denominator."""
    seed: int = 1234
    """Seeds the model's initial parameters, the micro-batches' samples and their randomness
    (dropout): the same for every membership."""
    save_final: bool = True
    """Keep the final state (a durable checkpoint of the last step, written by rank 0 once the
    job ends) so that ``elaswave export`` can write the trained model without checkpoints
    every K steps."""
    autocast: Autocast = "off"
    """bf16: layers run under torch.autocast(bfloat16); parameters, gradients, the reduction and
    the optimizer state stay float32 (or the reduce_dtype). off: float32 throughout."""
    eval_every: int = 0
    """Every eval_every committed steps, the loss on the held-out samples (data.eval_samples) is
    a metrics.jsonl line of its own ({"kind": "eval", "step", "eval_loss", ...}); 0: never."""
    reduce_dtype: ReduceDtype = "float32"
    """Gradients are accumulated and reduced in this dtype. float32 (default) keeps losses within
    ~1e-7 of the fault-free run after a resize; float64 is the deterministic mode: the sum no
    longer depends on how micro-batches are spread over ranks, so losses and parameters are
    bit-identical to the fault-free run, at ~10% step time on CPU (twice the reduced bytes)."""
    hierarchy: Hierarchy = "auto"
    """The gradient's all-reduce (data parallelism; ZeRO-1 on gloo): "auto" goes by tiers when the
    plan spans two hosts or more and some host has two ranks (summed inside each host, one rank
    per host and lane between them, shared back inside the host); "flat": one ring over all."""
    grad_compress: GradCompress = "off"
    """The inter-host hop of that reduction as block-wise int8 (one scale per 256 values: ~1/4
    of float32's bytes between hosts, 1/8 of float64's); the sum inside each host stays in
    full precision and every rank still gets the same bits. Changes the sums (each host's part
    rounded to half a step per value): off (default) or int8. Needs hierarchy auto; data
    parallelism, replicated or ZeRO-1 or ZeRO-3 (not pipelines)."""
    hpz: Hpz = "auto"
    """ZeRO-3's hpZ: "auto" keeps, from each layer's forward gather, a secondary partition of it
    over the host's ranks (1/k of the layer each, held until its backward), so the backward
    gather stays inside the host; used when the gradient goes by tiers and every host of the
    plan has two ranks or more (a lone rank would hold whole layers). "off": every gather
    goes over every rank."""
    zero3_gather: Zero3Gather = "flat"
    """ZeRO-3's forward gather of each layer: "flat" (one ring over every rank, posted ahead so it
    overlaps the layer before) or "tiers" (each host's parts gathered inside the host, each lane
    between the hosts, shared back: fewer bytes between hosts, but a chain of collectives on the
    computing thread, not overlapped). Where the plan has tiers."""
    shard_scope: ShardScope = "job"
    """ZeRO-3's shards: over every data-parallel rank ("job"), or over the ranks of each host,
    every host holding the whole model ("host": hybrid sharding, FSDP's HSDP): each layer's
    gathers stay inside the host, only the gradient's reduction crosses hosts, and a worker
    lost on one host is rebuilt from the same elements on another (no snapshots kept). Needs
    zero: 3."""
    partial_redo: bool = True
    """A fault in the middle of a step: survivors keep the micro-batches they finished and only
    the lost ones are computed again (data parallelism and ZeRO-1; pipelines redo the step).
    false: the whole step is redone (for comparisons)."""
    nonfinite: NonFinite = "skip"
    """A step whose reduced loss or gradient is not finite (NaN or Inf: bad data, an overflow) is
    never applied, on any rank: every rank sees the same reduced values, so every rank decides
    alike. skip (default): the step counts (its number, learning rate and samples are spent) and
    training goes on with the next step's samples; stop: the job stops with one line. Every
    mode, pipelines too (a migration under way skips the step's gradient as well)."""
    nonfinite_limit: int = 5
    """skip: this many non-finite steps in a row are skipped; the next one stops the job."""
    skip_steps: list[int] = field(default_factory=list)
    """Steps whose samples are drawn but never trained on (known-bad data, a loss spike to step
    over): each is computed and reduced like any step, then not applied, exactly as a
    non-finite step is skipped."""
    rng: Rng = "sample"
    """What a layer's random numbers (dropout) are keyed by: "sample" (default) keys them by
    (seed, step, micro-batch, layer), so that a sample draws the same mask on whichever rank
    computes it, in any world. "rank" keys them by the computing rank and the micro-batch's
    place among that rank's: what a training loop that seeds each rank gets, where a change of
    world changes the masks. An ablation switch (``bench convergence``), for data parallelism's
    whole-model path (replicated, ZeRO-1) only."""
    batch: Batch = "fixed"
    """"fixed" (default): every step trains ``global_batch`` samples whatever the world.
    "shrink": each rank keeps its share of the full world's micro-batches, and a smaller world
    trains fewer of them (the gradient is their mean): what replica-dropping systems such as
    TorchFT do. An ablation switch (``bench convergence``), for data parallelism without
    ``partial_redo`` (a survivor's kept micro-batches may fall outside the smaller batch)."""
    prune: PruneConfig | None = None
    """Structured pruning while training (OTOv2's DHSPG or OTOv3's HESSO; see
    elaswave.config.prune): None: off."""
    threads_per_worker: int = 1
    """torch's intra-op threads in each worker process (torch.set_num_threads)."""
    device: Device = "auto"
    """Where workers compute: auto (an accelerator when the host has one, else the CPU), cpu,
    cuda (NCCL) or npu (HCCL, through torch_npu). One worker per device, pinned by its slot."""
    device_time: float = 0.0
    """Emulated accelerator seconds per micro-batch (forward + backward through the whole model):
    each worker sleeps its share, so that N workers on fewer cores behave like N devices.
    For benchmarks of post-change throughput on small machines; 0 (default) = off."""
    state_bandwidth: float = 0.0
    """Emulated bandwidth (MB/s) of the links that pipeline layer state migrates over: a receiver
    waits bytes / bandwidth after its copy lands, as if moving a large model's state over a
    real link. For benchmarks of migration MTTR on small machines; 0 (default) = off."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch_size", "threads_per_worker"):
            positive(f"train.{name}", getattr(self, name))
        if self.global_batch % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch ({self.global_batch}) must be a multiple of "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        if self.hierarchy not in get_args(Hierarchy):
            raise ConfigError(f"train.hierarchy must be auto or flat, got {self.hierarchy!r}")
        if self.hpz not in get_args(Hpz):
            raise ConfigError(f"train.hpz must be auto or off, got {self.hpz!r}")
        if self.shard_scope not in get_args(ShardScope):
            raise ConfigError(f"train.shard_scope must be job or host, got {self.shard_scope!r}")
        if self.zero3_gather not in get_args(Zero3Gather):
            raise ConfigError(
                f"train.zero3_gather must be flat or tiers, got {self.zero3_gather!r}"
            )
        if self.grad_compress not in get_args(GradCompress):
            raise ConfigError(
                f"train.grad_compress must be off or int8, got {self.grad_compress!r}"
            )
        if self.grad_compress == "int8" and self.hierarchy == "flat":
            raise ConfigError(
                "train.grad_compress int8 compresses the hop between hosts of the reduction by "
                "tiers: it needs train.hierarchy auto, not flat"
            )
        if self.reduce_dtype not in get_args(ReduceDtype):
            raise ConfigError(
                f"train.reduce_dtype must be float32 or float64, got {self.reduce_dtype!r}"
            )
        for name in ("device_time", "state_bandwidth"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:  # also rejects NaN
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine") and not CLASS.fullmatch(self.lr_schedule):
            raise ConfigError(
                "train.lr_schedule must be constant, cosine or a dotted class name, got "
                f"{self.lr_schedule!r}"
            )
        if self.lr_schedule_args and self.lr_schedule in ("constant", "cosine"):
            raise ConfigError("train.lr_schedule_args needs train.lr_schedule: a scheduler class")
        if self.warmup_steps and self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(
                "train.warmup_steps: a scheduler class schedules the warm-up itself "
                "(e.g. OneCycleLR's pct_start)"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr <= self.lr:  # also rejects NaN
            raise ConfigError(f"train.min_lr must be in [0, train.lr], got {self.min_lr}")
        if self.autocast not in get_args(Autocast):
            raise ConfigError(f"train.autocast must be off or bf16, got {self.autocast!r}")
        if self.device not in DEVICE_KINDS:
            choices = ", ".join(DEVICE_KINDS)
            raise ConfigError(f"train.device must be one of {choices}, got {self.device!r}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every}")
        if self.loss not in LOSSES and not FUNCTION.fullmatch(self.loss):
            raise ConfigError(
                "train.loss must be cross_entropy, mse or 'package.module:function', "
                f"got {self.loss!r}"
            )
        if self.optimizer not in ("adamw", "sgd") and not CLASS.fullmatch(self.optimizer):
            raise ConfigError(
                "train.optimizer must be adamw, sgd or a dotted class name (torch.optim.RMSprop), "
                f"got {self.optimizer!r}"
            )
        if self.optimizer in ("adamw", "sgd") and self.optimizer_args:
            raise ConfigError("train.optimizer_args needs train.optimizer: an optimizer class")
        if self.optimizer not in ("adamw", "sgd"):
            if self.weight_decay or self.param_groups:
                raise ConfigError(
                    "train.weight_decay and train.param_groups are for adamw and sgd: give an "
                    "optimizer class its weight_decay in train.optimizer_args"
                )
            if self.prune is not None:
                raise ConfigError("train.prune runs on adamw or sgd, not an optimizer class")
        if not 0 <= self.momentum < 1:  # also rejects NaN
            raise ConfigError(f"train.momentum must be in [0, 1), got {self.momentum}")
        if not self.weight_decay >= 0:  # also rejects NaN
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if len({g.weight_decay for g in self.param_groups} | {self.weight_decay, 0.0}) > 255:
            raise ConfigError("train.param_groups: at most 253 distinct weight decays")
        if not self.grad_clip >= 0:  # also rejects NaN
            raise ConfigError(f"train.grad_clip must be >= 0 (0: off), got {self.grad_clip}")
        if self.nonfinite not in get_args(NonFinite):
            raise ConfigError(f"train.nonfinite must be skip or stop, got {self.nonfinite!r}")
        positive("train.nonfinite_limit", self.nonfinite_limit)
        if self.rng not in get_args(Rng):
            raise ConfigError(f"train.rng must be sample or rank, got {self.rng!r}")
        if self.batch not in get_args(Batch):
            raise ConfigError(f"train.batch must be fixed or shrink, got {self.batch!r}")
        if self.batch == "shrink" and self.partial_redo:
            raise ConfigError(
                "train.batch: shrink needs train.partial_redo: false (a survivor's kept "
                "micro-batches may fall outside the smaller batch)"
            )
        for s in self.skip_steps:
            if not 1 <= s <= self.steps:
                raise ConfigError(
                    f"train.skip_steps: each must be a step in [1, train.steps={self.steps}], "
                    f"got {s!r}"
                )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch_size
