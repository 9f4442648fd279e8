"""From a job config to its workload: the built-in GPT, a Hugging Face causal LM, or a user
factory."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from elaswave.config import JobConfig
from elaswave.data.tokens import check_token_file
from elaswave.errors import ConfigError
from elaswave.runtime.workload.base import KeyedLayers, Workload, build_layers
from elaswave.runtime.workload.gpt import GPTConfig, GPTWorkload

__all__ = ["build_model", "load_workload", "resolve_factory"]


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"``, importable from the current
    directory too (as ``python -m`` does)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model.factory {spec!r}: cannot import {module_name!r} ({exc})"
        ) from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"model.factory {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ConfigError(f"model.factory {spec!r}: {attr!r} is not callable")
    return target


def load_workload(cfg: JobConfig) -> Workload:
    """The job's workload; a factory that fails or returns something else is a config error."""
    m = cfg.model
    if m.source == "gpt":
        gpt = GPTConfig(
            vocab_size=m.vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
            d_model=m.d_model, dropout=m.dropout,
        )  # fmt: skip
        d = cfg.data
        return GPTWorkload(
            gpt, data_source=d.source, data_path=d.path, data_dtype=d.dtype,
            num_samples=d.num_samples,
        )  # fmt: skip
    workload = _hf_workload(cfg) if m.source == "hf" else _factory_workload(cfg)
    if cfg.pp > workload.num_layers:
        raise ConfigError(
            f"pp={cfg.pp} stages but the workload has only {workload.num_layers} layers"
        )
    return workload


def _hf_workload(cfg: JobConfig) -> Workload:
    """``model.source: hf``: a Hugging Face causal LM. Its module imports transformers, an
    optional dependency, so it is imported only here."""
    from elaswave.runtime.workload.hf import HFCausalLM

    m, d = cfg.model, cfg.data
    return HFCausalLM(
        hf=m.hf or None, pretrained=m.pretrained, seq_len=m.seq_len, data_source=d.source,
        data_path=d.path, data_dtype=d.dtype, num_samples=d.num_samples,
    )  # fmt: skip


def _factory_workload(cfg: JobConfig) -> Workload:
    """``model.source: module``: what the user's factory returns, checked to be a workload."""
    m = cfg.model
    assert m.factory is not None
    factory = resolve_factory(m.factory)
    try:
        workload = factory(**m.args)
    except Exception as exc:  # the user's code: its error, on one line
        raise ConfigError(f"model.factory {m.factory!r} failed: {_first_line(exc)}") from None
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"model.factory {m.factory!r} returned {type(workload).__name__}, not a Workload"
        )
    if workload.num_layers < 1:
        raise ConfigError(f"model.factory {m.factory!r}: the workload has no layers")
    return workload


def check_data(cfg: JobConfig, workload: Workload) -> None:
    """Before any worker starts: a token file (given, or made from text) the model cannot
    train on (see :func:`check_token_file`; the vocabulary is the workload's ``vocab_size``
    where it has one: the built-in GPT, HF models), or held-out samples that leave none to
    train on, is a config error. A ``module`` workload's data is its own: only the held-out
    count is checked."""
    d = cfg.data
    if d.source in ("tokens", "text") and d.path is not None and cfg.model.source != "module":
        vocab = getattr(workload, "vocab_size", None)
        try:
            check_token_file(d.path, seq_len=cfg.model.seq_len, dtype=d.dtype, vocab_size=vocab)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"data: {str(exc).splitlines()[0]}") from None
    if d.eval_samples:
        try:
            samples = len(workload.dataset(cfg.train.seed))
        except Exception as exc:  # the workload's own code: its error, on one line
            raise ConfigError(f"data: the workload's data set: {_first_line(exc)}") from None
        if d.eval_samples >= samples:
            raise ConfigError(
                f"data: data.eval_samples ({d.eval_samples}) leaves none of the data set's "
                f"{samples} samples for training"
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def build_model(cfg: JobConfig) -> KeyedLayers:
    """The job's whole model on one rank: every layer of its workload, in order."""
    return build_layers(load_workload(cfg), cfg.train.seed)
