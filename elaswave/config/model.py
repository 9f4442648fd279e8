"""What is trained: the model (built-in GPT, a user factory, a Hugging Face causal LM) and the data
it reads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from elaswave.config.schema import positive
from elaswave.errors import ConfigError


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
            positive(f"model.{name}", getattr(self, name))
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
        positive("data.num_samples", self.num_samples)
        if self.eval_samples < 0:
            raise ConfigError(f"data.eval_samples must be >= 0, got {self.eval_samples}")
