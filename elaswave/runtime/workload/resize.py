"""A model's layers at widths other than its config's: the size attributes a module's forward
reads, set from its weights' shapes. A compressed model (``export --compress``) keeps fewer
heads and channels than the config it was built from; its layers may differ in width.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["fit_attention", "fit_shapes", "resized"]


def resized(module: nn.Module) -> None:
    """The size attributes a module's forward reads, from its (sliced) weight: a projection's
    widths, a grouped convolution's groups, a norm's channels (and GroupNorm's groups)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and weight is not None:
        module.out_features, module.in_features = weight.shape
    elif hasattr(module, "nf") and weight is not None:  # transformers' Conv1D (gpt2)
        module.nf = weight.shape[1]
    elif isinstance(module, nn.modules.conv._ConvNd) and weight is not None:
        if module.transposed:  # (in, out / groups, ...)
            module.in_channels, module.out_channels = (
                weight.shape[0],
                weight.shape[1] * module.groups,
            )
        else:
            if module.groups > 1:  # it loses whole groups: its rows per group stay
                module.groups = weight.shape[0] // (module.out_channels // module.groups)
            module.out_channels, module.in_channels = (
                weight.shape[0],
                weight.shape[1] * module.groups,
            )
    elif isinstance(module, nn.modules.batchnorm._NormBase) and weight is not None:
        module.num_features = weight.shape[0]
    elif isinstance(module, nn.GroupNorm) and weight is not None:
        per_group = module.num_channels // module.num_groups
        module.num_channels, module.num_groups = weight.shape[0], weight.shape[0] // per_group
    elif isinstance(module, nn.LayerNorm) and weight is not None and weight.dim() == 1:
        module.normalized_shape = (weight.shape[0],)
    elif isinstance(module, nn.Embedding) and weight is not None:
        module.embedding_dim = weight.shape[1]


def fit_attention(model: nn.Module) -> None:
    """The head counts gpt2's attention reads, from its (sliced) fused ``c_attn``: it splits
    the projection into q, k and v by ``split_size``, the other families by the weights'
    shapes."""
    for m in model.modules():
        c_attn = getattr(m, "c_attn", None)
        if hasattr(m, "split_size") and c_attn is not None and hasattr(m, "head_dim"):
            split_size = c_attn.weight.shape[1] // 3
            m.split_size, m.num_heads = split_size, split_size // m.head_dim


def fit_shapes(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Make every parameter and buffer of ``model`` that ``state`` holds at another shape that
    shape (an uninitialised tensor on its device; ``load_state_dict`` fills it), with the size
    attributes its module's forward reads: a compressed export whose layers kept different
    widths loads into the model its config builds (the widest); a norm's running statistics
    follow its channels."""
    for key, tensor in state.items():
        owner, _, leaf = key.rpartition(".")
        module = model.get_submodule(owner)
        current = module._parameters.get(leaf)
        if current is None:
            buffer = module._buffers.get(leaf)
            if buffer is not None and buffer.shape != tensor.shape:
                module._buffers[leaf] = buffer.new_empty(tensor.shape)
            continue
        if current.shape == tensor.shape:
            continue
        empty = torch.empty(tensor.shape, dtype=current.dtype, device=current.device)
        setattr(module, leaf, nn.Parameter(empty, requires_grad=current.requires_grad))
        resized(module)
    fit_attention(model)
