"""Zero-invariant groups on the OTOv2 authors' own model zoo, beside their package.

For each model of the reference's sanity checks (torchvision's resnet18, resnet50, vgg16_bn,
densenet121, convnext_tiny, mobilenet_v2 and mobilenet_v3_small, CARN, the demo nets of
:mod:`bench.otozoo_models`) and a few it does not cover (a torchvision ViT, timm's ConvNeXt and
ViT):

- ElasWave's :class:`~elaswave.prune.ZIG` on the model (random weights, norms given random
  statistics so that a wrong slice shows): its groups; half of them (at random) zeroed; the
  compressed copy's largest difference from the zeroed model on fresh random inputs (float32,
  eval mode), absolute and relative to the outputs' largest magnitude; parameters and FLOPs
  (``torch.utils.flop_counter``: matrix products, convolutions and attention, one sample)
  before and after.
- The reference package ``only-train-once`` where it is installed (the ``bench`` extra; its
  trace needs three shims for ``torch.onnx`` internals that moved in torch 2.9, applied here
  and nowhere else): its groups (prunable, not auxiliary), and with half of each of its groups
  zeroed (its own ``random_set_zero_groups``), its compressed model's difference and
  parameters, or the one-line reason it failed.

Nothing is installed at run time. ``--repeat`` is not used: every number is exact or a count.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.common import console, print_table
from bench.otozoo_models import DEMOS, Carn
from elaswave.errors import one_line
from elaswave.prune import ZIG
from elaswave.testing.models import settle

DESCRIPTION = "zero-invariant groups on the OTOv2 zoo, beside only-train-once: counts, exactness"
DEFAULT_REPEAT = 1
SEED = 0

Inputs = Callable[[torch.Generator], tuple]


def _torchvision(name: str, size: int = 64, **kw: Any) -> tuple[Callable[[], nn.Module], Inputs]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(**kw)

    return build, lambda g: (torch.rand(1, 3, size, size, generator=g),)


def _timm(name: str, size: int, **kw: Any) -> tuple[Callable[[], nn.Module], Inputs]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, **kw)

    return build, lambda g: (torch.rand(1, 3, size, size, generator=g),)


def _vit() -> nn.Module:
    """torchvision's VisionTransformer, small: 32×32 images in 8×8 patches, 2 layers of 4
    heads, width 64, MLP 128."""
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
        num_classes=10,
    )  # fmt: skip


def _carn() -> tuple[Callable[[], nn.Module], Inputs]:
    return lambda: Carn(scale=2), lambda g: (torch.rand(1, 3, 32, 32, generator=g), 2)


# name: (model, its inputs, parameters the reference's test marks unprunable, part)
ZOO: dict[str, tuple[Callable[[], nn.Module], Inputs, tuple[str, ...], str]] = {
    "resnet18": (*_torchvision("resnet18"), (), "zoo"),
    "resnet50": (*_torchvision("resnet50"), (), "zoo"),
    "vgg16_bn": (*_torchvision("vgg16_bn", size=224), (), "zoo"),
    "densenet121": (*_torchvision("densenet121"), (), "zoo"),
    "convnext_tiny": (*_torchvision("convnext_tiny"), (), "zoo"),
    "mobilenet_v2": (*_torchvision("mobilenet_v2"), (), "zoo"),
    "mobilenet_v3_small": (*_torchvision("mobilenet_v3_small"), (), "zoo"),
    "CARN (×2)": (*_carn(), (), "zoo"),
    **{name: (build, inputs, fixed, "demo") for name, (build, inputs, fixed) in DEMOS.items()},
    "torchvision ViT (small)": (_vit, lambda g: (torch.rand(1, 3, 32, 32, generator=g),), (),
                                "beyond"),
    "timm convnext_atto": (*_timm("convnext_atto", 64, num_classes=10), (), "beyond"),
    "timm vit_tiny (32×32)": (*_timm("vit_tiny_patch16_224", 32, img_size=32, patch_size=8,
                                     num_classes=10), (), "beyond"),
}  # fmt: skip

# The reference's counts measured earlier on torch 2.13 (64×64 inputs), shown where the
# package is not installed here.
MEASURED = {
    "resnet18": 2880, "resnet50": 11456, "densenet121": 10240, "mobilenet_v2": 9128,
    "mobilenet_v3_small": 4872, "convnext_tiny": 27936, "vgg16_bn": 12416,
}  # fmt: skip


def run(repeat: int, config: Any) -> dict[str, Any]:
    peer = _peer()
    console.print(f"only-train-once: {peer.__version__ if peer else 'not installed'}")
    rows = []
    for name, (build, inputs, fixed, part) in ZOO.items():
        row: dict[str, Any] = {"model": name, "part": part}
        torch.manual_seed(SEED)  # the builders draw their initial weights from it
        model = settle(build(), SEED)
        gen = torch.Generator().manual_seed(SEED)
        example, probe = inputs(gen), inputs(gen)
        row["elaswave"] = _measure_zig(copy.deepcopy(model), example, probe)
        if peer is not None:
            row["peer"] = _measure_peer(peer, copy.deepcopy(model), example, probe, fixed)
        elif name in MEASURED:
            row["peer"] = {"groups": MEASURED[name], "measured_before": True}
        rows.append(row)
        e, p = row["elaswave"], row.get("peer", {})
        console.print(
            f"{name}: {e.get('groups', e.get('error'))} groups ({e.get('seconds', 0):.1f} s), "
            f"peer {p.get('groups', p.get('error', '–'))}"
        )
    return {
        "scenario": "otozoo",
        "command": "python -m bench otozoo",
        "peer": f"only-train-once {peer.__version__}" if peer else None,
        "torch": torch.__version__,
        "rows": rows,
    }


def _outputs(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(*inputs)
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(largest absolute difference, largest magnitude of ``a``) over the outputs."""
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    return diff, max(float(x.abs().max()) for x in a)


def flops(model: nn.Module, inputs: tuple) -> int:
    """FLOPs of one forward of ``inputs`` (one sample) through ``model``: matrix products,
    convolutions and attention, as ``torch.utils.flop_counter`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*inputs)
    return int(counter.get_total_flops())


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _measure_zig(model: nn.Module, example: tuple, probe: tuple) -> dict[str, Any]:
    """ElasWave's groups of ``model``; half of them zeroed; the compressed copy against the
    zeroed model on ``probe``."""
    start = time.perf_counter()
    before = {"params": _params(model), "flops": flops(model, probe)}
    try:
        zig = ZIG(model, example)
    except Exception as exc:  # noqa: BLE001 - a model the tracer refuses is a result
        return {"error": one_line(exc)}
    n = len(zig.groups)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[: n // 2]
    zig.zero(chosen.tolist())
    sparse = _outputs(model, probe)
    small = zig.compress().eval()
    diff, scale = _difference(sparse, _outputs(small, probe))
    return {
        "groups": n, "zeroed": n // 2, "max_diff": diff, "output_scale": scale,
        "params": [before["params"], _params(small)],
        "flops": [before["flops"], flops(small, probe)],
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


# ---- the reference package ---------------------------------------------------------------------
def _peer() -> types.ModuleType | None:
    """``only_train_once``, importable on this torch, or None where it is not installed. Its
    trace reads three ``torch.onnx`` internals that torch 2.9 moved under
    ``torch.onnx._internal.torchscript_exporter``: the module ``torch.onnx._globals``, the
    function ``torch.onnx._optimize_graph``, and ``symbolic_helper.is_caffe2_aten_fallback``
    (caffe2 is gone: always false). Each is put back where it is missing."""
    try:
        import importlib.metadata

        version = importlib.metadata.version("only-train-once")
    except importlib.metadata.PackageNotFoundError:
        return None
    import torch.onnx

    try:
        from torch.onnx._internal.torchscript_exporter import _globals, symbolic_helper, utils
    except ImportError:  # an older torch: its own places
        pass
    else:
        sys.modules.setdefault("torch.onnx._globals", _globals)
        if not hasattr(torch.onnx, "_optimize_graph"):
            torch.onnx._optimize_graph = utils._optimize_graph  # type: ignore[attr-defined]
        if not hasattr(symbolic_helper, "is_caffe2_aten_fallback"):
            symbolic_helper.is_caffe2_aten_fallback = lambda: False  # type: ignore[attr-defined]
    with contextlib.redirect_stdout(io.StringIO()):
        import only_train_once
    only_train_once.__version__ = version  # type: ignore[attr-defined]
    return only_train_once


def _measure_peer(
    peer: types.ModuleType, model: nn.Module, example: tuple, probe: tuple, fixed: tuple[str, ...]
) -> dict[str, Any]:
    """The reference's groups of ``model`` (``fixed``: the parameters its own test of the
    model marks unprunable); half of each of its groups zeroed, its compressed model against
    its zeroed one on ``probe``."""
    import numpy as np

    out: dict[str, Any] = {}
    quiet = contextlib.redirect_stdout(io.StringIO())
    dummy = example if len(example) > 1 else example[0]
    start = time.perf_counter()
    try:
        with quiet:
            oto = peer.OTO(model, dummy)
            if fixed:
                oto.mark_unprunable_by_param_names(param_names=list(fixed))
        out["groups"] = sum(
            g["num_groups"] for g in oto._graph.get_param_groups()
            if g["is_prunable"] and not g["is_auxiliary"]
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the reference failing is a result
        return {"error": f"trace: {one_line(exc)}"}
    try:
        with quiet, tempfile.TemporaryDirectory() as tmp:
            np.random.seed(SEED)
            oto.random_set_zero_groups(target_group_sparsity=0.5)
            oto.construct_subnet(out_dir=tmp)
            full = torch.load(oto.full_group_sparse_model_path, weights_only=False).eval()
            small = torch.load(oto.compressed_model_path, weights_only=False).eval()
        sparse = _outputs(full, probe)
        diff, scale = _difference(sparse, _outputs(small, probe))
        out |= {"max_diff": diff, "output_scale": scale,
                "params": [_params(full), _params(small)],
                "flops": [flops(full, probe), flops(small, probe)]}  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"compressed model: {one_line(exc)}"
    out["seconds"] = time.perf_counter() - start
    return out


# ---- the table -----------------------------------------------------------------------------------
def _share(pair: list[int] | None) -> str:
    return f"{pair[1] / pair[0]:.0%}" if pair else "–"


def _diff(cell: dict[str, Any]) -> str:
    return f"{cell['max_diff'] / max(cell['output_scale'], 1e-30):.0e}"


def rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per model: groups (ElasWave, reference), the compressed model's largest
    difference relative to the outputs' scale, parameters and FLOPs left (ElasWave's), and
    the reference's compressed model (its difference, or why it failed)."""
    out = []
    for r in result["rows"]:
        e, p = r["elaswave"], r.get("peer", {})
        peer_groups = f"{p['groups']:,}" if "groups" in p else "–"
        if p.get("measured_before"):
            peer_groups += " (before)"
        peer = _diff(p) if "max_diff" in p else p.get("error", "–")[:60]
        if "error" in e:
            out.append((r["model"], e["error"][:60], peer_groups, "–", "–", "–", peer))
            continue
        out.append((
            r["model"], f"{e['groups']:,}", peer_groups, _diff(e), _share(e["params"]),
            _share(e["flops"]), peer,
        ))  # fmt: skip
    return out


def show(result: dict[str, Any]) -> None:
    print_table(
        f"Zero-invariant groups, half zeroed ({result['peer'] or 'reference not installed'})",
        ["model", "groups", "reference", "|diff|/|out|", "params left", "FLOPs left",
         "reference compressed"],
        rows(result),
    )  # fmt: skip
