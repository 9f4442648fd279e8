"""From a job config to its workload: the built-in GPT, a Hugging Face causal LM, a user
factory's Workload, or any nn.Module (the user's, torchvision's, timm's) cut into layers."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from elaswave.config import JobConfig
from elaswave.config.model import BY_NAME, PLAIN_DATA
from elaswave.data.tokens import check_token_file
from elaswave.errors import ConfigError, one_line
from elaswave.runtime.workload.base import KeyedLayers, Workload, build_layers
from elaswave.runtime.workload.gpt import GPTConfig, GPTWorkload
from elaswave.runtime.workload.plaindata import resolve

__all__ = ["build_model", "load_workload", "resolve_factory"]


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"``, importable from the current
    directory too (as ``python -m`` does)."""
    return resolve(spec, "model.factory")


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
    if m.source == "hf":
        workload = _hf_workload(cfg)
    elif m.source in BY_NAME:
        workload = _plain(cfg, _by_name(cfg), f"{m.source} model {m.name!r}")
    else:
        workload = _factory_workload(cfg)
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
        raise ConfigError(f"model.factory {m.factory!r} failed: {one_line(exc)}") from None
    if isinstance(workload, nn.Module):
        return _plain(cfg, lambda: factory(**m.args), f"model.factory {m.factory!r}")
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"model.factory {m.factory!r} returned {type(workload).__name__}, not a Workload "
            "or an nn.Module"
        )
    if m.split != ["auto"] or m.pretrained is not None:
        key = "model.split" if m.split != ["auto"] else "model.pretrained"
        raise ConfigError(f"{key}: model.factory {m.factory!r} returned a Workload, which "
                          "cuts and loads its model itself")  # fmt: skip
    if cfg.data.source in PLAIN_DATA:
        raise ConfigError(f"data.source {cfg.data.source}: model.factory {m.factory!r} returned "
                          "a Workload, which has its own data set")  # fmt: skip
    if workload.num_layers < 1:
        raise ConfigError(f"model.factory {m.factory!r}: the workload has no layers")
    return workload


def _plain(cfg: JobConfig, build: Callable[[], nn.Module], what: str) -> Workload:
    """A plain module's workload: its data, collate and loss from the config."""
    from elaswave.runtime.workload.module import ModuleWorkload
    from elaswave.runtime.workload.plaindata import make_collate, make_data, make_loss

    return ModuleWorkload(
        build, data=make_data(cfg), collate=make_collate(cfg), loss=make_loss(cfg),
        split=cfg.model.split, seed=cfg.train.seed, pretrained=cfg.model.pretrained, what=what,
    )  # fmt: skip


def _by_name(cfg: JobConfig) -> Callable[[], nn.Module]:
    """``model.source: torchvision | timm``: the model builder of ``model.name`` with
    ``model.args``, random init (nothing downloads)."""
    m = cfg.model
    name, args = str(m.name), dict(m.args)
    try:
        lib = importlib.import_module(m.source)
    except Exception as exc:  # noqa: BLE001 - missing, or a build that does not fit torch
        raise ConfigError(
            f"model.source: {m.source} needs {m.source} ({one_line(exc)}): "
            "pip install 'elaswave[vision]'"
        ) from None
    if m.source == "torchvision":
        known = set(lib.models.list_models())
        if name not in known:
            raise ConfigError(f"model.name {name!r}: torchvision has no such model")
        return lambda: lib.models.get_model(name, weights=None, **args)
    if not lib.is_model(name):
        raise ConfigError(f"model.name {name!r}: timm has no such model")
    return lambda: lib.create_model(name, pretrained=False, **args)


def check_data(cfg: JobConfig, workload: Workload) -> None:
    """Before any worker starts: a token file (given, or made from text) the model cannot
    train on (see :func:`check_token_file`; the vocabulary is the workload's ``vocab_size``
    where it has one: the built-in GPT, HF models), or held-out samples that leave none to
    train on, is a config error. A ``module`` workload's data is its own: only the held-out
    count is checked."""
    from elaswave.runtime.optimizers import optimizer_classes

    optimizer_classes(cfg, whole=True)  # an optimizer or scheduler that does not fit: one line
    d = cfg.data
    check = getattr(workload, "check", None)
    if callable(check):  # a plain module: one micro-batch through the model and the loss
        check()
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
            raise ConfigError(f"data: the workload's data set: {one_line(exc)}") from None
        if d.eval_samples >= samples:
            raise ConfigError(
                f"data: data.eval_samples ({d.eval_samples}) leaves none of the data set's "
                f"{samples} samples for training"
            )


def build_model(cfg: JobConfig) -> KeyedLayers:
    """The job's whole model on one rank: every layer of its workload, in order."""
    return build_layers(load_workload(cfg), cfg.train.seed)
