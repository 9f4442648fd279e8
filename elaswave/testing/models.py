"""Models made ready for exactness checks: what the zero-invariant group tests and
``python -m bench otozoo`` compare compressed models on."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["settle"]


def settle(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in eval mode with norms that do something: affine weights around 1, biases
    and running statistics off their defaults, parameters initialised to zero made small and
    random (a ViT's head), so that a wrong slice shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)

    def fill(t: torch.Tensor, draw: str, scale: float, shift: float) -> None:
        drawn = torch.rand if draw == "rand" else torch.randn
        t.copy_(drawn(t.shape, generator=gen) * scale + shift)

    with torch.no_grad():
        for m in model.modules():
            norm = isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm))
            weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
            if norm and isinstance(weight, torch.Tensor):
                fill(weight, "rand", 1.0, 0.5)
            if norm and isinstance(bias, torch.Tensor):
                fill(bias, "randn", 0.1, 0.0)
            var, mean = getattr(m, "running_var", None), getattr(m, "running_mean", None)
            if isinstance(var, torch.Tensor) and isinstance(mean, torch.Tensor):
                fill(var, "rand", 1.0, 0.5)
                fill(mean, "randn", 0.1, 0.0)
        for p in model.parameters():
            if not p.any():
                fill(p, "randn", 0.02, 0.0)
    return model.eval()
