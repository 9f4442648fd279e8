"""The small models of the OTOv2 authors' sanity checks, written here from their published
structure: CARN (a super-resolution net) and the demo nets that each exercise one construct.

Each is what the reference's test of the same name builds (channels, kernels, strides and the
forward's wiring), so that its zero-invariant groups can be counted by both packages;
:data:`DEMOS` gives each with the inputs the benchmark runs it on (smaller images than the
reference's tests, the same shapes otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEMOS", "Carn"]


def _conv(cin: int, cout: int, k: int = 3, **kw: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=kw.pop("padding", k // 2), **kw)


class _MeanShift(nn.Module):
    """Adds (``sign`` 1) or subtracts (-1) the data set's mean colour: a frozen 1×1 conv."""

    def __init__(self, sign: int) -> None:
        super().__init__()
        self.shifter = nn.Conv2d(3, 3, 1)
        with torch.no_grad():
            self.shifter.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.shifter.bias.copy_(sign * torch.tensor([0.4488, 0.4371, 0.4040]))
        for p in self.shifter.parameters():
            p.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shifter(x)


class _Fuse(nn.Module):
    """A 1×1 conv and a ReLU: how CARN fuses a concatenation back to its width."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 1), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Residual(nn.Module):
    """conv 3×3, ReLU, conv 3×3, added to the input, ReLU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv(width, width), nn.ReLU(inplace=True), _conv(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + x)


class _Cascade(nn.Module):
    """Three units ``unit(width)``, each one's output concatenated to everything before it and
    fused back to ``width`` by a 1×1 conv: CARN's cascading connection (its block holds three
    residual blocks; the net holds three such blocks)."""

    def __init__(self, width: int, unit: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.b1, self.b2, self.b3 = unit(width), unit(width), unit(width)
        self.c1, self.c2, self.c3 = (_Fuse(width * k, width) for k in (2, 3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c1 = torch.cat([x, self.b1(x)], dim=1)
        o1 = self.c1(c1)
        c2 = torch.cat([c1, self.b2(o1)], dim=1)
        o2 = self.c2(c2)
        c3 = torch.cat([c2, self.b3(o2)], dim=1)
        return self.c3(c3)


class Carn(nn.Module):
    """CARN (Ahn et al., "Fast, Accurate, and Lightweight Super-Resolution with Cascading
    Residual Network", 2018) as the reference's sanity check builds it: mean shift, an entry
    conv to 64 channels, three cascading blocks of three residual blocks (every concatenation
    fused by a 1×1 conv), a pixel-shuffle upsampler (a conv to ``scale²`` × 64 channels, ReLU,
    ``PixelShuffle``; twice for ×4), an exit conv to RGB and the mean added back. The forward
    takes the image and the scale, as the reference's does."""

    def __init__(self, scale: int = 2, width: int = 64) -> None:
        super().__init__()
        self.sub_mean, self.add_mean = _MeanShift(-1), _MeanShift(1)
        self.entry = _conv(3, width)
        self.body = _Cascade(width, lambda w: _Cascade(w, _Residual))
        up: list[nn.Module] = []
        steps = [2] * int(math.log2(scale)) if scale in (2, 4, 8) else [scale]
        for s in steps:
            up += [_conv(width, s * s * width), nn.ReLU(inplace=True), nn.PixelShuffle(s)]
        self.upsample = nn.Sequential(*up)
        self.exit = _conv(width, 3)

    def forward(self, x: torch.Tensor, scale: int) -> torch.Tensor:
        x = self.entry(self.sub_mean(x))
        return self.add_mean(self.exit(self.upsample(self.body(x))))


class ConcatNet(nn.Module):
    """conv 64 + BN, two convs to 128 from it (the first through two BNs), the three summed,
    concatenated to the first conv's output (192 channels), a BN, a conv to 256, pooling and
    two Linears (the reference's concat case 1)."""

    def __init__(self, *, share: bool = False) -> None:
        super().__init__()
        self.conv1, self.bn_1 = _conv(3, 64), nn.BatchNorm2d(64)
        self.conv2 = _conv(64, 128)
        self.conv3 = None if share else _conv(64, 128)  # shared: conv2 called again instead
        self.bn_2, self.bn_3, self.bn_4 = (
            nn.BatchNorm2d(128),
            nn.BatchNorm2d(128),
            nn.BatchNorm2d(192),
        )
        self.conv5 = _conv(192, 256)
        self.gemm1, self.gemm2 = nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = F.relu(self.bn_1(self.conv1(x)))
        t = self.conv2(x1)
        third = self.conv2 if self.conv3 is None else self.conv3
        x2 = self.bn_2(t) + self.bn_3(t) + third(x1)
        x5 = self.conv5(self.bn_4(torch.cat([x1, x2], dim=1)))
        x7 = F.adaptive_avg_pool2d(x5, 1)
        return self.gemm2(self.gemm1(x7.view(x7.size(0), -1)))


class ConcatNet2(nn.Module):
    """Concat case 2: case 1's start, then a conv on the concatenation, a conv on that
    concatenated with the sum, and a BN over the last two concatenated (768 channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn_1 = _conv(3, 64), nn.BatchNorm2d(64)
        self.conv2, self.conv3 = _conv(64, 128), _conv(64, 128)
        self.bn_2, self.bn_3, self.bn_4 = (
            nn.BatchNorm2d(128),
            nn.BatchNorm2d(128),
            nn.BatchNorm2d(768),
        )
        self.conv5, self.conv6 = _conv(192, 256), _conv(384, 512)
        self.gemm1, self.gemm2 = nn.Linear(768, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = F.relu(self.bn_1(self.conv1(x)))
        t = self.conv2(x1)
        x2 = self.bn_2(t) + self.bn_3(t) + self.conv3(x1)
        x5 = self.conv5(torch.cat([x1, x2], dim=1))
        x6 = self.conv6(torch.cat([x5, x2], dim=1))
        x6 = self.bn_4(torch.cat([x6, x5], dim=1))
        x7 = F.adaptive_avg_pool2d(x6, 1)
        return self.gemm2(self.gemm1(x7.view(x7.size(0), -1)))


class WeightShareNet(ConcatNet):
    """Concat case 1 with ``conv2`` called twice (its output through two BNs, and again in
    place of ``conv3``): one module's weights used at two places (weight sharing case 1)."""

    def __init__(self) -> None:
        super().__init__(share=True)


class WeightShareNet2(nn.Module):
    """Weight sharing case 2: conv 832, a skip conv to 416, then four times the same two
    convs (832 → 1536 → 416) concatenated with the skip, a last conv to 256."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(3, 832), _conv(832, 416)
        self.conv3, self.conv4 = _conv(832, 1536), nn.Conv2d(1536, 416, 1)
        self.conv5 = _conv(832, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        skip = self.conv2(x)
        for _ in range(4):
            x = torch.cat([self.conv4(self.conv3(x)), skip], dim=1)
        return self.conv5(x)


class _DepthConv(nn.Module):
    """A depthwise conv and a 1×1 conv."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, padding: int, dilation: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cin, k, stride, padding, dilation, groups=cin)
        self.conv2 = nn.Conv2d(cin, cout, 1, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class GroupConvNet(nn.Module):
    """Group conv case 1, a UNet of depthwise-separable convs and InstanceNorms: two images
    concatenated, five stride-2 levels down, two extra inputs concatenated at the bottom, a
    conv whose output is split (its first 384 channels go up, the rest is a second output),
    transposed convs up with a skip concatenated at each level, a conv, pooling, two
    Linears."""

    def __init__(self) -> None:
        super().__init__()
        norm = lambda c: nn.InstanceNorm2d(c, affine=True)  # noqa: E731
        self.conv_1, self.in_1 = _DepthConv(6, 48, 5, 2, 2), norm(48)
        self.conv_2, self.in_2 = _DepthConv(48, 96, 3, 2, 1), norm(96)
        self.conv_3, self.in_3 = _DepthConv(96, 192, 3, 2, 1), norm(192)
        self.conv_4, self.in_4 = _DepthConv(192, 384, 3, 2, 1), norm(384)
        self.conv_5, self.in_5 = _DepthConv(384, 384, 3, 2, 1), norm(384)
        self.conv_6 = _DepthConv(832, 1536, 2, 1, 1, dilation=2)
        up = lambda a, b: nn.ConvTranspose2d(a, b, 3, 2, 1, output_padding=1)  # noqa: E731
        self.convt_7, self.in_7 = up(384, 384), norm(384)
        self.convt_8, self.in_8 = up(768, 192), norm(192)
        self.convt_9, self.in_9 = up(384, 96), norm(96)
        self.convt_10, self.in_10 = up(192, 48), norm(48)
        self.conv_11, self.in_11 = up(96, 48), norm(48)
        self.conv_12 = _conv(48, 96, 5)
        self.gemm1, self.gemm2 = nn.Linear(96, 48), nn.Linear(48, 10)

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor, x4: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        act = F.leaky_relu
        x = act(self.in_1(self.conv_1(torch.cat([x1, x2], dim=1))))
        d1 = act(self.in_2(self.conv_2(x)))
        d2 = act(self.in_3(self.conv_3(d1)))
        d3 = act(self.in_4(self.conv_4(d2)))
        d4 = act(self.in_5(self.conv_5(d3)))
        d4 = self.conv_6(torch.cat([x4, d4, x3], dim=1))
        up, out = d4[:, :384], d4[:, 384:]
        u = torch.cat([self.in_7(self.convt_7(up)), d3], dim=1)
        u = torch.cat([self.in_8(self.convt_8(u)), d2], dim=1)
        u = torch.cat([self.in_9(self.convt_9(u)), d1], dim=1)
        u = torch.cat([self.in_10(self.convt_10(u)), x], dim=1)
        u = self.conv_12(self.in_11(self.conv_11(u)))
        u = F.adaptive_avg_pool2d(u, 1)
        return self.gemm2(self.gemm1(u.view(u.size(0), -1))), out


class ConvTransposeNet(nn.Module):
    """ConvTranspose + InstanceNorm case 1: a conv through two InstanceNorms into two branches
    (conv 256; conv 128, IN, conv 256) added, a transposed conv to 512 and an IN, two convs
    each through an IN added, a conv, pooling, two Linears."""

    def __init__(self) -> None:
        super().__init__()
        norm = lambda c: nn.InstanceNorm2d(c, affine=True)  # noqa: E731
        self.conv1, self.bn_1, self.bn_2 = _conv(3, 64), norm(64), norm(64)
        self.conv2, self.conv3, self.conv4 = _conv(64, 128), _conv(64, 256), _conv(128, 256)
        self.bn_3 = norm(128)
        self.conv6, self.bn_6 = nn.ConvTranspose2d(256, 512, 3, padding=1), norm(512)
        self.conv8, self.conv9 = _conv(512, 256), _conv(512, 256)
        self.in_1, self.in_2 = norm(256), norm(256)
        self.conv10 = _conv(256, 256)
        self.gemm1, self.gemm2 = nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.leaky_relu
        x1 = self.conv1(x)
        a = self.conv3(act(self.bn_1(x1)))
        b = self.conv4(act(self.bn_3(self.conv2(act(self.bn_2(x1))))))
        x = act(self.bn_6(self.conv6(a + b)))
        x = self.in_1(self.conv8(x)) + self.in_2(self.conv9(x))
        x = F.adaptive_avg_pool2d(self.conv10(x), 1)
        return self.gemm2(self.gemm1(x.view(x.size(0), -1)))


class ConvTransposeNet2(nn.Module):
    """ConvTranspose + InstanceNorm case 2: case 1's two branches concatenated (512) through
    an IN, a conv and a transposed conv each through an IN concatenated, a transposed conv,
    a conv and a transposed conv added, pooling, two Linears."""

    def __init__(self) -> None:
        super().__init__()
        norm = lambda c: nn.InstanceNorm2d(c, affine=True)  # noqa: E731
        self.conv1, self.in_1, self.in_2 = _conv(3, 64), norm(64), norm(64)
        self.conv2, self.conv3, self.conv4 = _conv(64, 128), _conv(64, 256), _conv(128, 256)
        self.in_3, self.in_6, self.in_4, self.in_5 = norm(128), norm(512), norm(256), norm(256)
        self.conv5 = _conv(512, 256)
        self.conv6 = nn.ConvTranspose2d(512, 256, 3, padding=1)
        self.conv7 = nn.ConvTranspose2d(512, 256, 3, padding=1)
        self.conv8, self.conv9 = _conv(256, 384), nn.ConvTranspose2d(256, 384, 3, padding=1)
        self.gemm1, self.gemm2 = nn.Linear(384, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.leaky_relu
        x1 = self.conv1(x)
        a = self.conv3(act(self.in_1(x1)))
        b = self.conv4(act(self.in_3(self.conv2(act(self.in_2(x1))))))
        x = act(self.in_6(torch.cat([a, b], dim=1)))
        x = act(torch.cat([self.in_4(self.conv5(x)), self.in_5(self.conv6(x))], dim=1))
        x = act(self.conv7(x))
        x = act(self.conv8(x)) + act(self.conv9(x))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.gemm2(self.gemm1(x.view(x.size(0), -1)))


class InstanceNormNet(nn.Module):
    """InstanceNorm case 3 (``prelu`` false) and case 4 (true): four convs (64 to 512), each
    through an affine InstanceNorm and a LeakyReLU, or a PReLU of one slope per channel;
    pooling, two Linears."""

    def __init__(self, prelu: bool = False) -> None:
        super().__init__()
        widths = (3, 64, 128, 256, 512)
        self.convs = nn.ModuleList(_conv(a, b) for a, b in zip(widths, widths[1:], strict=False))
        self.norms = nn.ModuleList(nn.InstanceNorm2d(c, affine=True) for c in widths[1:])
        self.acts = nn.ModuleList(nn.PReLU(c) if prelu else nn.LeakyReLU() for c in widths[1:])
        self.gemm1, self.gemm2 = nn.Linear(512, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm, act in zip(self.convs, self.norms, self.acts, strict=True):
            x = act(norm(conv(x)))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.gemm2(self.gemm1(x.view(x.size(0), -1)))


def _image(size: int, channels: int = 3) -> Callable[[torch.Generator], tuple[torch.Tensor]]:
    return lambda g: (torch.rand(1, channels, size, size, generator=g),)


def _group_conv_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Two 64×64 images and the two extra inputs at the bottom level's 2×2 (the reference's
    test: 512×512 and 16×16)."""
    image = lambda: torch.rand(1, 3, 64, 64, generator=g)  # noqa: E731
    return (
        image(),
        image(),
        torch.rand(1, 384, 2, 2, generator=g),
        torch.rand(1, 64, 2, 2, generator=g),
    )


# name: (model, inputs from a generator, parameters the reference's test marks unprunable)
DEMOS: dict[
    str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple], tuple[str, ...]]
]
DEMOS = {
    "concat (case 1)": (ConcatNet, _image(32), ()),
    "concat (case 2)": (ConcatNet2, _image(32), ()),
    "weight sharing (case 1)": (WeightShareNet, _image(32), ()),
    "weight sharing (case 2)": (WeightShareNet2, _image(16), ()),
    "grouped conv (case 1)": (
        GroupConvNet, _group_conv_inputs,
        ("conv_1.conv1.weight", "conv_5.conv2.weight", "conv_6.conv1.weight"),
    ),
    "ConvTranspose + IN (case 1)": (ConvTransposeNet, _image(32), ()),
    "ConvTranspose + IN (case 2)": (ConvTransposeNet2, _image(32), ()),
    "InstanceNorm (case 3)": (InstanceNormNet, _image(32), ()),
    "InstanceNorm + PReLU (case 4)": (lambda: InstanceNormNet(prelu=True), _image(32), ()),
}  # fmt: skip
