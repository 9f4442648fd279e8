"""Zero-invariant groups of plain modules (``ZIG``), construct by construct: the groups each
rule finds (counts derived by hand), and the property every rule must keep: with about half
the groups zeroed, the compressed module gives the zeroed module's outputs within 1e-5
(float32, eval mode), with fewer parameters, and no element is in two groups."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from elaswave.prune import ZIG
from elaswave.prune.graph import TraceError
from elaswave.runtime.workload.base import Family
from elaswave.testing.models import settle


def disjoint(zig: ZIG) -> bool:
    """Whether no parameter element is in two groups (members of every family)."""
    seen: dict[str, torch.Tensor] = {}
    params = dict(zig.model.named_parameters())
    for f in zig.families:
        for m in f.members:
            name = m.param[1]
            mark = seen.setdefault(name, torch.zeros(params[name].shape, dtype=torch.int32))
            mark.narrow(m.axis, m.start, f.count * m.size).add_(1)
    return all(int(mark.max()) <= 1 for mark in seen.values())


def compressed_exactly(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[ZIG, float]:
    """ZIG of ``model``; about half its groups (random) zeroed; the compressed copy's largest
    difference from the zeroed model, relative to the outputs' scale (at least 1). Asserts
    fewer parameters and disjoint groups."""
    zig = ZIG(model, x)
    assert disjoint(zig)
    n = len(zig.groups)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2]
    zig.zero(chosen.tolist())
    assert sorted(zig.zero_groups()) == sorted(chosen.tolist())
    with torch.no_grad():
        sparse = model(x)
        small = zig.compress().eval()
        out = small(x)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())
    return zig, float((out - sparse).abs().max()) / max(1.0, float(sparse.abs().max()))


def head(channels: int) -> nn.Sequential:
    """Global average pool, flatten, a classifier (whose outputs are the model's: never
    grouped)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 3))


class Residual(nn.Module):
    """stem conv 8 + BN, a block (conv 4, conv 8 + BN) added to it: one family of the stem and
    the block's last conv (the stream, 8), one of the block's inner conv (4)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8),
        )  # fmt: skip
        self.head = head(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(F.relu(x + self.block(x)))


class Cat(nn.Module):
    """Two convs (4, 6) concatenated, a BN over the 10 and a conv (5): three families; the
    second's columns of the consumer start at 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 6, 1)
        self.norm, self.c, self.head = nn.BatchNorm2d(10), nn.Conv2d(10, 5, 3), head(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.a(x), self.b(x)], dim=1)
        return self.head(self.c(F.relu(self.norm(y))))


def depthwise() -> nn.Module:
    """conv 8, a depthwise conv (its rows join the 8), BN, conv 4: 8 + 4."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 1), nn.ReLU6(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.BatchNorm2d(8), nn.ReLU6(), nn.Conv2d(8, 4, 1), nn.ReLU(), head(4),
    )  # fmt: skip


def grouped() -> nn.Module:
    """conv 8, a conv of 4 groups (2 in, 3 out each): the 8 in blocks of 2 (4 groups, the
    grouped conv's rows in blocks of 3), then conv 6: 4 + 6."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 12, 3, padding=1, groups=4), nn.ReLU(),
        nn.Conv2d(12, 6, 1), nn.ReLU(), head(6),
    )  # fmt: skip


class Permute(nn.Module):
    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


class NextBlock(nn.Module):
    """A ConvNeXt block: depthwise conv, NHWC, LayerNorm, Linear 16, GELU, Linear 8, layer
    scale, NCHW, added to its input (a conv 8 with a LayerNorm2d-like norm): the stream (8),
    the hidden channels (16)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.mlp = nn.Sequential(
            Permute(0, 2, 3, 1), nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8),
            Permute(0, 3, 1, 2),
        )  # fmt: skip
        self.scale = nn.Parameter(torch.rand(8, 1, 1) + 0.5)
        self.norm = torchvision.models.convnext.LayerNorm2d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.scale * self.mlp(self.dw(x))
        return self.out(self.norm(x).mean((2, 3)))


def group_norm() -> nn.Module:
    """conv 8 with GroupNorm of 4 norm groups (blocks of 2: 4 groups), conv 4: 4 + 4."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.ReLU(), head(4)
    )


def instance_norm() -> nn.Module:
    """conv 6, affine InstanceNorm; conv 5, InstanceNorm without parameters; conv 4:
    6 + 5 + 4."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.InstanceNorm2d(6, affine=True), nn.ReLU(), nn.Conv2d(6, 5, 3),
        nn.InstanceNorm2d(5), nn.ReLU(), nn.Conv2d(5, 4, 1), nn.ReLU(), head(4),
    )  # fmt: skip


def transposed() -> nn.Module:
    """conv 6, a transposed conv (6 in, 4 out: weight (6, 4, ...)), conv 5: 6 + 4 + 5."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2), nn.ReLU(), nn.ConvTranspose2d(6, 4, 2, stride=2),
        nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3), nn.ReLU(), head(5),
    )  # fmt: skip


class Functional(nn.Module):
    """conv 6, functional ReLU and max pool, conv 8, functional adaptive pool and
    ``view(x.size(0), -1)`` into a Linear; conv 8 flattened without a pool (16 positions per
    channel) into another: 6 + 8 + 8."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (
            nn.Conv2d(3, 6, 3, padding=1),
            nn.Conv2d(6, 8, 3),
            nn.Conv2d(6, 8, 1),
        )
        self.fc, self.flat = nn.Linear(8, 3), nn.Linear(8 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.a(x)), 2)
        y = F.adaptive_avg_pool2d(F.relu(self.b(x)), 1)
        z = F.avg_pool2d(torch.tanh(self.c(x)), 2)
        return self.fc(y.view(y.size(0), -1)) + self.flat(torch.flatten(z, 1))


class SqueezeExcite(nn.Module):
    """conv 8 scaled by a gate ``sigmoid(fc2(relu(fc1(mean(x)))))``: fc2's rows join the 8
    (a zero channel times any gate is zero), fc1 (2) is its own; then conv 4: 8 + 2 + 4."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1, self.fc2 = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.out, self.head = nn.Conv2d(8, 4, 1), head(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))
        return self.head(F.relu(self.out(x * gate)))


class Attention(nn.Module):
    """A Linear 8 into ``nn.MultiheadAttention`` (2 heads of 4), added back, a mean over the
    tokens: the stream (8, with the output projection's rows) and the heads (2)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.out(x.mean(1))


class VitBlock(nn.Module):
    """A pre-norm transformer block with timm's attention (2 heads of 4) and an MLP (16):
    the stream (8), the heads (2), the MLP's channels (16)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.norm1, self.norm2 = nn.LayerNorm(8), nn.LayerNorm(8)
        self.attn = timm.layers.Attention(8, num_heads=2, qkv_bias=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.out(x[:, 0])


class Shared(nn.Module):
    """conv 6, then one conv (4) called twice: on it, and on it through a BN; the two results
    added. Its rows are one family (4) and its columns consume the 6 at both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b, self.head = (
            nn.Conv2d(3, 6, 1),
            nn.BatchNorm2d(6),
            nn.Conv2d(6, 4, 3),
            head(4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.a(x))
        return self.head(self.b(y) + self.b(self.norm(y)))


def prelu() -> nn.Module:
    """conv 6, a PReLU of a slope per channel (removed with its channel), conv 4: 6 + 4."""
    return nn.Sequential(nn.Conv2d(3, 6, 1), nn.PReLU(6), nn.Conv2d(6, 4, 3), nn.PReLU(), head(4))


class FrozenConsumer(nn.Module):
    """conv 6 into a frozen conv 3 (a fixed colour transform, as CARN's mean shift) whose
    outputs are the model's: the 6 channels are a family, the frozen columns consumers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.fixed = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 3, 1)
        self.fixed.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fixed(F.relu(self.a(x)))


class LayerScale(nn.Module):
    """conv 6 scaled by a vector reshaped to ``(1, 6, 1, 1)`` (timm's ConvNeXt layer scale;
    it joins the family), conv 4: 6 + 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 4, 3), head(4)
        self.gamma = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).mul(self.gamma.reshape(1, -1, 1, 1))
        return self.head(self.b(F.relu(y)))


IMAGE = (2, 3, 12, 12)
TOKENS = (2, 6, 5)
CASES = {
    "residual": (Residual, IMAGE, [("channels", 8), ("channels", 4)]),
    "cat": (Cat, IMAGE, [("channels", 4), ("channels", 6), ("channels", 5)]),
    "depthwise": (depthwise, IMAGE, [("channels", 8), ("channels", 4)]),
    "grouped": (grouped, IMAGE, [("channels", 4), ("channels", 6)]),
    "layernorm": (NextBlock, IMAGE, [("channels", 8), ("channels", 16)]),
    "groupnorm": (group_norm, IMAGE, [("channels", 4), ("channels", 4)]),
    "instancenorm": (instance_norm, IMAGE, [("channels", 6), ("channels", 5), ("channels", 4)]),
    "transposed": (transposed, IMAGE, [("channels", 6), ("channels", 4), ("channels", 5)]),
    "functional": (Functional, (2, 3, 16, 16), [("channels", 6), ("channels", 8), ("channels", 8)]),
    "squeeze-excite": (SqueezeExcite, IMAGE, [("channels", 8), ("channels", 2), ("channels", 4)]),
    "attention": (Attention, TOKENS, [("channels", 8), ("attention", 2)]),
    "vit-block": (VitBlock, TOKENS, [("channels", 8), ("attention", 2), ("channels", 16)]),
    "shared": (Shared, IMAGE, [("channels", 6), ("channels", 4)]),
    "prelu": (prelu, IMAGE, [("channels", 6), ("channels", 4)]),
    "frozen-consumer": (FrozenConsumer, IMAGE, [("channels", 6)]),
    "layer-scale": (LayerScale, IMAGE, [("channels", 6), ("channels", 4)]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_each_construct_has_its_groups_and_compresses_exactly(name: str) -> None:
    build, shape, expected = CASES[name]
    torch.manual_seed(0)
    model = settle(build())
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    zig, diff = compressed_exactly(model, x)
    assert [(f.kind, f.count) for f in zig.families] == expected
    assert len(zig.groups) == sum(count for _, count in expected)
    assert diff <= 1e-5


def _family(zig: ZIG, name: str) -> Family:
    return next(f for f in zig.families if f.name == name)


def _params(members: tuple) -> list[tuple[str, int, int, int]]:
    return [(m.param[1], m.axis, m.size, m.start) for m in members]


def test_a_residual_stream_is_one_family_of_its_producers_and_norms() -> None:
    zig = ZIG(settle(Residual()), torch.randn(IMAGE))
    stream = _family(zig, "stem.0")
    assert _params(stream.members) == [
        ("stem.0.weight", 0, 1, 0), ("stem.0.bias", 0, 1, 0), ("stem.1.weight", 0, 1, 0),
        ("stem.1.bias", 0, 1, 0), ("block.3.weight", 0, 1, 0), ("block.3.bias", 0, 1, 0),
        ("block.4.weight", 0, 1, 0), ("block.4.bias", 0, 1, 0),
    ]  # fmt: skip
    assert _params(stream.consumers) == [("block.0.weight", 1, 1, 0), ("head.2.weight", 1, 1, 0)]


def test_concatenated_inputs_keep_their_offsets() -> None:
    zig = ZIG(settle(Cat()), torch.randn(IMAGE))
    a, b = _family(zig, "a"), _family(zig, "b")
    assert ("norm.weight", 0, 1, 0) in _params(a.members)
    assert ("norm.weight", 0, 1, 4) in _params(b.members)
    assert _params(a.consumers) == [("c.weight", 1, 1, 0)]
    assert _params(b.consumers) == [("c.weight", 1, 1, 4)]


def test_grouped_and_transposed_convolutions_slice_their_own_axes() -> None:
    zig = ZIG(settle(grouped()), torch.randn(IMAGE))
    assert _params(zig.families[0].members) == [
        ("0.weight", 0, 2, 0), ("0.bias", 0, 2, 0), ("2.weight", 0, 3, 0), ("2.bias", 0, 3, 0)
    ]  # fmt: skip
    assert _params(zig.families[0].consumers) == [("4.weight", 1, 3, 0)]
    zig = ZIG(settle(transposed()), torch.randn(IMAGE))
    assert _params(zig.families[0].consumers) == [("2.weight", 0, 1, 0)]
    assert ("2.weight", 1, 1, 0) in _params(zig.families[1].members)


def test_the_gate_of_a_squeeze_excitation_joins_the_channels_it_scales() -> None:
    zig = ZIG(settle(SqueezeExcite()), torch.randn(IMAGE))
    channels = _family(zig, "conv")
    assert {"fc2.weight", "fc2.bias"} <= {m.param[1] for m in channels.members}
    assert {m.param[1] for m in channels.consumers} == {"fc1.weight", "out.weight"}


def test_heads_are_blocks_of_head_dim_in_q_k_v_and_the_output_projection() -> None:
    zig = ZIG(settle(Attention()), torch.randn(TOKENS))
    heads = _family(zig, "attn")
    assert _params(heads.members) == [
        ("attn.in_proj_weight", 0, 4, 0), ("attn.in_proj_weight", 0, 4, 8),
        ("attn.in_proj_weight", 0, 4, 16), ("attn.in_proj_bias", 0, 4, 0),
        ("attn.in_proj_bias", 0, 4, 8), ("attn.in_proj_bias", 0, 4, 16),
    ]  # fmt: skip
    assert _params(heads.consumers) == [("attn.out_proj.weight", 1, 4, 0)]


class Unknown(nn.Module):
    """conv 6 into a cumulative sum over the channels (an operation the rules do not know):
    its channels form no group; the conv after it (4) still does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3), head(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.b(torch.cumsum(self.a(x), 1))))


class Branching(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_an_unknown_operation_ends_its_inputs_families() -> None:
    zig = ZIG(settle(Unknown()), torch.randn(IMAGE))
    assert [(f.name, f.count) for f in zig.families] == [("b", 4)]


def test_a_model_that_does_not_trace_says_why_on_one_line() -> None:
    with pytest.raises(TraceError, match=r"does not trace with torch.fx: TraceError: ") as info:
        ZIG(Branching(), torch.randn(2, 3))
    assert "\n" not in str(info.value)


# The peer package's counts (64×64 inputs) for the models below are met exactly: each channel
# of every producer whose channels can be removed, residual streams once.
TORCHVISION = {
    "resnet18": 2880, "resnet50": 11456, "densenet121": 10240, "mobilenet_v2": 9128,
    "mobilenet_v3_small": 4872, "convnext_tiny": 27936,
}  # fmt: skip
COMPRESSED = ("resnet18", "mobilenet_v2", "densenet121", "convnext_tiny")


def test_torchvision_models_have_the_reference_group_counts_and_compress_exactly() -> None:
    """Every model's group count; the four named in COMPRESSED and a small ViT also compressed
    with half their groups zero (32×32 inputs), within 1e-5 of the zeroed model."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    found, diffs = {}, {}
    for name in TORCHVISION:
        torch.manual_seed(0)
        model = settle(getattr(torchvision.models, name)())
        if name in COMPRESSED:
            zig, diffs[name] = compressed_exactly(model, x)
        else:
            zig = ZIG(model, x)
        found[name] = len(zig.groups)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    zig, diffs["vit"] = compressed_exactly(settle(vit), x)
    found["vit"] = len(zig.groups)  # stream 32, 2 × (2 heads + 64 MLP channels)
    assert found == {**TORCHVISION, "vit": 164}
    assert max(diffs.values()) <= 1e-5, diffs


def test_a_compressed_module_export_loads_into_the_model_the_run_built(tmp_path) -> None:
    """A compressed module's state (BatchNorm's running statistics at the new width too), as
    ``export --compress`` writes it, loads into a freshly built full-width module with
    ``load_compressed_module``: the compressed outputs."""
    from safetensors.torch import save_file

    from elaswave.prune.load import load_compressed_module

    torch.manual_seed(0)
    model = settle(Residual())
    x = torch.randn(IMAGE, generator=torch.Generator().manual_seed(2))
    zig = ZIG(model, x)
    zig.zero(range(0, len(zig.groups), 2))
    small = zig.compress().eval()
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, tmp_path / "m.st")
    loaded = load_compressed_module(Residual(), tmp_path / "m.st")
    assert loaded.stem[1].running_mean.shape == small.stem[1].running_mean.shape == (4,)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), small(x), rtol=0, atol=0)


def test_a_family_zero_to_its_last_group_keeps_one_zero_group() -> None:
    """Every group of the block's inner family (4) and half the stream zeroed: the compressed
    copy keeps one zero channel there (a convolution of no channels does not run), the same
    outputs."""
    torch.manual_seed(0)
    model = settle(Residual())
    x = torch.randn(IMAGE, generator=torch.Generator().manual_seed(2))
    zig = ZIG(model, x)
    inner = [g for g, (i, _) in enumerate(zig.groups) if zig.families[i].count == 4]
    zig.zero([*inner, 0, 2, 4, 6])
    small = zig.compress().eval()
    assert small.block[0].weight.shape[0] == 1 and not small.block[0].weight.any()
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=0, atol=1e-5)
