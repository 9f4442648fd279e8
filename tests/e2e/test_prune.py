"""Structured pruning (``train.prune``, DHSPG and HESSO) in a real elastic job: a worker
SIGKILLed while groups are being driven to zero changes nothing (float64 mode: the same losses,
sparsity and final state as the fault-free pruned run, and a byte-identical compressed export);
HESSO ends exactly at its target; a run that ends below its target says so in one line; the
compressed Hugging Face model loads with ``from_pretrained`` and gives the sparse model's
outputs; bad input is one line."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import (
    ROOT,
    Run,
    assert_clean_run,
    assert_no_orphans,
    cli,
    elaswave_cmd,
    paced,
)

from elaswave.report import build_report

pytestmark = pytest.mark.e2e

STEPS = 40
TARGET, TOLERANCE = 0.3, 0.05
MLP = {
    "model": {
        "source": "module",
        "factory": "examples.mlp_classifier:mlp_classifier",
        "args": {"features": 16, "hidden": 32, "depth": 2, "classes": 4, "dropout": 0.1},
    },
    "train": {
        "steps": STEPS, "global_batch": 32, "micro_batch_size": 4, "lr": 0.01,
        "reduce_dtype": "float64", "device_time": 0.01,  # the respawned worker joins mid-run
        "prune": {"target_sparsity": TARGET, "tolerance": TOLERANCE, "start_step": 6,
                  "epsilon": 0.95},
    },
    "elastic": {"nproc_per_node": 3, "nnodes": "1:1", "max_restarts": 1},
}  # fmt: skip


GROUPS = 96  # the MLP's hidden channels: 3 families of 32
HESSO_STEPS = 16
HESSO = {
    **MLP,
    "train": {**MLP["train"], "steps": HESSO_STEPS,
              "prune": {"method": "hesso", "target_sparsity": TARGET, "start_step": 3,
                        "pruning_steps": 8, "pruning_periods": 2}},
}  # fmt: skip


def _launch(base: Path, env: dict[str, str], doc: dict, *args: str) -> Run:
    base.mkdir(parents=True, exist_ok=True)
    config = base / "job.yaml"
    config.write_text(yaml.safe_dump(doc))
    cmd = elaswave_cmd("launch", str(config), "--run-dir", str(base / "run"), "--quiet", *args)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(base / "run")


def _sparsity(run: Run) -> dict[int, float | None]:
    return {r["step"]: r["sparsity"] for r in run.metrics}


def _export(run: Run, out: Path, env: dict[str, str], *extra: str) -> str:
    r = cli("export", "--run-dir", str(run.dir), "--out", str(out), *extra, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> Run:
    import os

    base = tmp_path_factory.mktemp("prune-ref")
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state")}
    return _launch(base, env, MLP, "--job-id", "prune-ref")


@pytest.fixture(scope="module")
def pruned_export(pruned: Run, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The fault-free pruned run's compressed export (every kill case compares with it)."""
    import os

    base = tmp_path_factory.mktemp("prune-ref-export")
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state")}
    _export(pruned, base / "b.safetensors", env, "--compress")
    return (base / "b.safetensors").read_bytes()


def test_pruning_reaches_its_target_and_zero_groups_stay_zero(pruned: Run) -> None:
    sparsity = _sparsity(pruned)
    assert all(sparsity[s] is None for s in range(1, 6))  # before pruning: as without it
    curve = [sparsity[s] for s in range(6, STEPS + 1)]
    assert curve == sorted(curve)  # a group once zero stays zero
    assert TARGET <= curve[-1] <= TARGET + TOLERANCE, curve


@pytest.mark.parametrize(
    "strategy",
    [
        [],
        ["--zero", "1"],
        ["--zero", "3"],
        ["--pp", "2", "--nproc-per-node", "4"],
        ["--pp", "2", "--nproc-per-node", "4", "--zero", "1"],
    ],
    ids=["replicated", "zero1", "zero3", "dp2xpp2", "dp2xpp2-zero1"],
)
def test_a_kill_while_pruning_changes_nothing(
    tmp_path: Path, state_env: dict, pruned: Run, pruned_export: bytes, strategy: list[str]
) -> None:
    """Rank 1 SIGKILLed at step 9, pruning under way; it is respawned and receives the
    redundant set from a peer: the same bits as the fault-free pruned run of replicated data
    parallelism on 3 workers (ZeRO-1 prunes the whole parameters after its all-gather; ZeRO-3
    gathers each layer with groups, before and after the update, for the sums, and prunes the
    elements of its shard, whose lost piece comes back from its replicas; two
    pipelines of two stages, ZeRO-1 inside them, add each layer's group sums from its first
    holder and take the same decisions, through the stage's loss, its re-cut and the respawn)."""
    env = paced(state_env, 0.02)  # the respawn rejoins before the end, however busy the CPU
    run = _launch(tmp_path, env, MLP, "--job-id", "prune-kill", *strategy,
                  "--fault", "kill,rank=1,at_step=9")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]
    n = 4 if "--pp" in strategy else 3
    assert [p["world"] for p in run.of("plan_published")] == [n, n - 1, n]
    rejoined = [e for e in run.of("state_synced") if e["epoch"] == 3]
    assert [e["prune_partition_step"] for e in rejoined] == [6] * n  # the newcomer's too
    if "--pp" in strategy:  # pruning reads every layer each step: layers move blocking
        assert {e["migration"] for e in run.of("state_synced") if e["epoch"] > 1} == {"blocking"}
    assert_clean_run(run, STEPS, pruned)
    assert run.losses == pruned.losses
    assert _sparsity(run) == _sparsity(pruned)
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {f[key] for f in pruned.of("final_state")}
    _export(run, tmp_path / "a.safetensors", state_env, "--compress")
    assert (tmp_path / "a.safetensors").read_bytes() == pruned_export
    shapes = json.loads((tmp_path / "a.safetensors.shapes.json").read_text())
    assert shapes["layers.0.0.weight"][0] < 32  # hidden channels removed
    assert_no_orphans(run)


def test_a_resume_mid_pruning_continues_the_same_run(
    tmp_path: Path, state_env: dict, pruned: Run
) -> None:
    """6 steps under ZeRO-3 (the redundant set, chosen at step 6, is saved in the index of the
    final checkpoint, written by every rank; the run ends below its target and says so in one
    line), then ``--resume`` to step 40 on 2 workers under ZeRO-1: the fault-free pruned run's
    steps 7-40 and final state, bit for bit."""
    first = _launch(tmp_path / "a", state_env, {**MLP, "train": {**MLP["train"], "steps": 6}},
                    "--job-id", "prune-res-a", "--zero", "3")  # fmt: skip
    resume = str(first.dir / "checkpoints")
    assert [e["parts"] for e in first.of("final_saved")] == [3]  # a part per rank
    below = build_report(first.dir)["totals"]["prune"]["below_target"]
    assert below == (
        f"train.prune: ended at group sparsity {_sparsity(pruned)[6]:.2f}, below its target "
        f"{TARGET:.2f}: raise train.prune.lmbda (its optimizer's default) or train more steps"
    )
    logged = (first.dir / "daemon.log").read_text().splitlines()
    assert len([line for line in logged if line.endswith(below)]) == 1
    second = _launch(tmp_path / "b", state_env, MLP, "--job-id", "prune-res-b", "--zero", "1",
                     "--nproc-per-node", "2", "--resume", resume)  # fmt: skip
    assert {e["step"] for e in second.of("durable_restored")} == {6}
    assert {e["prune_partition_step"] for e in second.of("state_synced")} == {6}
    later = range(7, STEPS + 1)
    assert [second.losses[s] for s in later] == [pruned.losses[s] for s in later]
    assert [_sparsity(second)[s] for s in later] == [_sparsity(pruned)[s] for s in later]
    assert {f["params_sha256"] for f in second.of("final_state")} == {
        f["params_sha256"] for f in pruned.of("final_state")
    }
    assert build_report(second.dir)["totals"]["prune"]["below_target"] is None


def test_hesso_ends_exactly_at_its_target_and_a_kill_changes_nothing(
    tmp_path: Path, state_env: dict
) -> None:
    """HESSO, two periods of 4 steps from step 3: the sparsity steps up on each period's last
    step and ends at exactly ``ceil(target * groups)`` zero groups. Rank 1 SIGKILLed at step 7,
    the step that picks the second period's groups, under ZeRO-3 (the lost piece comes back
    from its replicas, the newcomer takes the marks from a peer): the fault-free replicated
    run's losses, sparsity and final state, bit for bit."""
    ref = _launch(tmp_path / "ref", state_env, HESSO, "--job-id", "hesso-ref")
    first, total = 14, math.ceil(TARGET * GROUPS)  # picked by the end of periods 1 and 2
    expected = {s: None for s in (1, 2)} | {s: 0.0 for s in range(3, 6)}
    expected |= {s: first / GROUPS for s in range(6, 10)}
    expected |= {s: total / GROUPS for s in range(10, HESSO_STEPS + 1)}
    assert _sparsity(ref) == expected
    assert build_report(ref.dir)["totals"]["prune"]["below_target"] is None
    env = paced(state_env, 0.1)  # the 9 steps after the kill leave the respawn 2 s to rejoin
    run = _launch(tmp_path / "kill", env, HESSO, "--job-id", "hesso-kill", "--zero", "3",
                  "--fault", "kill,rank=1,at_step=7")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]
    assert [p["world"] for p in run.of("plan_published")] == [3, 2, 3]
    rejoined = [e for e in run.of("state_synced") if e["epoch"] == 3]
    assert len({e["prune_partition_step"] for e in rejoined}) == 1  # the newcomer's too
    assert rejoined[0]["prune_partition_step"] in (3, 7)
    assert_clean_run(run, HESSO_STEPS, ref)
    assert run.losses == ref.losses
    assert _sparsity(run) == expected
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {f[key] for f in ref.of("final_state")}
    assert_no_orphans(run)


def test_a_compressed_llama_loads_and_matches_the_sparse_one(
    tmp_path: Path, state_env: dict
) -> None:
    import torch
    import transformers

    doc = {
        "model": {
            "source": "hf", "seq_len": 16,
            "hf": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "vocab_size": 128},
        },
        "train": {
            "steps": 20, "global_batch": 8, "micro_batch_size": 2, "lr": 0.01,
            "prune": {"target_sparsity": 0.5, "start_step": 5, "epsilon": 0.95,
                      "uniform": True},
        },
        "elastic": {"nproc_per_node": 2, "nnodes": "1:1", "max_restarts": 0},
    }  # fmt: skip
    run = _launch(tmp_path, state_env, doc, "--job-id", "prune-llama")
    _export(run, tmp_path / "full", state_env)
    said = _export(run, tmp_path / "small", state_env, "--compress")
    full = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    small = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "small"))
    assert small.config.intermediate_size < 64
    assert small.num_parameters() < full.num_parameters()
    # the report: parameters, and the matrix FLOPs per token of the models as they load
    flops = [2 * sum(m.weight.numel() for m in x.modules() if isinstance(m, torch.nn.Linear))
             for x in (full, small)]  # fmt: skip
    expect = f"{flops[1]:,} matrix FLOPs per sample or token of {flops[0]:,}"
    assert expect in " ".join(said.split()), said
    assert f"{small.num_parameters():,} parameters of {full.num_parameters():,}" in said
    # and one forward of a micro-batch of the run's data, timed before and after (its ratio is
    # the benchmark's to show: bench prune)
    assert re.search(r"CPU latency \(one thread, a 2×16 micro-batch, median of 20\): "
                     r"[0-9.]+ ms of [0-9.]+ ms", " ".join(said.split())), said  # fmt: skip
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(small(ids).logits, full(ids).logits, rtol=0, atol=1e-5)


def test_compress_on_a_run_without_pruning_is_one_line(tmp_path: Path, state_env: dict) -> None:
    doc = {**MLP, "train": {k: v for k, v in MLP["train"].items() if k != "prune"}}
    doc["train"]["steps"] = 2
    doc["elastic"] = {**MLP["elastic"], "nproc_per_node": 1}
    run = _launch(tmp_path, state_env, doc, "--job-id", "no-prune")
    r = cli("export", "--run-dir", str(run.dir), "--out", str(tmp_path / "x"), "--compress",
            env=state_env)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "was not pruned" in lines[0], r.stderr
    assert not (tmp_path / "x").exists()
    r = cli("export", "--run-dir", str(run.dir), "--out", str(tmp_path / "x"), "--pad",
            env=state_env)  # fmt: skip
    assert r.returncode != 0 and not (tmp_path / "x").exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--pad pads the layers of a compressed model" in lines[0], r.stderr


def test_a_model_with_no_groups_is_refused_before_any_worker_starts(
    tmp_path: Path, state_env: dict
) -> None:
    doc = {
        **MLP,
        "model": {"source": "module", "factory": "tests.unit.test_prune_units:one_linear"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    r = cli("launch", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"),
            env=state_env, timeout=60)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no zero-invariant groups" in lines[0], r.stderr
    run = Run(tmp_path / "run")
    assert not run.of("worker_spawned")
    assert_no_orphans(run)
