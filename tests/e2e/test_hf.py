"""Hugging Face causal LMs (``model.source: hf``) trained by real workers on real text.

The token file is this repository's README as bytes (a byte-level vocabulary of 256). In the
deterministic mode (float64 reduction) a llama-style model survives a SIGKILL under replicated
data parallelism and ZeRO-1, and a gpt2-style model — its input embedding and LM head tied, on
different pipeline stages — survives a stage loss in dp=2 × pp=2: every loss and the final state
bit-identical to the fault-free run, every step recorded once. The gpt2 pipeline run also gives
the same bits as replicated data parallelism, and both copies of its tied weight are identical
in its final durable checkpoint.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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
            "data": {"source": "tokens", "path": str(tokens), "dtype": "uint16"},
            "train": {"steps": STEPS, "global_batch": 16, "micro_batch_size": 2, "lr": 0.003,
                      "seed": 5},
            "elastic": {"nproc_per_node": 4, "nnodes": "1:1", "max_restarts": 0},
        }  # fmt: skip
        out[family] = base / f"{family}.yaml"
        out[family].write_text(yaml.safe_dump(cfg))
    return out


def _launch(config: Path, run_dir: Path, state: Path, *args: str) -> Run:
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(state), **F64}
    cmd = elaswave_cmd("launch", str(config), "--run-dir", str(run_dir), "--quiet", *args)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(run_dir)


def _same_run(run: Run, reference: Run) -> None:
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
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


@pytest.mark.parametrize("strategy", [[], ["--zero", "1"]], ids=["replicated", "zero1"])
def test_llama_survives_a_kill_bit_identical(
    configs: dict[str, Path], llama_reference: Run, tmp_path: Path, strategy: list[str]
) -> None:
    run = _launch(configs["llama"], tmp_path / "run", tmp_path / "state", "--job-id",
                  "llama-kill", *strategy, "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(run)
    _same_run(run, llama_reference)


def test_gpt2_tied_across_stages_survives_a_stage_loss(
    configs: dict[str, Path], tmp_path: Path
) -> None:
    from elaswave.config import load_config
    from elaswave.runtime.durable.checkpoints import latest, load
    from elaswave.runtime.workload.load import build_model, load_workload

    dp = _launch(configs["gpt2"], tmp_path / "dp", tmp_path / "s0", "--job-id", "gpt2-dp")
    flags = ["--pp", "2", "--dp", "2", "--durable-every", str(STEPS)]
    pp = _launch(configs["gpt2"], tmp_path / "pp", tmp_path / "s1", "--job-id", "gpt2-pp", *flags)
    _same_run(pp, dp)  # stages and replicas: the same bits as replicated data parallelism
    killed = _launch(configs["gpt2"], tmp_path / "kill", tmp_path / "s2", "--job-id", "gpt2-kill",
                     *flags, "--fault", "kill,rank=1,at_step=6")  # fmt: skip
    _killed(killed)
    _same_run(killed, dp)
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
