"""Hugging Face causal LMs as a workload: the cut layers compute what the HF model computes, each
layer is a function of (seed, index) alone, tied embeddings start equal and are named, pretrained
weights are read as saved, and each wrong config is one clear error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # in the test extra: the HF tests run in CI, never skip
from torch import nn

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.workload.base import build_layers
from elaswave.runtime.workload.data import write_token_file
from elaswave.runtime.workload.hf import HFCausalLM
from elaswave.runtime.workload.load import load_workload

SEQ = 16
TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64,
    },
    "gpt2": {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
        "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0,
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(TINY))
def workload(request: pytest.FixtureRequest) -> HFCausalLM:
    return HFCausalLM(hf=TINY[request.param], seq_len=SEQ)


def _hf_model(w: HFCausalLM, layers: nn.Module) -> nn.Module:
    """A full HF model of ``w``'s config holding the parameters of ``layers`` (via hf_names)."""
    model = transformers.AutoModelForCausalLM.from_config(w.config, attn_implementation="sdpa")
    state = {}
    for index, layer in enumerate(layers):
        params = dict(layer.named_parameters())
        state.update({hf: params[local] for local, hf in w.hf_names(index).items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    return model.eval()


def _run(layers: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _batch(w: HFCausalLM, ids: tuple[int, ...] = (0, 3, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    data = w.dataset(11)
    return w.collate([data[i] for i in ids])


@torch.no_grad()
def test_layers_in_order_compute_the_hf_models_logits_and_loss(workload: HFCausalLM) -> None:
    w = workload
    layers = build_layers(w, 3).layers.eval()
    model = _hf_model(w, layers)
    inputs, labels = _batch(w)
    assert inputs.shape == labels.shape == (3, SEQ)
    assert torch.equal(labels[:, :-1], inputs[:, 1:])  # labels are the next tokens
    logits = _run(layers, inputs)
    torch.testing.assert_close(logits, model(inputs).logits, rtol=1e-5, atol=1e-6)
    # HF shifts labels itself: on the whole window it predicts exactly our labels ...
    window = torch.cat([inputs, labels[:, -1:]], dim=1)
    total, count = w.loss(logits, labels)
    assert count == 3 * SEQ
    expected = model(window, labels=window).loss
    assert abs(float(total) / count - float(expected)) <= 1e-6 * float(expected)
    # ... and on the inputs alone it cannot score the last position: ignore it on our side
    ignored = labels.clone()
    ignored[:, -1] = -100
    total, count = w.loss(logits, ignored)
    assert count == 3 * (SEQ - 1)
    expected = model(inputs, labels=inputs).loss
    assert abs(float(total) / count - float(expected)) <= 1e-6 * float(expected)


def test_attention_is_causal_and_every_parameter_trains(workload: HFCausalLM) -> None:
    w = workload
    layers = build_layers(w, 3).layers.eval()
    inputs, labels = _batch(w)
    changed = inputs.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % w.config.vocab_size
    before, after = _run(layers, inputs), _run(layers, changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    total, _ = w.loss(before, labels)
    total.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers.parameters())


def test_boundary_is_each_layers_output(workload: HFCausalLM) -> None:
    w = workload
    x, _ = _batch(w, (1, 2))
    assert x.dtype == torch.int64
    for index in range(w.num_layers):
        x = w.build_layer(index, 0)(x)
        spec = w.boundary(index, 2)
        assert (tuple(x.shape), x.dtype) == (spec.shape, spec.dtype)
    assert w.boundary(0, 2).shape == (2, SEQ, 64)
    assert w.boundary(w.num_layers - 1, 2).shape == (2, SEQ, 256)


def test_each_layer_is_a_function_of_seed_and_index(workload: HFCausalLM) -> None:
    w = workload
    together = build_layers(w, 5).layers  # the runtime's way: generators seeded around each
    for index in reversed(range(w.num_layers)):
        torch.manual_seed(index + 100)  # whatever state the default generator is in
        alone = w.build_layer(index, 5).state_dict()
        again = w.build_layer(index, 5).state_dict()
        other = w.build_layer(index, 6).state_dict()
        assert alone.keys() == again.keys() == together[index].state_dict().keys()
        for name, value in alone.items():
            assert torch.equal(value, again[name])
            assert torch.equal(value, together[index].state_dict()[name])
        params = dict(w.build_layer(index, 5).named_parameters())
        assert set(params) == set(w.hf_names(index))
        assert any(not torch.equal(params[n], other[n]) for n in params if params[n].std() > 0)


@torch.no_grad()
def test_init_is_the_models_own(workload: HFCausalLM) -> None:
    w = workload
    std = w.config.initializer_range
    block = w.build_layer(1, 0)
    if w.config.model_type == "gpt2":  # the GPT-2 residual scaling, applied after the Conv1D init
        assert abs(float(block.block.attn.c_attn.weight.std()) - std) < 0.1 * std
        scaled = std / (2 * w.config.n_layer) ** 0.5
        assert abs(float(block.block.attn.c_proj.weight.std()) - scaled) < 0.1 * scaled
    else:
        assert abs(float(block.block.self_attn.q_proj.weight.std()) - std) < 0.1 * std
        assert torch.equal(block.block.input_layernorm.weight, torch.ones(64))
        full = transformers.AutoModelForCausalLM.from_config(w.config)
        torch.testing.assert_close(block.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)


def test_a_tensor_that_no_init_writes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    w = HFCausalLM(hf=TINY["llama"], seq_len=SEQ)
    monkeypatch.setattr(w._model, "_init_weights", lambda module: None)
    with pytest.raises(ConfigError, match="embed_tokens.weight of layer 0 is neither initialised"):
        w.build_layer(0, 0)


def test_tied_embeddings_start_equal_and_are_named() -> None:
    w = HFCausalLM(hf=TINY["gpt2"], seq_len=SEQ)
    last = w.num_layers - 1
    assert w.tied() == [((0, "wte.weight"), (last, "lm_head.weight"))]
    head, embedding = w.build_layer(last, 9), w.build_layer(0, 9)
    assert torch.equal(head.lm_head.weight, embedding.wte.weight)
    assert head.lm_head.weight.data_ptr() != embedding.wte.weight.data_ptr()  # each owns a copy
    assert w.hf_names(last)["lm_head.weight"] == "lm_head.weight"
    keyed = build_layers(w, 9)
    (a, b) = w.tied()[0]
    assert keyed.param_slice(a).stop - keyed.param_slice(a).start == 256 * 64
    assert keyed.param_slice(b).stop - keyed.param_slice(b).start == 256 * 64
    assert HFCausalLM(hf=TINY["llama"], seq_len=SEQ).tied() == []
    tied_llama = HFCausalLM(hf={**TINY["llama"], "tie_word_embeddings": True}, seq_len=SEQ)
    assert tied_llama.tied() == [((0, "embed_tokens.weight"), (3, "lm_head.weight"))]


@pytest.mark.parametrize("kind", sorted(TINY))
def test_pretrained_layers_hold_the_saved_weights(kind: str, tmp_path: Path) -> None:
    config = transformers.AutoConfig.for_model(**TINY[kind])
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path)
    state = saved.state_dict()
    cfg = JobConfig.from_dict(
        {"model": {"source": "hf", "pretrained": str(tmp_path), "seq_len": SEQ}}
    )
    w = load_workload(cfg)
    assert isinstance(w, HFCausalLM) and w.num_layers == 4
    for seed in (1, 2):  # the checkpoint, whatever the seed
        for index in range(w.num_layers):
            params = dict(w.build_layer(index, seed).named_parameters())
            for local, hf in w.hf_names(index).items():
                assert torch.equal(params[local], state[hf]), (index, local)
    layers = build_layers(w, 1).layers.eval()
    inputs, _ = _batch(w)
    torch.testing.assert_close(_run(layers, inputs), saved.eval()(inputs).logits)


@torch.no_grad()
def test_export_is_a_directory_from_pretrained_loads(workload: HFCausalLM, tmp_path: Path) -> None:
    """Trained-looking layers (perturbed from init) exported: ``from_pretrained`` gives a model
    whose loss on a batch is the layers' loss, bit for bit, and whose tied weights (gpt2) are one
    tensor again."""
    w = workload
    model = build_layers(w, 3)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.01)
    for (a, a_name), (b, b_name) in w.tied():  # tied copies stay equal, as training keeps them
        dict(model.layers[b].named_parameters())[b_name].copy_(
            dict(model.layers[a].named_parameters())[a_name]
        )
    w.export(model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    inputs, labels = _batch(w)
    total, count = w.loss(_run(model.layers.eval(), inputs), labels)
    theirs = loaded(input_ids=inputs, labels=labels, shift_labels=labels).loss
    assert float(total / count) == float(theirs)  # both a float32 mean
    if w.tied():
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_token_file_data(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    write_token_file(path, list(range(200)))
    cfg = JobConfig.from_dict(
        {"model": {"source": "hf", "hf": TINY["llama"], "seq_len": SEQ},
         "data": {"source": "tokens", "path": str(path)}}
    )  # fmt: skip
    w = load_workload(cfg)
    inputs, labels = w.collate([w.dataset(0)[i] for i in (0, 1)])
    assert inputs[1].tolist() == list(range(SEQ, 2 * SEQ))
    assert labels[1].tolist() == list(range(SEQ + 1, 2 * SEQ + 1))
    costs = w.layer_costs()
    assert len(costs) == w.num_layers and costs[1] == costs[2] > costs[0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"source": "hf", "hf": {"hidden_size": 64}}, "model.hf needs a model_type key"),
        ({"source": "hf", "hf": TINY["llama"], "pretrained": "x"}, "exactly one of model.hf"),
        ({"source": "hf"}, "exactly one of model.hf"),
        ({"hf": TINY["llama"]}, "model.hf needs model.source: hf"),
        ({"pretrained": "x"}, "model.pretrained needs model.source: hf, module"),
        ({"source": "hf", "hf": TINY["llama"], "factory": "a:b"}, "needs model.source: module"),
        ({"source": "hf", "hf": "llama"}, "must be a mapping"),
    ],
)
def test_config_errors(model: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict({"model": model})


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"pretrained": "/no/such/dir"}, "model.pretrained '/no/such/dir' is not a directory"),
        ({"hf": {"model_type": "no_such_family"}}, "'no_such_family' is not a model type"),
        ({"hf": {"model_type": "t5"}}, "cannot build t5 as a causal LM"),
        ({"hf": TINY["llama"], "seq_len": 65}, "exceeds the model's max_position_embeddings 64"),
    ],
)
def test_workload_errors(model: dict, message: str) -> None:
    cfg = JobConfig.from_dict({"model": {"source": "hf", "seq_len": SEQ, **model}})
    with pytest.raises(ConfigError, match=message):
        load_workload(cfg)


def test_pretrained_dir_without_weights(tmp_path: Path) -> None:
    transformers.AutoConfig.for_model(**TINY["llama"]).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="has no \\*.safetensors weights"):
        HFCausalLM(pretrained=str(tmp_path), seq_len=SEQ)


def test_more_stages_than_layers() -> None:
    cfg = JobConfig.from_dict(
        {"model": {"source": "hf", "hf": TINY["gpt2"], "seq_len": SEQ},
         "pp": 8, "elastic": {"nproc_per_node": 8}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="pp=8 stages but the workload has only 4 layers"):
        load_workload(cfg)


def test_missing_transformers_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"needs transformers: pip install 'elaswave\[hf\]'"):
        HFCausalLM(hf=TINY["llama"], seq_len=SEQ)
