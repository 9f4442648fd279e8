"""What ``launch`` checks of a job's data before anything starts, without building the model:
a token file it cannot train on (missing, too short, an id past a vocabulary known without the
model: :func:`~elaswave.data.text.model_vocab`)
and held-out samples that leave none to train on. What needs the model itself (the vocabulary
of a pretrained Hugging Face model, a user workload's own data set) is checked by
:func:`~elaswave.runtime.workload.load.check_data` in the worker template, before any worker
starts."""

from __future__ import annotations

from elaswave.config import JobConfig
from elaswave.data.text import model_vocab
from elaswave.data.tokens import TokenArray, check_token_file
from elaswave.errors import ConfigError

__all__ = ["check_before_start"]


def check_before_start(cfg: JobConfig) -> None:
    """One-line :class:`ConfigError` for data the job cannot train on, found from the config
    and the files alone (``data.source: text`` once launch has tokenized it into a token
    file)."""
    d = cfg.data
    if d.source not in ("tokens", "text") or d.path is None or cfg.model.source == "module":
        return  # synthetic sizes are checked with the config; a module's data is its own
    try:
        check_token_file(
            d.path, seq_len=cfg.model.seq_len, dtype=d.dtype, vocab_size=model_vocab(cfg.model)
        )
        samples = TokenArray(d.path, seq_len=cfg.model.seq_len, dtype=d.dtype).num_samples
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data: {str(exc).splitlines()[0]}") from None
    if d.eval_samples >= samples:
        raise ConfigError(
            f"data: data.eval_samples ({d.eval_samples}) leaves none of the data set's "
            f"{samples} samples for training"
        )
