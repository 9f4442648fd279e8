"""Export recomputes BatchNorm's running statistics from the trained parameters (they are not
part of the elastic state) and writes them beside the parameters."""

from __future__ import annotations

from pathlib import Path

import torch

from elaswave.config import JobConfig
from elaswave.export import recompute_norm_stats
from elaswave.runtime.workload.base import build_layers
from elaswave.runtime.workload.load import load_workload

CONV = {"source": "module", "factory": "tests.unit.test_prune_units:conv_net", "args": {"dims": 2}}


def test_batchnorm_statistics_are_the_average_of_the_first_micro_batches(tmp_path: Path) -> None:
    """10 samples asked, micro-batches of 4: the first two micro-batches' batch statistics of
    the BatchNorm's input, averaged; every other trained value untouched; the export writes
    them under their global names."""
    from safetensors.torch import load_file

    cfg = JobConfig.from_dict({"model": CONV, "train": {"micro_batch_size": 4, "global_batch": 16}})
    workload = load_workload(cfg)
    model = build_layers(workload, 3)
    norm = model.layers[0][2]
    params = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        norm.running_mean.fill_(5.0)  # what a process's own statistics might hold
    assert recompute_norm_stats(model, workload, cfg, samples=10) == 8
    data = workload.dataset(cfg.train.seed)
    means, variances = [], []
    with torch.no_grad():
        for a in (0, 4):
            inputs, _ = workload.collate([data[i] for i in range(a, a + 4)])
            x = model.layers[0][1](model.layers[0][0](inputs))  # the BatchNorm's input
            means.append(x.mean(dim=(0, 2, 3)))
            variances.append(x.var(dim=(0, 2, 3), unbiased=True))
    torch.testing.assert_close(norm.running_mean, sum(means) / 2, rtol=0, atol=1e-6)
    torch.testing.assert_close(norm.running_var, sum(variances) / 2, rtol=0, atol=1e-6)
    assert int(norm.num_batches_tracked) == 2 and norm.momentum == 0.1  # restored
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))
    workload.export(model, tmp_path / "m.safetensors")
    saved = load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(saved["layers.0.2.running_mean"], norm.running_mean)
    assert "layers.0.2.num_batches_tracked" in saved and "layers.1.3.weight" in saved


def test_a_model_without_batchnorm_is_left_as_it_is() -> None:
    cfg = JobConfig.from_dict(
        {"model": {"source": "module", "factory": "examples.mlp_classifier:mlp_classifier"}}
    )
    workload = load_workload(cfg)
    assert recompute_norm_stats(build_layers(workload, 3), workload, cfg) is None
