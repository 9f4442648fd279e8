"""What is trained: the model (built-in GPT, a user factory, a Hugging Face causal LM) and the data
it reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Literal, get_args

from elaswave.config.schema import FUNCTION, positive
from elaswave.errors import ConfigError

# What ``model.source`` builds.
ModelSource = Literal["gpt", "module", "hf", "torchvision", "timm"]
SOURCES: tuple[ModelSource, ...] = get_args(ModelSource)
BY_NAME = ("torchvision", "timm")  # sources that build a model by its name


@dataclass(kw_only=True)
class ModelConfig:
    """The workload. ``source: gpt`` (default) is the built-in GPT, shaped by the fields below;
    ``source: module`` calls ``factory`` (``"package.module:function"``) with ``args`` and trains
    what it returns: a :class:`~elaswave.Workload`, or any ``nn.Module`` (then the data, the
    loss and the cut into layers come from the config: ``data.source: dataset | imagefolder``,
    ``train.loss``, ``split``); ``source: torchvision | timm`` builds the model ``name`` with
    ``args`` (random init, or ``pretrained``: a local state_dict file; nothing downloads);
    ``source: hf`` trains a Hugging Face causal LM (needs transformers) on ``seq_len`` tokens,
    either a new one from ``hf`` (an HF config, with its ``model_type``) or one to fine-tune
    from ``pretrained`` (a ``save_pretrained`` directory)."""

    source: ModelSource = "gpt"
    """gpt | module | hf | torchvision | timm (see above)."""
    factory: str | None = None
    """source=module: "package.module:function"."""
    args: dict[str, Any] = field(default_factory=dict)
    """source=module: the factory's arguments; torchvision/timm: the model builder's."""
    name: str | None = None
    """source=torchvision/timm: the model's name (resnet18, ...)."""
    split: list[str] = field(default_factory=lambda: ["auto"])
    """Where a plain module's layers start: ["auto"] (the top-level children in call order when
    the traced forward is a chain through them; one layer otherwise) or module names."""
    hf: dict[str, Any] = field(default_factory=dict)
    """source=hf: AutoConfig.for_model(**hf)."""
    pretrained: str | None = None
    """source=hf: a local save_pretrained directory; a plain module (module, torchvision, timm):
    a local state_dict file (torch.save or safetensors) its weights start from."""
    vocab_size: int = 256
    """source=gpt: the size of the token vocabulary."""
    seq_len: int = 64
    """source=gpt and hf: tokens per sample (the context length)."""
    n_layer: int = 2
    """source=gpt: transformer blocks."""
    n_head: int = 4
    """source=gpt: attention heads per block (dividing d_model)."""
    d_model: int = 128
    """source=gpt: the width of the residual stream."""
    dropout: float = 0.1
    """source=gpt: the dropout probability (in [0, 1))."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(
                f"model.source must be one of {', '.join(SOURCES)}, got {self.source!r}"
            )
        if self.source == "module" and not FUNCTION.fullmatch(self.factory or ""):
            raise ConfigError(
                "model.source=module needs model.factory as 'package.module:function', "
                f"got {self.factory!r}"
            )
        if self.source != "module" and self.factory:
            raise ConfigError("model.factory needs model.source: module")
        if self.source not in ("module", *BY_NAME) and self.args:
            raise ConfigError("model.args needs model.source: module, torchvision or timm")
        if self.source in BY_NAME and not (self.name or "").strip():
            raise ConfigError(f"model.source={self.source} needs model.name (e.g. resnet18)")
        if self.source not in BY_NAME and self.name is not None:
            raise ConfigError("model.name needs model.source: torchvision or timm")
        if not self.split or any(not s.strip() for s in self.split):
            raise ConfigError("model.split must be auto or a list of module names")
        if self.split != ["auto"] and self.source in ("gpt", "hf"):
            raise ConfigError("model.split cuts a plain module: it needs model.source: module, "
                              "torchvision or timm")  # fmt: skip
        if "auto" in self.split and self.split != ["auto"]:
            raise ConfigError("model.split: auto, or a list of module names, not both")
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
            if self.hf:
                raise ConfigError("model.hf needs model.source: hf")
            if self.pretrained is not None and self.source == "gpt":
                raise ConfigError(
                    "model.pretrained needs model.source: hf, module, torchvision or timm"
                )
            if self.pretrained is not None and not self.pretrained.strip():
                raise ConfigError("model.pretrained must be a file, got an empty string")
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


# Where ``data.source`` reads samples from.
DataSource = Literal["synthetic", "tokens", "text", "dataset", "imagefolder"]
DATA_SOURCES: tuple[DataSource, ...] = get_args(DataSource)
# The token file's element type (``data.dtype``).
TokenDtype = Literal["uint16", "uint32"]
PLAIN_DATA = ("dataset", "imagefolder")  # what a plain module trains on


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from. ``synthetic`` is seeded and needs no files; ``tokens`` reads a
    flat token file; ``text`` reads text files (``files``: globs of .txt, .jsonl, .parquet),
    which ``elaswave launch`` tokenizes once into a cached token file that the job then reads
    like ``tokens`` (:mod:`elaswave.data.text`)."""

    source: DataSource = "synthetic"
    """synthetic | tokens | text | dataset | imagefolder (see above)."""
    path: str | None = None
    """The flat token file the workers read: given for source=tokens; for source=text set by
    launch to the cached file the text was tokenized into (its name is the content key);
    source=imagefolder: a folder of one folder per class."""
    dtype: TokenDtype = "uint16"
    """The token file's; source=text: launch picks it from the vocabulary."""
    num_samples: int = 8192
    """Synthetic data set size."""
    eval_samples: int = 0
    """Held out for evaluation (train.eval_every): the data set's last eval_samples samples,
    which training never draws."""
    files: list[str] = field(default_factory=list)
    """source=text: globs of .txt/.jsonl/.parquet."""
    text_field: str = "text"
    """source=text: the JSON field / parquet column of each document."""
    tokenizer: str | None = None
    """source=text: a local tokenizer directory (save_pretrained); default: model.pretrained's
    tokenizer, else UTF-8 bytes (ids 0..255, end of document 256: vocab_size >= 257)."""
    cache_dir: str | None = None
    """source=text: token file cache (default: the user's cache)."""
    factory: str | None = None
    """source=dataset: "package.module:function" called with ``args``; it returns a map-style
    data set whose item i is (input, target): tensors, or nested tuples/dicts of them."""
    args: dict[str, Any] = field(default_factory=dict)
    """source=dataset: the factory's keyword arguments."""
    collate: str | None = None
    """source=dataset/imagefolder: "package.module:function" that makes a micro-batch of items
    (default: torch's default_collate)."""
    image_size: int = 224
    """source=imagefolder: images resized and center-cropped to this."""

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(
                f"data.source must be one of {', '.join(DATA_SOURCES)}, got {self.source!r}"
            )
        if self.source == "tokens" and not self.path:
            raise ConfigError("data.source=tokens needs data.path (a flat .bin token file)")
        if self.source == "imagefolder" and not self.path:
            raise ConfigError(
                "data.source=imagefolder needs data.path (a folder of one folder per class)"
            )
        if self.source == "dataset" and not FUNCTION.fullmatch(self.factory or ""):
            raise ConfigError(
                "data.source=dataset needs data.factory as 'package.module:function', "
                f"got {self.factory!r}"
            )
        if self.source != "dataset" and (self.factory or self.args):
            raise ConfigError("data.factory and data.args need data.source: dataset")
        if self.collate is not None and (
            self.source not in PLAIN_DATA or not FUNCTION.fullmatch(self.collate)
        ):
            raise ConfigError(
                "data.collate needs data.source: dataset or imagefolder and a "
                f"'package.module:function', got {self.collate!r}"
            )
        positive("data.image_size", self.image_size)
        if self.dtype not in get_args(TokenDtype):
            raise ConfigError(f"data.dtype must be 'uint16' or 'uint32', got {self.dtype!r}")
        positive("data.num_samples", self.num_samples)
        if self.eval_samples < 0:
            raise ConfigError(f"data.eval_samples must be >= 0, got {self.eval_samples}")
        self._check_text()

    def _check_text(self) -> None:
        if self.source != "text":
            given = [name for name in _TEXT_ONLY if getattr(self, name) != _TEXT_DEFAULTS[name]]
            if given:
                raise ConfigError(f"data.{given[0]} needs data.source: text")
            return
        if not self.files or not all(f.strip() for f in self.files):
            raise ConfigError(
                "data.source=text needs data.files: a list of globs of .txt, .jsonl or "
                ".parquet files"
            )
        if not self.text_field.strip():
            raise ConfigError("data.text_field must name a JSON field or parquet column")
        for name in ("tokenizer", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"data.{name} must be a directory, got an empty string")

    def agreed(self) -> dict[str, Any]:
        """What every host of a job must have the same of (compared as a host joins). For
        ``source: text`` the token file's name, its content key (the files' bytes, the text
        field, the tokenizer's files), stands for the inputs: hosts may reach the same files,
        tokenizer and cache under different paths and still train the same tokens."""
        values = dataclasses.asdict(self)
        if self.source == "text":
            for name in ("files", "tokenizer", "cache_dir"):
                del values[name]
            values["path"] = PurePath(self.path).name if self.path else None
        return values


# Fields that only data.source: text reads, and their defaults (set elsewhere: an error).
_TEXT_DEFAULTS: dict[str, Any] = {"files": [], "text_field": "text", "tokenizer": None,
                                  "cache_dir": None}  # fmt: skip
_TEXT_ONLY = tuple(_TEXT_DEFAULTS)
