"""Loading a compressed export whose layers kept different widths.

``elaswave export --compress`` writes every parameter at its own shape. For a Hugging Face
model it writes the widest layer's widths into the config (and each layer's under
``elaswave_widths``), which ``from_pretrained`` refuses as a size mismatch;
:func:`load_compressed` builds the model of the config and gives each parameter the shape its
file holds first. An export of one width (a run with ``train.prune.uniform: true``, or
``--pad``) loads with ``from_pretrained`` as well. A plain module's export (one safetensors
file under the module's own names) loads into the module the run built with
:func:`load_compressed_module`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from elaswave.errors import ElasWaveError
from elaswave.runtime.workload.resize import fit_shapes

__all__ = ["load_compressed", "load_compressed_module"]


def load_compressed(path: str | Path, **kwargs: Any) -> Any:
    """The ``AutoModelForCausalLM`` of the export at ``path``, in eval mode, with each layer at
    the widths it kept. ``kwargs`` go to ``from_config`` (``dtype``, ``attn_implementation``)."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ElasWaveError(f"{path}: no safetensors weights (not an HF export)")
    config = transformers.AutoConfig.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    fit_shapes(model, state)
    missing = model.load_state_dict(state, strict=False).missing_keys
    model.tie_weights()
    tensors = model.state_dict()
    loaded = {t.data_ptr() for k, t in tensors.items() if k in state}
    untied = [k for k in missing if tensors[k].data_ptr() not in loaded]  # not a tied copy
    if untied:
        raise ElasWaveError(f"{path}: the weights lack {', '.join(sorted(untied))}")
    return model.eval()


def load_compressed_module(model: nn.Module, path: str | Path) -> nn.Module:
    """``model`` (built as the run built it: ``torchvision.models.resnet18(num_classes=10)``)
    holding the compressed export at ``path`` (one safetensors file), in eval mode: each
    parameter and buffer first given the shape the file holds, and the size attributes its
    module's forward reads (a convolution's channels, a norm's features) with it."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    fit_shapes(model, state)
    model.load_state_dict(state, strict=True)
    return model.eval()
