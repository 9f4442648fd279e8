"""Hugging Face causal LMs (``model.source: hf``) trained by real workers on real text.

The token file is this repository's README as bytes (a byte-level vocabulary of 256). In the
deterministic mode (float64 reduction) a llama-style model survives a SIGKILL under replicated
data parallelism, ZeRO-1, ZeRO-3 and dp=2 × pp=2 (a stage loss), and a gpt2-style model — its
input embedding and LM head tied, on different pipeline stages — survives a ZeRO-1 kill, a
ZeRO-3 kill and a stage loss in dp=2 × pp=2: every loss and the final state bit-identical to
the fault-free run (stages
and replicas give the same bits as data parallelism), every step recorded once; both copies of
gpt2's tied weight are identical in its final durable checkpoint. The runs use the trainer's
features: AdamW with weight-decay groups, clipping, warmup (the kill falls in it) and cosine
(llama), SGD with momentum (gpt2), and a held-out evaluation every 4 steps, whose losses match
bit for bit too.

With one worker (float32) the job is a plain PyTorch loop over the same HF model; a run exported
with ``elaswave export`` loads with ``from_pretrained`` and fine-tunes from where it ended.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import F64, ROOT, Run, assert_clean_run, elaswave_cmd

STEPS = 12
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
             "n_positions": 64},
}  # fmt: skip
# llama: AdamW, weight decay (not on norms), clipping, a warmup the kill at step 6 falls in,
# then cosine; gpt2: SGD with momentum and weight decay (not on biases, norms, positions).
# Both score the last EVAL_SAMPLES samples (held out from training) every 4 steps.
EVAL_SAMPLES = 8
TRAIN: dict[str, dict[str, Any]] = {
    "llama": {"lr": 0.003, "weight_decay": 0.1, "grad_clip": 1.0, "lr_schedule": "cosine",
              "warmup_steps": 8, "min_lr": 0.0003, "eval_every": 4},
    "gpt2": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01,
             "eval_every": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf-configs")
    tokens = base / "readme.u16"
    text = (ROOT / "README.md").read_bytes()
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(tokens)
    out = {}
    for family, hf in FAMILIES.items():
        cfg = {
            "job_id": f"hf-{family}",
            "model": {"source": "hf", "seq_len": 32, "hf": hf},
            "data": {"source": "tokens", "path": str(tokens), "dtype": "uint16",
                     "eval_samples": EVAL_SAMPLES},
            "train": {"steps": STEPS, "global_batch": 16, "micro_batch_size": 2, "seed": 5,
                      **TRAIN[family]},
            "elastic": {"nproc_per_node": 4, "nnodes": "1:1", "max_restarts": 0},
        }  # fmt: skip
        out[family] = base / f"{family}.yaml"
        out[family].write_text(yaml.safe_dump(cfg))
    return out


def _launch(
    config: Path,
    run_dir: Path,
    state: Path,
    *args: str,
    f64: bool = True,
    env: dict[str, str] | None = None,
) -> Run:
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(state), **(F64 if f64 else {}), **(env or {})}
    cmd = elaswave_cmd("launch", str(config), "--run-dir", str(run_dir), "--quiet", *args)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(run_dir)


def _same_run(run: Run, reference: Run) -> None:
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
    evals = [(e["step"], e["eval_loss"]) for e in run.evals]
    assert [s for s, _ in evals] == [4, 8, 12]  # every eval_every steps, once each
    assert evals == [(e["step"], e["eval_loss"]) for e in reference.evals]  # bit for bit
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in reference.of("final_state")
        }


def _killed(run: Run) -> None:
    assert len(run.of("fault_injected")) == 1
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]  # the kill, and no other


@pytest.fixture(scope="module")
def llama_reference(configs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("llama-ref")
    run = _launch(configs["llama"], base / "run", base / "state", "--job-id", "llama-ref")
    assert run.losses[STEPS] < run.losses[1]  # it learns the text
    return run


@pytest.mark.parametrize(
    "strategy", [[], ["--zero", "1"], ["--zero", "3"]], ids=["replicated", "zero1", "zero3"]
)
def test_llama_survives_a_kill_bit_identical(
    configs: dict[str, Path], llama_reference: Run, tmp_path: Path, strategy: list[str]
) -> None:
    run = _launch(configs["llama"], tmp_path / "run", tmp_path / "state", "--job-id",
                  "llama-kill", *strategy, "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(run)
    _same_run(run, llama_reference)


@pytest.mark.parametrize(
    "layout",
    [
        ["--dp", "2", "--migration", "async"],
        ["--dp", "2", "--zero", "1", "--migration", "blocking"],
        ["--nproc-per-node", "6", "--migration", "blocking"],
        ["--nproc-per-node", "6", "--zero", "1", "--migration", "async"],
        ["--nproc-per-node", "6", "--zero", "3", "--migration", "blocking"],
    ],
    ids=["dp2-async", "dp2-zero-blocking", "dp3-blocking", "dp3-zero-async", "dp3-zero3"],
)
def test_llama_stages_hold_only_their_layers_through_a_stage_loss(
    configs: dict[str, Path], llama_reference: Run, tmp_path: Path, layout: list[str]
) -> None:
    """dp × pp = 2 × 2 and 3 × 2, with and without ZeRO inside the stages: a stage dies at step
    6 and its replica is cut again. Every rank allocates the parameters of its stage's layers
    only, before the loss and after the takeover (ZeRO-3: for the step; between steps two
    thirds of them while three ranks hold each layer), and the run stays bit-identical to data
    parallelism (4 workers) in the deterministic mode."""
    run = _launch(configs["llama"], tmp_path / "run", tmp_path / "state", "--job-id",
                  "llama-stages", "--pp", "2", *layout,
                  "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(run)
    _same_run(run, llama_reference)
    _assert_stage_shares(run, configs["llama"])


def _assert_stage_shares(run: Run, config: Path) -> None:
    """The last memory each worker reported under each plan: its parameters are its stage's
    layers, within 10 % (before the loss each stage is about half of the model; after it the
    replica that lost a rank may run on one, which then holds every layer)."""
    from elaswave.config import load_config
    from elaswave.runtime.workload.load import build_model

    segments = build_model(load_config(config, env={})).segments()
    whole = 4 * sum(n for _, n in segments)
    plans = {p["epoch"]: p for p in run.of("plan_published") if "bounds" in p}
    last = {(e["epoch"], e["worker"]): e for e in run.of("memory")}
    assert {epoch for epoch, _ in last} == set(plans) and len(plans) == 2
    for (epoch, worker), memory in last.items():
        plan = plans[epoch]
        rank = plan["workers"].index(worker)
        d = next(d for d, ranks in enumerate(plan["replicas"]) if rank in ranks)
        s = plan["replicas"][d].index(rank)
        share = 4 * sum(n for _, n in segments[plan["bounds"][d][s] : plan["bounds"][d][s + 1]])
        assert share < 0.8 * whole or epoch != min(plans)  # a stage, not the model
        if memory["gathered_bytes"]:  # ZeRO-3 inside the stages: the stage, for the step
            assert memory["gathered_bytes"] == share, (epoch, worker, memory, share)
            kept = 2 / 3 if epoch == min(plans) else 1.0  # each part kept by two of k holders
            assert memory["param_bytes"] <= kept * share + 64, (epoch, worker, memory, share)
            continue
        assert abs(memory["param_bytes"] - share) <= 0.1 * share, (epoch, worker, memory, share)


def test_llama_bf16_survives_a_kill_during_warmup(configs: dict[str, Path], tmp_path: Path) -> None:
    """bf16 autocast (float32 master weights and optimizer): a kill at step 6, inside the
    warmup, under ZeRO-1 keeps every loss and the final state on the fault-free bf16 run."""
    flags = ["--zero", "1"]
    ref = _launch(configs["llama"], tmp_path / "ref", tmp_path / "s0", "--job-id", "bf16-ref",
                  *flags, env={"ELASWAVE_TRAIN__AUTOCAST": "bf16"})  # fmt: skip
    run = _launch(configs["llama"], tmp_path / "kill", tmp_path / "s1", "--job-id", "bf16-kill",
                  *flags, "--fault", "kill,rank=1,at_step=6",
                  env={"ELASWAVE_TRAIN__AUTOCAST": "bf16"})  # fmt: skip
    _killed(run)
    _same_run(run, ref)
    assert ref.losses[STEPS] < ref.losses[1]


GPT2_STAGES = ["--pp", "2", "--dp", "2", "--durable-every", str(STEPS)]


@pytest.fixture(scope="module")
def gpt2_stages(configs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """gpt2 fault-free on dp=2 × pp=2 (embedding and head, tied, on different stages)."""
    base = tmp_path_factory.mktemp("gpt2-pp")
    return _launch(configs["gpt2"], base / "pp", base / "s", "--job-id", "gpt2-pp", *GPT2_STAGES)


def test_gpt2_tied_across_stages_survives_a_stage_loss(
    configs: dict[str, Path], tmp_path: Path, gpt2_stages: Run
) -> None:
    from elaswave.config import load_config
    from elaswave.runtime.durable.checkpoints import latest, load
    from elaswave.runtime.workload.load import build_model, load_workload

    flags, pp = GPT2_STAGES, gpt2_stages
    zero = _launch(configs["gpt2"], tmp_path / "zero", tmp_path / "s0", "--job-id", "gpt2-zero",
                   "--zero", "1", "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(zero)
    _same_run(zero, pp)  # a ZeRO-1 kill: the same bits as the fault-free stages and replicas
    killed = _launch(configs["gpt2"], tmp_path / "kill", tmp_path / "s2", "--job-id", "gpt2-kill",
                     *flags, "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(killed)
    _same_run(killed, pp)
    assert {f["holders_agree"] for f in killed.of("final_state")} == {True}
    # Both copies of the tied weight (embedding on the first stage, head on the last): equal.
    cfg = load_config(configs["gpt2"], env={})
    workload, model = load_workload(cfg), build_model(cfg)
    (a, b), *_ = workload.tied()
    path = latest(tmp_path / "kill" / "checkpoints")
    assert path is not None
    state = load(path, sum(p.numel() for p in model.parameters()))
    assert state.step == STEPS
    first, second = state.params[model.param_slice(a)], state.params[model.param_slice(b)]
    initial = dict(model.layers[a[0]].named_parameters())[a[1]].detach().reshape(-1)
    assert first.equal(second) and not first.equal(initial)  # one weight, and trained


def _step_batches(cfg: Any, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of ``step`` as the job draws them: (input ids, next-token labels)."""
    from elaswave.runtime.workload.data import TokenFile, microbatches

    t, data = cfg.train, TokenFile(cfg.data.path, seq_len=cfg.model.seq_len)
    n = len(data) - cfg.data.eval_samples  # the last samples are held out
    out = []
    for mb in microbatches(
        t.seed, step, t.global_batch, micro_batch_size=t.micro_batch_size, num_samples=n
    ):
        window = torch.stack([data[i] for i in mb.sample_ids])
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def _hf_loss(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The HF model's own causal-LM loss (``labels=``) over a whole batch of micro-batches."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            out = model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1)
            total, count = total + float(out.loss), count + y.numel()
    return total / count


def test_export_loads_with_from_pretrained_and_fine_tuning_continues(
    configs: dict[str, Path], llama_reference: Run, tmp_path: Path
) -> None:
    """``elaswave export`` of the fault-free llama run (its final state, kept by save_final):
    ``from_pretrained`` scores a batch as the run's final layers do, and a job that fine-tunes
    that directory starts from that loss."""
    import transformers

    from elaswave.config import load_config
    from elaswave.runtime.durable.checkpoints import latest, load
    from elaswave.runtime.optim import FlatParams
    from elaswave.runtime.workload.data import TokenFile
    from elaswave.runtime.workload.load import build_model, load_workload

    out = tmp_path / "llama-out"
    r = subprocess.run(
        elaswave_cmd("export", "--run-dir", str(llama_reference.dir), "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"exported step {STEPS}" in r.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    cfg = load_config(configs["llama"], env={})
    batches = _step_batches(cfg, 1)
    # The run's final state, through the runtime's own layers and loss.
    workload, layers = load_workload(cfg), build_model(cfg).eval()
    flat = FlatParams(layers)
    path = latest(llama_reference.dir / "checkpoints")
    assert path is not None
    flat.data.copy_(load(path, flat.numel).params)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            s, c = workload.loss(layers(x, 1, 0), y)
            total, count = total + float(s), count + c
    exported = _hf_loss(model, batches)
    assert abs(exported - total / count) <= 1e-6 * exported
    # The run's last held-out loss: the exported model's on the held-out samples, in eval mode.
    data = TokenFile(cfg.data.path, seq_len=cfg.model.seq_len)
    held = [torch.stack([data[i] for i in range(len(data) - EVAL_SAMPLES, len(data))])]
    held_out = _hf_loss(model, [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in held])
    last = llama_reference.evals[-1]
    assert last["step"] == STEPS and abs(last["eval_loss"] - held_out) <= 1e-6 * held_out
    # Fine-tune the exported directory: its first step scores the same batch from that state.
    tune = yaml.safe_load(configs["llama"].read_text())
    tune["model"] = {"source": "hf", "seq_len": 32, "pretrained": str(out)}
    tune["train"]["steps"] = 2
    config = tmp_path / "tune.yaml"
    config.write_text(yaml.safe_dump(tune))
    run = _launch(config, tmp_path / "tune", tmp_path / "s", "--job-id", "llama-tune")
    assert abs(run.losses[1] - exported) <= 1e-6 * exported
    assert run.losses[1] < llama_reference.losses[1]  # it did start from the trained weights


def test_one_worker_is_a_plain_training_loop(configs: dict[str, Path], tmp_path: Path) -> None:
    """One worker, float32: ElasWave's final weights are bit for bit those of a plain
    loop over the same HF model (same initial weights: a ``save_pretrained`` directory) fed the
    same batches with ``labels=``, with torch.optim.AdamW (weight decay on matrices only),
    the same warmup + cosine rates and clipping by the global norm of the batch's mean
    gradient; its per-step losses agree within 1e-6 (the job sums the reported loss in
    float32)."""
    import transformers

    from elaswave.config import load_config
    from elaswave.runtime.optim import clip_factor, learning_rate

    init = tmp_path / "init"
    torch.manual_seed(0)
    hf = dict(FAMILIES["llama"])
    config_obj = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    transformers.AutoModelForCausalLM.from_config(config_obj).save_pretrained(str(init))
    job = yaml.safe_load(configs["llama"].read_text())
    job["model"] = {"source": "hf", "seq_len": 32, "pretrained": str(init)}
    job["elastic"]["nproc_per_node"] = 1
    config = tmp_path / "one.yaml"
    config.write_text(yaml.safe_dump(job))
    run = _launch(config, tmp_path / "run", tmp_path / "s", "--job-id", "llama-one", f64=False)
    out = tmp_path / "trained"
    r = subprocess.run(
        elaswave_cmd("export", "--run-dir", str(tmp_path / "run"), "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]

    cfg, t = load_config(config, env={}), job["train"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(init), attn_implementation="sdpa")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=t["lr"], betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    losses = {}
    for step in range(1, STEPS + 1):
        total, count = 0.0, 0
        for x, y in _step_batches(cfg, step):  # sum-loss backward per micro-batch, / count
            out_ = model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1)
            out_.loss.backward()
            total, count = total + float(out_.loss.detach()), count + y.numel()
        for p in params:
            p.grad.div_(count)
        factor = clip_factor(torch.cat([p.grad.reshape(-1) for p in params]), t["grad_clip"])
        for p in params:
            p.grad.mul_(factor)
        rate = learning_rate(
            step, lr=t["lr"], schedule="cosine", warmup=t["warmup_steps"], total=STEPS,
            min_lr=t["min_lr"],
        )  # fmt: skip
        for group in opt.param_groups:
            group["lr"] = rate
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses[step] = total / count
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(run.losses[step] - loss) <= 1e-6 * loss, (step, run.losses[step], loss)
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    for key, value in model.state_dict().items():  # the same float32 arithmetic: the same bits
        assert torch.equal(trained[key], value), key


def test_gpt2_tied_under_zero3_survives_a_kill(
    configs: dict[str, Path], tmp_path: Path, gpt2_stages: Run
) -> None:
    """ZeRO-3: the two copies of gpt2's tied weight live in different layers, each sharded;
    their gradients are summed before those layers' reduce-scatter, exactly as data parallelism
    sums them, so a kill still leaves the stages' bits (and both copies identical)."""
    zero3 = _launch(configs["gpt2"], tmp_path / "zero3", tmp_path / "s", "--job-id",
                    "gpt2-zero3", "--zero", "3", "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(zero3)
    _same_run(zero3, gpt2_stages)
