"""A plain nn.Module as a workload: cut into layers that compute exactly what the module does,
tied parameters found, the user's state_dict written back, and every bad input one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.workload.base import build_layers
from elaswave.runtime.workload.cut import cut_module
from elaswave.runtime.workload.load import check_data, load_workload
from examples.own_model import SmallResNet

HERE = "tests.unit.test_module_workload"


class Skip(nn.Module):
    """A skip connection across top-level children: not a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


class Again(nn.Module):
    """A child called twice, around another."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


class ModeDependent(nn.Module):
    """A functional dropout: the traced graph would fix train mode's branch for good."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.5, self.training))


class Tied(nn.Module):
    """An embedding and an output head that share one weight, and a top-level parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(x)) * self.scale)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, shape: tuple[int, ...] = (4,), classes: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]


def skip() -> nn.Module:
    return Skip()


class Counting(nn.Module):
    """A buffer of its own that a training forward changes (a count of samples seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.register_buffer("seen", torch.zeros(()))
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return self.fc(torch.flatten(self.conv(x), 1))


def counting() -> nn.Module:
    return Counting()


def instance_norm() -> nn.Module:
    """InstanceNorm keeping running statistics: not BatchNorm's, so not train state."""
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 10))  # fmt: skip


def raises() -> nn.Module:
    raise RuntimeError("out of cheese\nsecond line")


def neither() -> int:
    return 3


def pairs(**kw: Any) -> Pairs:
    return Pairs(**kw)


def singles() -> list[torch.Tensor]:
    return [torch.zeros(4) for _ in range(8)]


def vector_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return F.cross_entropy(output, target, reduction="none"), len(target)


def scalar_only(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="sum")


def _layers_run(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("train", [False, True])
def test_auto_cuts_at_the_children_and_computes_the_same_bits(train: bool) -> None:
    torch.manual_seed(0)
    model = SmallResNet().train(train)
    cut = cut_module(model, ["auto"])
    assert not cut.whole_because
    # pool and dropout hold no parameters: they join stage2
    firsts = [next(iter(dict(layer.named_parameters()))) for layer in cut.layers]
    assert firsts == ["stem.0.weight", "stage1.0.conv1.weight", "stage2.0.conv1.weight",
                      "fc.weight"]  # fmt: skip
    x = torch.randn(4, 1, 8, 8)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        whole = model(x)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        parts = _layers_run(cut.layers, x)
    assert torch.equal(whole, parts)
    names = {n for layer in cut.layers for n, _ in layer.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_named_split_and_its_errors() -> None:
    model = SmallResNet()
    cut = cut_module(model, ["stage1", "fc"])
    assert len(cut.layers) == 3
    x = torch.randn(2, 1, 8, 8)
    model.eval()
    assert torch.equal(model(x), _layers_run([m.eval() for m in cut.layers], x))
    with pytest.raises(ConfigError, match="no module 'stage3' \\(its children: stem, stage1"):
        cut_module(model, ["stage3"])
    with pytest.raises(ConfigError, match="runs before the one named before it"):
        cut_module(model, ["stage2", "stage1"])
    with pytest.raises(ConfigError, match="cannot cut the model there: layer 1 \\(b\\) reads"):
        cut_module(Skip(), ["b"])


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (Skip(), "layer 1 (b) reads the model's input too"),
        (Again(), "its child 'a' is called again after 'b'"),
        (ModeDependent(), "its forward traces differently in train and eval mode"),
    ],
)
def test_auto_keeps_a_model_that_is_no_chain_whole(model: nn.Module, why: str) -> None:
    cut = cut_module(model, ["auto"])
    assert cut.layers == [model] and cut.whole_because == why


def test_tied_parameters_are_found() -> None:
    cut = cut_module(Tied(), ["auto"])
    assert len(cut.layers) == 3  # embed | mix (+ scale) | head
    assert cut.tied == [((0, "embed.weight"), (2, "head.weight"))]
    assert "scale" in dict(cut.layers[1].named_parameters())


def _cfg(tmp_path: Path, **over: Any) -> JobConfig:
    doc: dict[str, Any] = {
        "model": {"source": "module", "factory": "examples.own_model:small_resnet"},
        "data": {"source": "dataset", "factory": "examples.own_model:digit_images"},
        "train": {"micro_batch_size": 4},
        "run_dir": str(tmp_path / "run"),
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        doc[section][name] = value
    return JobConfig.from_dict(doc)


def test_a_plain_module_job_exports_the_users_state_dict(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    w = load_workload(cfg)
    check_data(cfg, w)
    assert w.num_layers == 4 and w.boundary(2, 7).shape == (7, 32)
    model = build_layers(w, cfg.train.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
        model.layers[0].get_submodule("stem.1").running_mean.fill_(3.0)
    out = tmp_path / "model.safetensors"
    w.export(model, out)
    mine = SmallResNet()
    mine.load_state_dict(load_file(str(out)), strict=True)
    assert torch.equal(mine.stem[1].running_mean, torch.full((16,), 3.0))
    x = torch.randn(3, 1, 8, 8)
    mine.eval(), model.eval()
    assert torch.equal(mine(x), model(x, 0, 0))


def test_the_same_initial_values_on_every_build(tmp_path: Path) -> None:
    a, b = load_workload(_cfg(tmp_path)), load_workload(_cfg(tmp_path))
    for i in range(a.num_layers):
        for (n, p), (m, q) in zip(a.build_layer(i, 7).named_parameters(),
                                  b.build_layer(i, 7).named_parameters(), strict=True):  # fmt: skip
            assert n == m and torch.equal(p, q)
    first = "stem.0.weight"
    assert not torch.equal(a.build_layer(0, 7).get_parameter(first),
                           a.build_layer(0, 8).get_parameter(first))  # fmt: skip


def test_pretrained_weights_are_loaded(tmp_path: Path) -> None:
    torch.manual_seed(3)
    mine = SmallResNet()
    torch.save(mine.state_dict(), tmp_path / "w.pt")
    w = load_workload(_cfg(tmp_path, model__pretrained=str(tmp_path / "w.pt")))
    assert torch.equal(w.build_layer(3, 1).fc.weight, mine.fc.weight)
    torch.save({"fc.weight": mine.fc.weight}, tmp_path / "bad.pt")
    with pytest.raises(
        ConfigError,
        match="does not fit .*: 61 missing key\\(s\\) \\(fc.bias, stage1.0.bn1.bias, .*\\)$",
    ):
        load_workload(_cfg(tmp_path, model__pretrained=str(tmp_path / "bad.pt")))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"model__factory": f"{HERE}:raises"}, "failed: RuntimeError: out of cheese$"),
        ({"model__factory": f"{HERE}:neither"}, "returned int, not a Workload or an nn.Module"),
        ({"model__split": ["nope"]}, "model.split: the model has no module 'nope'"),
        ({"data__source": "synthetic", "data__factory": None},
         "a plain nn.Module trains on data.source: dataset"),
        ({"data__factory": f"{HERE}:singles"}, "data: item 0 is a tensor of shape \\(4,\\), not"),
        ({"data__factory": f"{HERE}:pairs"}, "fails on a micro-batch: RuntimeError"),
        ({"data__factory": f"{HERE}:pairs", "data__args": {"shape": [1, 8, 8]},
          "train__loss": f"{HERE}:vector_loss"}, "returned a sum of shape \\(2,\\), not a scalar"),
        ({"data__factory": f"{HERE}:pairs", "data__args": {"shape": [1, 8, 8]},
          "train__loss": f"{HERE}:scalar_only"}, "returned Tensor, not \\(sum, count\\)"),
        ({"train__loss": f"{HERE}:absent"}, "has no 'absent'"),
        ({"model__factory": f"{HERE}:counting"}, "its buffer seen changes in a training forward"),
        ({"model__factory": f"{HERE}:instance_norm"}, "its buffer 1.running_mean changes"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(tmp_path: Path, over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        cfg = _cfg(tmp_path, **over)
        check_data(cfg, load_workload(cfg))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"model": {"source": "torchvision"}}, "needs model.name"),
        ({"model": {"name": "resnet18"}}, "model.name needs model.source: torchvision or timm"),
        ({"model": {"source": "timm", "name": "x", "split": ["auto", "a"]}}, "not both"),
        ({"model": {"split": ["a"]}}, "model.split cuts a plain module"),
        ({"data": {"source": "dataset"}}, "needs data.factory"),
        ({"data": {"source": "imagefolder"}}, "needs data.path"),
        ({"data": {"collate": "a:b"}}, "data.collate needs data.source: dataset or imagefolder"),
        ({"train": {"loss": "hinge"}}, "train.loss must be cross_entropy, mse or"),
    ],
)
def test_config_errors(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict(section)


def test_top1_hits_of_a_classifier(tmp_path: Path) -> None:
    w = load_workload(_cfg(tmp_path))
    out = torch.tensor([[0.1, 2.0], [3.0, 0.0], [0.0, 1.0]])
    assert w.correct(out, torch.tensor([1, 1, 1])) == 2
    mse = load_workload(_cfg(tmp_path, train__loss="mse"))
    assert mse.correct(out, torch.tensor([1, 1, 1])) is None


def test_an_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    from elaswave.runtime.workload.plaindata import image_folder

    for k, name in enumerate(("cat", "dog")):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for i in range(3):
            colour = (40 * k + 10 * i, 0, 255 - 40 * k)
            Image.new("RGB", (12, 10), colour).save(tmp_path / "imgs" / name / f"{i}.png")
    data = image_folder(str(tmp_path / "imgs"), 8)
    assert len(data) == 6
    x, y = data[4]
    assert x.shape == (3, 8, 8) and y == 1 and 0 <= float(x.min()) <= float(x.max()) <= 1
    with pytest.raises(ConfigError, match="not a directory"):
        image_folder(str(tmp_path / "nope"), 8)
