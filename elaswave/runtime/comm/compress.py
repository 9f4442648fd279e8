"""Block-wise int8 for the inter-host hop of the reduction by tiers (``train.grad_compress``).

The idea of ZeRO++'s qgZ, on the one link it pays on: inside a host the gradient is summed in
full precision; between hosts each lane's owner sends its host's partial sum as int8, one scale
per block of :data:`BLOCK` elements (symmetric: ``scale = max |x| / 127``, ``q = round(x /
scale)``), about a quarter of float32's bytes (an eighth of the float64 reduction's). Every lane
rank receives every host's blocks (an all-gather: the sum is taken once, by every rank in the same
host order, never re-quantized hop by hop as a ring's reduce would), so the hosts still hold
bit-identical results and replicas stay bit-identical. What changes is the sum itself: each
host's part is rounded to within half a step (``scale / 2``) per element.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator

__all__ = ["BLOCK", "allreduce_int8", "dequantize", "quantize", "wire_bytes"]

BLOCK = 256  # elements per scale: the scales add 4 / 256 ≈ 1.6% to the int8 payload


def quantize(values: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-D) as int8 codes (padded with zeros to whole blocks) and one float32 scale
    per block. A block of zeros has scale 0 and codes 0; a non-finite value makes its block's
    scale non-finite, so the sum is not finite either (as it would be unquantized)."""
    n = values.numel()
    padded = values.new_zeros(-(-n // block) * block, dtype=torch.float32)
    padded[:n] = values
    blocks = padded.view(-1, block)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127)
    # NaN survives the round and clamp; as int8 it would not: carry it in the scale.
    scale = torch.where(torch.isnan(codes).any(dim=1), torch.full_like(scale, torch.nan), scale)
    return torch.nan_to_num(codes, nan=0.0).to(torch.int8).view(-1), scale


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, n: int, *, dtype: torch.dtype
) -> torch.Tensor:
    """The ``n`` values ``codes`` × their block's scale, in ``dtype``."""
    block = codes.numel() // scale.numel()
    out = codes.view(-1, block).to(dtype) * scale.to(dtype)[:, None]
    return out.view(-1)[:n]


def wire_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes one rank contributes for ``n`` values: the codes and the scales."""
    blocks = -(-n // block)
    return blocks * block + 4 * blocks


def allreduce_int8(
    comm: Communicator, group: str, values: torch.Tensor, *, abort: Callable[[], bool]
) -> None:
    """SUM ``values`` (1-D, contiguous) in place over ``group``, each rank's part sent as int8:
    one all-gather of every rank's codes and scales, then the same sum, in rank order, on every
    rank."""
    n = values.numel()
    codes, scale = quantize(values)
    mine = torch.cat([codes, scale.view(torch.int8)])
    size = comm.size(group)
    every = mine.new_empty(size * mine.numel())
    comm.allgather_into(group, every, mine, abort=abort)
    parts = every.view(size, -1)
    total = torch.zeros(n, dtype=values.dtype, device=values.device)
    for part in parts:  # rank order: every rank adds the same values in the same order
        got_codes = part[: codes.numel()]
        got_scale = part[codes.numel() :].view(torch.float32)
        total += dequantize(got_codes, got_scale, n, dtype=values.dtype)
    values.copy_(total)
