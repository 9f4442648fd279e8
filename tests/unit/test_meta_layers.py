"""Layers a rank does not hold are built on the meta device (a pipeline rank at start-up, the
template's preflight): their shapes give the flat layout, they cost no memory and no
initialisation, and the layers a rank holds are exactly those a whole build gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from elaswave.runtime.workload import build_layers
from elaswave.runtime.workload.gpt import GPTConfig, GPTWorkload
from elaswave.runtime.workload.hf import HFCausalLM

LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 64,
}  # fmt: skip


class NeedsValues(GPTWorkload):
    """A workload whose layers read a value while they are built (as one that reads a file
    would): it could not be built under the meta device."""

    def build_layer(self, index: int, seed: int) -> nn.Module:
        layer = super().build_layer(index, seed)
        scale = float(next(layer.parameters()).abs().sum().item())  # no value on meta
        layer.register_buffer("scale", torch.tensor(scale))
        return layer


def _shapes(layer: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in layer.named_parameters()]


@pytest.mark.parametrize(
    "make",
    [
        lambda: HFCausalLM(hf=LLAMA, seq_len=16),
        lambda: GPTWorkload(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)),
        lambda: NeedsValues(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)),
    ],
    ids=["hf-llama", "gpt", "needs-values"],
)
def test_layers_outside_the_window_are_shapes_only(make: Any) -> None:
    workload = make()
    whole = build_layers(workload, 7)
    held = range(1, 3)
    part = build_layers(workload, 7, keep=held)
    assert len(part.layers) == len(whole.layers)
    for index, (a, b) in enumerate(zip(part.layers, whole.layers, strict=True)):
        assert _shapes(a) == _shapes(b)  # the same flat layout
        if index in held:
            assert all(
                torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True)
            )
        else:
            assert all(p.device.type == "meta" for p in a.parameters())
            assert all(t.device.type == "meta" for t in a.buffers())
    assert part.segments() == whole.segments()


def test_an_hf_layer_outside_the_window_is_never_initialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workload = HFCausalLM(hf=LLAMA, seq_len=16)
    built: list[int] = []
    initialised = workload._initialised

    def counted(index: int, seed: int) -> nn.Module:
        built.append(index)
        return initialised(index, seed)

    monkeypatch.setattr(workload, "_initialised", counted)
    build_layers(workload, 7, keep=range(2, 3))
    assert built == [2]
    build_layers(workload, 7, keep=range(0))  # the preflight's: shapes only
    assert built == [2]
