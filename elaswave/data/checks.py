"""What ``launch`` checks of a job's data before anything starts, without building the model:
a token file it cannot train on (missing, too short, an id past a vocabulary the config states)
and held-out samples that leave none to train on. What needs the model itself (the vocabulary
of a pretrained Hugging Face model, a user workload's own data set) is checked by
:func:`~elaswave.runtime.workload.load.check_data` in the worker template, before any worker
starts."""

from __future__ import annotations

from elaswave.config import JobConfig
from elaswave.data.tokens import TokenArray, check_token_file
from elaswave.errors import ConfigError

__all__ = ["check_before_start", "stated_vocab_size"]


def stated_vocab_size(cfg: JobConfig) -> int | None:
    """The model's vocabulary size where the config states it (the built-in GPT's, an HF
    config's ``vocab_size``); None where only the model knows it. Pure."""
    m = cfg.model
    if m.source == "gpt":
        return m.vocab_size
    if m.source == "hf" and m.hf.get("vocab_size") is not None:
        return int(m.hf["vocab_size"])
    return None


def check_before_start(cfg: JobConfig) -> None:
    """One-line :class:`ConfigError` for data the job cannot train on, found from the config
    and the files alone."""
    d = cfg.data
    if d.source != "tokens" or d.path is None or cfg.model.source == "module":
        return  # synthetic sizes are checked with the config; a module's data is its own
    try:
        check_token_file(
            d.path, seq_len=cfg.model.seq_len, dtype=d.dtype, vocab_size=stated_vocab_size(cfg)
        )
        samples = TokenArray(d.path, seq_len=cfg.model.seq_len, dtype=d.dtype).num_samples
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data: {str(exc).splitlines()[0]}") from None
    if d.eval_samples >= samples:
        raise ConfigError(
            f"data: data.eval_samples ({d.eval_samples}) leaves none of the data set's "
            f"{samples} samples for training"
        )
