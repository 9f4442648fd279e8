"""Hugging Face causal language models as a workload (``model.source: hf``).

The model is cut into the runtime's layers (embedding, one per decoder block, head) by
:mod:`elaswave.runtime.workload.hflayers`. Each layer is built alone: the full model is built
once on the ``meta`` device (no memory, no compute), and a layer deep-copies only its own
submodules from it, materialises them on the CPU and initialises them with the model's own
``_init_weights``, with the default generator seeded from (seed, layer), so its values are a
function of (seed, layer) alone on every rank. With ``model.pretrained`` the layer's parameters
are then read from the directory's safetensors files (only the tensors that layer needs).
Parameters keep their HF names under the layer module; :meth:`HFCausalLM.hf_names` maps them
back to the HF state-dict keys.

transformers is an optional dependency (``pip install 'elaswave[hf]'``): it is imported only
when this workload is constructed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.errors import ConfigError
from elaswave.runtime.workload.base import (
    INIT_STEP,
    Dataset,
    KeyedLayers,
    ParamRef,
    TensorSpec,
    Workload,
    layer_seed,
)
from elaswave.runtime.workload.data import SyntheticTokens, token_file
from elaswave.runtime.workload.hfgroups import hf_families
from elaswave.runtime.workload.hflayers import BlockLayer, EmbeddingLayer, HeadLayer, cut_hf_model
from elaswave.runtime.workload.resize import fit_shapes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["HFCausalLM"]

IGNORE_INDEX = -100  # labels with this value are not predicted, nor counted (HF's convention)
_MISSING = "model.source: hf needs transformers: pip install 'elaswave[hf]'"


def _transformers() -> Any:
    """The transformers package, or the one-line config error that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(_MISSING) from None
    return transformers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- init order and checkpoint files ---------------------------------------------------------------


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before parents, as transformers' ``initialize_weights`` visits modules (a parent's
    init may overwrite a child's: gpt2 rescales ``c_proj`` in its attention and MLP init)."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def _checkpoint_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (file headers only, no tensor data)."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            index.update((key, path) for key in f.keys())  # noqa: SIM118 (not a dict)
    if not index:
        raise ConfigError(
            f"model.pretrained {str(directory)!r} has no *.safetensors weights "
            "(write it with save_pretrained)"
        )
    return index


# -- the workload ----------------------------------------------------------------------------------


class HFCausalLM(Workload):
    """A transformers causal LM on token data (``model.source: hf``).

    Exactly one of ``hf`` (``AutoConfig.for_model(**hf)``, random init; needs ``model_type``)
    or ``pretrained`` (a local directory written by ``save_pretrained``: config.json and
    safetensors weights, to fine-tune). Samples are ``seq_len + 1`` tokens from the synthetic
    corpus or a token file; the model sees the first ``seq_len`` and predicts the next token at
    each position.
    """

    def __init__(
        self, *, hf: Mapping[str, Any] | None = None, pretrained: str | None = None,
        seq_len: int, data_source: str = "synthetic", data_path: str | None = None,
        data_dtype: str = "uint16", num_samples: int = 8192,
    ) -> None:  # fmt: skip
        transformers = _transformers()
        if (not hf) == (pretrained is None):
            raise ConfigError("model.source: hf needs exactly one of model.hf or model.pretrained")
        self.seq_len, self.num_samples = int(seq_len), num_samples
        self.data_source, self.data_path, self.data_dtype = data_source, data_path, data_dtype
        self.pretrained = None if pretrained is None else Path(pretrained)
        self.config = self._hf_config(transformers, dict(hf or {}))
        self._check_lengths()
        self._model = self._meta_model(transformers)
        self._parts, self._token, self._rotary = cut_hf_model(self._model)
        self._tied_to = self._find_tied()
        self._index = None if self.pretrained is None else _checkpoint_index(self.pretrained)

    def _hf_config(self, transformers: Any, hf: dict[str, Any]) -> Any:
        """The HF config: from ``model.hf`` or from the pretrained directory's config.json."""
        if self.pretrained is not None:
            if not self.pretrained.is_dir():
                raise ConfigError(f"model.pretrained {str(self.pretrained)!r} is not a directory")
            if not (self.pretrained / "config.json").is_file():
                raise ConfigError(
                    f"model.pretrained {str(self.pretrained)!r} has no config.json "
                    "(write it with save_pretrained)"
                )
            try:
                return transformers.AutoConfig.from_pretrained(
                    str(self.pretrained), local_files_only=True
                )
            except Exception as exc:  # a broken or unknown config.json: one line
                raise ConfigError(f"model.pretrained: {_first_line(exc)}") from None
        model_type = hf.pop("model_type", None)
        if model_type is None:
            raise ConfigError("model.hf needs a model_type key (e.g. llama, gpt2)")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(
                f"model.hf.model_type {model_type!r} is not a model type of transformers "
                f"{transformers.__version__}"
            )
        try:
            return transformers.AutoConfig.for_model(model_type, **hf)
        except Exception as exc:  # an invalid combination of config values: one line
            raise ConfigError(f"model.hf: {_first_line(exc)}") from None

    def _check_lengths(self) -> None:
        """``seq_len`` within the model's positions, and no sliding window it would exceed (the
        block layers mask causally, not by window)."""
        c = self.config
        most = getattr(c, "max_position_embeddings", None)
        if most is not None and self.seq_len > most:
            raise ConfigError(
                f"model.seq_len {self.seq_len} exceeds the model's max_position_embeddings {most}"
            )
        window = getattr(c, "sliding_window", None)
        if window is not None and getattr(c, "use_sliding_window", True) and self.seq_len > window:
            raise ConfigError(
                f"model.seq_len {self.seq_len} exceeds the model's sliding_window {window} "
                "(sliding-window attention is not supported)"
            )

    def _meta_model(self, transformers: Any) -> PreTrainedModel:
        """The whole model on the meta device, float32, ``sdpa`` attention: the template each
        layer copies its modules from (building it allocates and computes nothing)."""
        try:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(
                    self.config, attn_implementation="sdpa", dtype=torch.float32
                )
        except Exception as exc:  # not a causal LM, or no sdpa support: one line
            raise ConfigError(
                f"model.source: hf: cannot build {self.config.model_type} as a causal LM with "
                f"sdpa attention: {_first_line(exc)}"
            ) from None

    # -- names and ties ----------------------------------------------------------------------------

    def _module(self, path: str) -> nn.Module:
        return self._model.get_submodule(path)

    def hf_names(self, index: int) -> dict[str, str]:
        """Layer ``index``'s parameter names (as ``layer.named_parameters()`` gives them) -> the
        HF model's state-dict keys."""
        self._check_index(index)
        return {
            f"{local}.{name}": f"{path}.{name}"
            for local, path in self._parts[index]
            for name, _ in self._module(path).named_parameters(remove_duplicate=False)
        }

    def _buffer_names(self, index: int) -> dict[str, str]:
        """Layer ``index``'s persistent buffers (those checkpoints hold) -> HF state-dict keys."""
        out = {}
        for local, path in self._parts[index]:
            module = self._module(path)
            params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
            for key in module.state_dict(keep_vars=True):
                if key not in params:
                    out[f"{local}.{key}"] = f"{path}.{key}"
        return out

    def _find_tied(self) -> dict[int, dict[str, ParamRef]]:
        """Per layer: its parameters that are a copy of one in an earlier layer (the owner).

        Ties come from the meta model itself (transformers ties ``lm_head.weight`` to the input
        embedding when ``tie_word_embeddings``): two HF names, one parameter object."""
        where = {
            hf: (index, local)
            for index in range(len(self._parts))
            for local, hf in self.hf_names(index).items()
        }
        groups: dict[int, list[ParamRef]] = {}
        for name, param in self._model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(where[name])
        tied: dict[int, dict[str, ParamRef]] = {}
        for refs in groups.values():
            owner = min(refs)
            for index, local in refs:
                if index != owner[0]:
                    tied.setdefault(index, {})[local] = owner
        return tied

    def tied(self) -> list[tuple[ParamRef, ParamRef]]:
        """((owner layer, name), (copy layer, name)) for each parameter that is one logical
        weight held by two layers (gpt2: layer 0's ``wte.weight`` and the head's
        ``lm_head.weight``)."""
        return [
            (owner, (index, local))
            for index, refs in sorted(self._tied_to.items())
            for local, owner in sorted(refs.items())
        ]

    # -- building layers ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._parts)

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this (checked on a token file before a job starts)."""
        return int(self.config.vocab_size)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._parts):
            raise IndexError(f"layer {index} out of range [0, {len(self._parts)})")

    def build_layer(self, index: int, seed: int) -> nn.Module:
        """Layer ``index`` on the CPU: its modules copied from the meta model, initialised by the
        model's own init from (seed, index) (a tied copy: from its owner's (seed, owner)), then,
        with ``model.pretrained``, its parameters read from the checkpoint."""
        self._check_index(index)
        layer = self._initialised(index, seed)
        if self._index is not None:
            self._load(layer, index)
        else:
            params = dict(layer.named_parameters())
            for local, (owner, owner_local) in self._tied_to.get(index, {}).items():
                source = dict(self._initialised(owner, seed).named_parameters())[owner_local]
                with torch.no_grad():
                    params[local].copy_(source)
        self._check_set(layer, index)
        return layer.train()

    def build_meta_layer(self, index: int, seed: int) -> nn.Module:
        """Layer ``index``'s modules copied from the meta model, left there: no memory, no
        initialisation, no checkpoint read."""
        self._check_index(index)
        parts, rotary = self._copied(index)
        return self._layer(index, parts, rotary)

    def _copied(self, index: int) -> tuple[dict[str, nn.Module], nn.Module | None]:
        """Layer ``index``'s modules (and a block's rotary embedding) copied from the meta
        model, still on the meta device."""
        memo = {id(self.config): self.config}  # share the config, copy the modules
        parts = {
            local: copy.deepcopy(self._module(path), memo) for local, path in self._parts[index]
        }
        rotary = None
        if 0 < index < len(self._parts) - 1 and self._rotary is not None:
            rotary = copy.deepcopy(self._module(self._rotary), memo)
        return parts, rotary

    def _layer(
        self, index: int, parts: dict[str, nn.Module], rotary: nn.Module | None
    ) -> nn.Module:
        if index == 0:
            return EmbeddingLayer(parts, token=self._token)
        if index == len(self._parts) - 1:
            return HeadLayer(parts)
        return BlockLayer(parts["block"], rotary)

    def _initialised(self, index: int, seed: int) -> nn.Module:
        """Layer ``index`` materialised and initialised with the default generator seeded from
        (seed, index), as the runtime seeds it around :meth:`build_layer`."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, INIT_STEP, INIT_STEP, layer=index))
            parts, rotary = self._copied(index)
            modules = [*parts.values(), *([rotary] if rotary is not None else [])]
            with torch.no_grad():
                for module in modules:
                    module.to_empty(device="cpu")
                    _poison(module)
                for module in modules:
                    for sub in _post_order(module):
                        self._model._init_weights(sub)
        return self._layer(index, parts, rotary)

    def _load(self, layer: nn.Module, index: int) -> None:
        """Overwrite layer ``index``'s parameters (and persistent buffers) with the checkpoint's
        tensors, reading only those; a tied copy absent from the checkpoint (``save_pretrained``
        writes one name of a tie) is read under its owner's name."""
        assert self._index is not None and self.pretrained is not None
        params = self.hf_names(index)
        wanted = {**params, **self._buffer_names(index)}
        owners = {
            local: self.hf_names(owner)[owner_local]
            for local, (owner, owner_local) in self._tied_to.get(index, {}).items()
        }
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for local, key in wanted.items():
            found = self._find_key(key, owners.get(local))
            if found is None:
                if local not in params:
                    continue  # a buffer the checkpoint leaves to init: already set
                raise ConfigError(f"model.pretrained {str(self.pretrained)!r} has no {key!r}")
            by_file.setdefault(self._index[found], []).append((local, found))
        state = layer.state_dict(keep_vars=True)
        from safetensors import safe_open

        with torch.no_grad():
            for path, items in by_file.items():
                with safe_open(str(path), framework="pt") as f:
                    for local, key in items:
                        tensor = f.get_tensor(key)
                        if tuple(tensor.shape) != tuple(state[local].shape):
                            raise ConfigError(
                                f"model.pretrained: {key!r} has shape {tuple(tensor.shape)}, "
                                f"the model expects {tuple(state[local].shape)}"
                            )
                        state[local].copy_(tensor.to(state[local].dtype))

    def _find_key(self, key: str, owner_key: str | None) -> str | None:
        """``key`` as the checkpoint names it: itself, its tie owner's name, or without the
        base-model prefix (a checkpoint of the base model alone)."""
        assert self._index is not None
        prefix = self._model.base_model_prefix + "."
        for candidate in (key, owner_key):
            if candidate is None:
                continue
            if candidate in self._index:
                return candidate
            if candidate.startswith(prefix) and candidate[len(prefix) :] in self._index:
                return candidate[len(prefix) :]
        return None

    def _check_set(self, layer: nn.Module, index: int) -> None:
        """Refuse a layer that still holds a tensor neither the init nor the checkpoint wrote."""
        for name, tensor in layer.state_dict(keep_vars=True).items():
            if not _is_set(tensor):
                raise ConfigError(
                    f"model.source: hf: {self.config.model_type}: {name} of layer {index} is "
                    "neither initialised by the model's _init_weights nor read from a checkpoint"
                )

    def zero_invariant_groups(self, model: Any) -> list[Any]:
        """Attention (GQA-aware) and MLP groups of every decoder block
        (:func:`~elaswave.runtime.workload.hfgroups.hf_families`)."""
        blocks = [
            (i, layer) for i, layer in enumerate(model.layers) if isinstance(layer, BlockLayer)
        ]
        return hf_families(self.config, blocks)

    # -- export ------------------------------------------------------------------------------------

    def export(self, model: KeyedLayers, out: Path) -> None:
        """The trained layers as an HF model directory (config.json + safetensors, written by
        ``save_pretrained``) that ``AutoModelForCausalLM.from_pretrained(out)`` loads: every
        layer's parameters and persistent buffers under their HF state-dict keys."""
        transformers = _transformers()
        state: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(model.layers):
            local = layer.state_dict()
            for name, key in {**self.hf_names(index), **self._buffer_names(index)}.items():
                state[key] = local[name].detach().cpu()
        with torch.device("meta"):
            hf_model = transformers.AutoModelForCausalLM.from_config(
                self.config, dtype=torch.float32
            )
        fit_shapes(hf_model, state)  # a compressed model's layers of different widths
        hf_model.load_state_dict(state, strict=True, assign=True)
        hf_model.tie_weights()
        transformers.utils.logging.disable_progress_bar()
        if getattr(self.config, "elaswave_widths", None) is None:
            hf_model.save_pretrained(str(out))
            return
        # Layers of different widths, which from_pretrained cannot build: the weights under
        # the model's own names (save_pretrained may rename some to older checkpoints' keys),
        # for elaswave.prune.load.load_compressed.
        from safetensors.torch import save_file

        weights: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, tensor in hf_model.state_dict().items():
            if tensor.data_ptr() not in seen:  # a tied copy once
                seen.add(tensor.data_ptr())
                weights[key] = tensor.detach().clone()
        out.mkdir(parents=True)
        hf_model.config.save_pretrained(str(out))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    # -- data and loss -----------------------------------------------------------------------------

    def dataset(self, seed: int) -> Dataset:
        if self.data_source in ("tokens", "text"):  # text: the token file launch made
            return token_file(self.data_path, seq_len=self.seq_len, dtype=self.data_dtype)
        return SyntheticTokens(
            seed=seed, vocab_size=self.config.vocab_size, seq_len=self.seq_len,
            num_samples=self.num_samples,
        )  # fmt: skip

    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        """Windows of ``seq_len + 1`` tokens -> (input ids: the first ``seq_len``, labels: the
        next token at each position). Labels are already shifted: :meth:`loss` does not shift."""
        seqs = torch.stack(list(samples))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        """(summed token cross-entropy, number of labels that are not ``IGNORE_INDEX``)."""
        vocab = output.shape[-1]
        total = F.cross_entropy(
            output.reshape(-1, vocab).float(), targets.reshape(-1), reduction="sum",
            ignore_index=IGNORE_INDEX,
        )  # fmt: skip
        return total, int((targets != IGNORE_INDEX).sum())

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        self._check_index(index)
        last = index == len(self._parts) - 1
        width = self.config.vocab_size if last else self.config.hidden_size
        return TensorSpec((micro_batch_size, self.seq_len, width), torch.float32)

    def layer_costs(self) -> Sequence[float]:
        """Forward FLOPs per sample: 2·T per parameter of a layer, plus 4·T²·d of attention for a
        block; the embedding is a gather (≈ 2·T·d)."""
        t, d = self.seq_len, self.config.hidden_size
        costs = []
        for index, parts in enumerate(self._parts):
            n = sum(p.numel() for _, path in parts for p in self._module(path).parameters())
            if index == 0:
                costs.append(2.0 * t * d)
            elif index == len(self._parts) - 1:
                costs.append(2.0 * t * n)
            else:
                costs.append(2.0 * t * n + 4.0 * t * t * d)
        return costs


def _poison(module: nn.Module) -> None:
    """Fill freshly materialised (uninitialised) tensors with a marker that :func:`_is_set`
    recognises, so a tensor that no init writes is caught instead of training on garbage."""
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool and not tensor.is_complex():
            tensor.fill_(torch.iinfo(tensor.dtype).min)
    for child in module.children():
        _poison(child)


def _is_set(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point():
        return not bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool or tensor.is_complex():
        return True
    return not bool((tensor == torch.iinfo(tensor.dtype).min).any())
