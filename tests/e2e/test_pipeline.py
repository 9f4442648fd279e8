"""Data × pipeline parallelism: a lost stage is taken over by its replica's surviving stages.

Real etcd, real worker processes, real SIGKILL, gloo point-to-point between stages. Every run is
compared with the fault-free data-parallel run of the same model (the ``reference`` and
``float64_runs`` fixtures): pipelining changes who computes what, never the global batch or the
per-sample randomness.
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import pytest
from conftest import (
    F64,
    Float64Runs,
    Run,
    assert_clean_run,
    assert_groups_edited,
    assert_no_orphans,
    launch,
    paced,
    pipeline_groups,
)

from elaswave.errors import JobStopped
from elaswave.report import build_report

STEPS = 16


def _pipeline_plans(run: Run) -> list[dict]:
    return [e for e in run.of("plan_published") if "bounds" in e]


def _check_layout(plan: dict, layers: int) -> None:
    """Every replica's stages own contiguous, non-empty layer ranges covering every layer once."""
    assert len(plan["replicas"]) == len(plan["bounds"])
    for ranks, cut in zip(plan["replicas"], plan["bounds"], strict=True):
        assert len(cut) == len(ranks) + 1
        assert cut[0] == 0 and cut[-1] == layers
        assert all(a < b for a, b in zip(cut, cut[1:], strict=False)), cut


def _redid_the_damaged_replicas(run: Run, plan: dict, dead: set[str]) -> list[list[int]]:
    """The step interrupted before ``plan`` was redone in part: every rank agrees on what each
    replica computes again, and that is exactly the micro-batches of the replicas that lost a
    rank (the intact ones finished theirs before the fault was reported: ``detect_delay``).
    Returns the redo shares by replica."""
    before = next(p for p in _pipeline_plans(run) if p["epoch"] == plan["epoch"] - 1)
    shares = [before["microbatches"][ranks[0]] for ranks in before["replicas"]]
    starts = list(accumulate(shares, initial=0))
    damaged = [d for d, ranks in enumerate(before["replicas"])
               if {before["workers"][r] for r in ranks} & dead]  # fmt: skip
    lost = sorted(i for d in damaged for i in range(starts[d], starts[d] + shares[d]))
    synced = [e for e in run.of("state_synced") if e["epoch"] == plan["epoch"]]
    assert len(synced) == plan["world"], "every rank reports its sync"
    (redo,) = {json.dumps(e.get("redo_replicas")) for e in synced}
    redone = json.loads(redo)
    assert redone is not None, "the whole step was computed again"
    assert sorted(i for share in redone for i in share) == lost, (redone, lost)
    return redone


def _bit_identical_to_data_parallel(
    float64_runs: Float64Runs,
    tmp_path: Path,
    env: dict,
    steps: int,
    *args: str,
    settings: dict[str, str] | None = None,
) -> tuple[Run, Run]:
    """The pipelined job ``args`` in the deterministic mode (float64 reduction) and the
    fault-free data-parallel run of the same ``steps`` and ``settings`` (environment overrides
    both runs take); every loss, the final parameters and the final optimizer state (assembled
    from the stages) must be bit-identical. ``env`` is the pipelined job's own (its pacing, its
    emulated links: what sets when things happen, never a value). Returns both runs."""
    dp = float64_runs(steps, settings)
    env = {**env, **F64, **(settings or {})}
    r = launch(tmp_path / "pp", "--steps", str(steps), *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "pp")
    assert_clean_run(run, steps, dp)
    assert run.losses == dp.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {f[key] for f in dp.of("final_state")}
    return run, dp


def test_stage_loss_async_then_second_fault(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """dp=2 × pp=2: kill replica 0's stage 1, later replica 1's stage 0. Both replicas stay in
    service; the first takeover's layers migrate in the background."""
    r = launch(
        tmp_path / "run", "--job-id", "pp-async", "--pp", "2", "--steps", str(STEPS),
        "--migration", "async",
        "--fault", "kill,rank=1,at_step=5", "--fault", "kill,rank=2,at_step=11",
        env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, reference)
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [4, 3, 2]
    for p in plans:
        _check_layout(p, layers=4)
    # After the first loss the survivor of replica 0 holds every layer; replica 1 is untouched.
    assert plans[1]["bounds"] == [[0, 4], [0, 2, 4]]
    assert len(plans[1]["replicas"]) == 2, "the damaged replica must stay in service"
    # Each stage's bytes (what its workers reported per layer) within the cap the cut held
    # them to: 1.1 × an even share of the model's (some cut of this model meets it).
    sizes = plans[0]["layer_bytes"]
    assert len(sizes) == 4 and all(b > 0 for b in sizes)
    for p in plans:
        for cut, cap in zip(p["bounds"], p["stage_bytes_cap"], strict=True):
            assert cap == pytest.approx(1.1 * sum(sizes) / (len(cut) - 1))
            assert all(sum(sizes[a:b]) <= cap for a, b in zip(cut, cut[1:], strict=False))
    synced = [e for e in run.of("state_synced") if e["epoch"] == plans[1]["epoch"]]
    assert {e["migration"] for e in synced} == {"async"}
    assert all(e["serving"] == [False, True] for e in synced)  # out of service while migrating
    done = [e for e in run.of("migration_done") if e["epoch"] == plans[1]["epoch"]]
    assert len(done) == 1 and done[0]["step"] < 11
    assert all(f["holders_agree"] for f in run.of("final_state"))
    # The world shrank but the global batch did not: every step covered every micro-batch.
    assert {m["samples"] for m in run.metrics if m["step"] == STEPS} == {STEPS * 32}


def test_middle_stage_loss_blocking_is_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs
) -> None:
    """dp=2 × pp=3: the middle stage of replica 0 dies; its layers are split over the two
    surviving stages with a blocking migration. In the deterministic mode (float64 reduction)
    every loss and the final model are bit-identical to a fault-free data-parallel run. The
    layers travel over an emulated 20 MB/s link: receivers wait at least bytes / bandwidth."""
    env = {**state_env, "ELASWAVE_TRAIN__STATE_BANDWIDTH": "20"}
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, env, 8, "--job-id", "pp-mid", "--pp", "3",
        "--nproc-per-node", "6", "--migration", "blocking",
        "--fault", "kill,rank=1,at_step=4,detect_delay=1",
    )  # fmt: skip
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [6, 5]
    for p in plans:
        _check_layout(p, layers=4)
    assert [len(r) for r in plans[1]["replicas"]] == [2, 3]
    # Replica 0's micro-batches are computed again, by both replicas (by their new shares);
    # its first stage kept its layers and its sums, so it adds none of those again.
    _redid_the_damaged_replicas(run, plans[1], {plans[0]["workers"][1]})
    synced = [e for e in run.of("state_synced") if e["epoch"] == plans[1]["epoch"]]
    assert synced[0]["kept_microbatches"][plans[0]["workers"][0]] == 8
    assert {e["migration"] for e in synced} == {"blocking"}
    moved = synced[0]["layer_transfers"]
    assert moved and all(t["dst"] in (0, 1) for t in moved)  # replica 0's survivors receive
    receivers = [e for e in synced if e["bytes_received"]]
    assert receivers and all(
        e["migration_seconds"] >= e["bytes_received"] / 20e6 for e in receivers
    ), receivers
    # The rank died before the reduction, after every collective it shared with the others,
    # and its death is reported a second late (``detect_delay``), so every survivor has issued
    # the step's reductions by then (a survivor still computing when the plan came would not
    # issue them while its partner did: a group rightly rebuilt, but not the case under test).
    # The holder sets that both layouts have keep their groups; only the new ones are built.
    assert_groups_edited(run, *plans)
    kept = pipeline_groups(plans[0]) & pipeline_groups(plans[1])
    assert {kind for kind, _ in kept} == {"grad"}, kept


@pytest.mark.parametrize("reduce", ["holders", "all"])
def test_clipping_by_the_global_norm_across_stages_is_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs, reference: Run, reduce: str
) -> None:
    """dp=2 × pp=2 with gradient clipping: each rank adds the squared norms of the layers it is
    the first holder of and one all-reduce sums them, in layer order; a stage dies and its
    layers migrate in the background (the whole model's gradient is all-reduced meanwhile).
    Every loss and the final state stay bit-identical to data parallelism with the same clip,
    whether gradients are summed among holders or (``grad_reduce: all``, the comparison mode
    of ``bench gradstep``) over every rank."""
    settings = {"ELASWAVE_TRAIN__GRAD_CLIP": "0.25", "ELASWAVE_GRAD_REDUCE": reduce}
    run, dp = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, state_env, 8, "--job-id", "pp-clip", "--pp", "2",
        "--migration", "async", "--fault", "kill,rank=1,at_step=4,detect_delay=1",
        settings=settings,
    )  # fmt: skip
    # Only replica 0's micro-batches ran again, all on replica 1 (replica 0's survivor waits
    # for its layers), in the mode that sums over every rank too.
    plans = _pipeline_plans(run)
    assert _redid_the_damaged_replicas(run, plans[1], {plans[0]["workers"][1]})[0] == []
    # the clip binds: training differs from the run without it (by about 1e-4 at step 6, where
    # the float32 reference and this float64 run differ by about 1e-7 without a clip)
    assert abs(run.losses[6] - reference.losses[6]) > 3e-5 * reference.losses[6]
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert {e["migration"] for e in synced} == {"async"}
    first = [e for e in run.of("state_synced") if e["epoch"] == 1]
    dp_memory = build_report(dp.dir)["totals"]["memory"].values()
    (params,) = {m["param_bytes"] for m in dp_memory}  # the whole model, on every dp rank
    whole = 2 * params  # the model's gradient in the float64 reduction
    if reduce == "all":  # one all-reduce of the whole model over the 4 ranks
        assert all(e["grad_groups"] == 1 and e["grad_reduce_bytes"] == whole for e in first)
        assert all(e["grad_sent_bytes"] == round(1.5 * whole) for e in first)
    else:  # a stage's layers among their 2 holders: about half the model each
        assert all(e["grad_reduce_bytes"] < 0.6 * whole for e in first), first


@pytest.mark.parametrize(
    ("zero", "migration"), [("1", "async"), ("1", "blocking"), ("3", "blocking")]
)
def test_zero_inside_stages_survives_two_losses_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs, zero: str, migration: str
) -> None:
    """dp=3 × pp=2 with ZeRO inside the stages: each layer's Adam moments (ZeRO-3: and its
    parameters, between steps) are cut over its three holders and every part is kept by two of
    them. Two ranks die one after the other, the second after its update and before the
    parameter gather (ZeRO-3: before it frees its layers, a step its peers commit);
    nothing is lost, and in the deterministic mode every loss, the final parameters and the
    final optimizer state are bit-identical to a fault-free data-parallel run, whether the lost
    layers and moment parts move in the background or before training resumes."""
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, state_env, 10, "--job-id", "pp-zero", "--pp", "2",
        "--nproc-per-node", "6", "--zero", zero, "--migration", migration,
        "--fault", "kill,rank=1,at_step=4,detect_delay=1",
        "--fault", "kill,rank=3,at_step=7,phase=optimizer",
    )  # fmt: skip
    assert all(f["holders_agree"] for f in run.of("final_state"))
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [6, 5, 4]
    # The first loss: only replica 0's micro-batches are computed again, by the replicas in
    # service (an asynchronous migration takes replica 0 out until its layers arrive).
    redone = _redid_the_damaged_replicas(run, plans[1], {plans[0]["workers"][1]})
    assert (redone[0] == []) == (migration == "async"), redone
    first = [e for e in run.of("state_synced") if e["epoch"] == plans[0]["epoch"]]
    # three holders per layer: each keeps two thirds of its stage's moments (ZeRO-3: and of
    # its parameters), and gathers the other third of the parameters each step
    kept = 12 if zero == "3" else 8
    for e in first:
        assert abs(e["moment_bytes"] - kept * e["held_elements"] * 2 / 3) <= 24, e
        assert abs(e["gather_bytes"] - 4 * e["held_elements"] / 3) <= 8, e
    for plan in plans[1:]:
        synced = [e for e in run.of("state_synced") if e["epoch"] == plan["epoch"]]
        assert {e["migration"] for e in synced} == {migration}
        # ZeRO-1: peers that updated and gathered from the dead rank roll back; ZeRO-3: nothing
        # of the step follows its update, so every survivor committed it
        rolled_back = any(e["rolled_back"] for e in synced)
        assert rolled_back == (plan is plans[2] and zero == "1")
        moved = [m for e in synced for m in e["moment_moves"]]
        assert moved, "the lost rank's parts must come from their second keepers"
        assert sum(e["moment_transfers"] for e in synced) == len(moved)
        if zero == "3":  # no layer is held whole between steps: only the kept parts move
            assert not [m for e in synced for m in e["param_moves"]]
    if migration == "async":
        done = [e for e in run.of("migration_done") if e["epoch"] == plans[1]["epoch"]]
        assert len(done) == 1 and done[0]["step"] < 7  # switched before the second fault
    if zero == "3":  # between steps: only the kept parts, their parameters included
        for m in run.of("memory"):
            assert m["param_bytes"] * 3 <= m["gathered_bytes"] * 2 + 24, m


@pytest.mark.parametrize("zero", ["1", "3"])
def test_zero_inside_two_by_two_stages_redoes_only_the_damaged_replica_blocking(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs, zero: str
) -> None:
    """dp=2 × pp=2 with ZeRO inside the stages and a blocking migration: replica 0's last
    stage dies mid-step; its layers and their moment parts (ZeRO-3: with their parameters)
    reach replica 0's survivor before training resumes, and only replica 0's micro-batches are
    computed again, by both replicas (the intact replica keeps its sums; replica 0's survivor,
    now holding every layer, starts from zero). Bit-identical to data parallelism."""
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, state_env, 8, "--job-id", "pp-zero22", "--pp", "2",
        "--zero", zero, "--migration", "blocking",
        "--fault", "kill,rank=1,at_step=4,detect_delay=1",
    )  # fmt: skip
    assert all(f["holders_agree"] for f in run.of("final_state"))
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [4, 3]
    assert plans[1]["bounds"][0] == [0, 4], "replica 0's survivor holds every layer"
    redone = _redid_the_damaged_replicas(run, plans[1], {plans[0]["workers"][1]})
    assert redone[0] and redone[1], redone  # blocking: replica 0 takes its part at once
    synced = [e for e in run.of("state_synced") if e["epoch"] == plans[1]["epoch"]]
    assert {e["migration"] for e in synced} == {"blocking"}
    assert [m for e in synced for m in e["moment_moves"]], "the lost layers' moments moved"
    kept = synced[0]["kept_microbatches"]
    damaged = {plans[0]["workers"][r] for r in plans[0]["replicas"][0]}
    assert kept == {w: 0 if w in damaged else 8 for w in plans[1]["workers"]}, kept


def test_zero3_inside_stages_through_a_respawn_and_a_hang_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs
) -> None:
    """dp=3 × pp=2 with ZeRO-3 inside the stages: rank 1 is SIGKILLed in step 3 and respawned;
    once it has joined (plan epoch 3) rank 2 hangs from step 8 (killed after 1.5 s, no restart
    left): 6 → 5 → 6 → 5 ranks. The newcomer receives its parts (parameters and moments) from
    the ranks that keep them and gathers its stage's layers for its first step; every loss, the
    final parameters and the final optimizer state are data parallelism's, bit for bit."""
    steps = 14
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, paced(state_env, 0.05), steps, "--job-id", "pp-zero3-join",
        "--pp", "2", "--nproc-per-node", "6", "--zero", "3", "--max-restarts", "1",
        "--fault", "kill,rank=1,at_step=3", "--fault", "hang,rank=2,at_step=8,epoch=3",
        "--hang-timeout", "1.5",
    )  # fmt: skip
    assert all(f["holders_agree"] for f in run.of("final_state"))
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [6, 5, 6, 5]
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9, -9]
    joined = plans[2]
    newcomer = joined["workers"].index(sorted(set(joined["workers"]) - set(plans[1]["workers"]))[0])
    synced = [e for e in run.of("state_synced") if e["epoch"] == joined["epoch"]]
    moves = [m for e in synced for m in e["moment_moves"]]
    assert any(m["dst"] == newcomer for m in moves), "the newcomer's parts are sent to it"
    assert not [m for e in synced for m in e["param_moves"]]  # its layers: the step's gather
    for m in run.of("memory"):  # between steps a rank keeps parts, never more than its stage
        assert 0 < m["param_bytes"] <= m["gathered_bytes"], m


def test_a_stage_budget_no_cut_meets_stops_the_job_in_one_line(
    tmp_path: Path, state_env: dict
) -> None:
    """`max_stage_bytes` below what any cut of the model into two stages needs: the leader
    refuses to plan, the job stops with one line that says why, nothing is left running."""
    r = launch(tmp_path / "run", "--job-id", "pp-budget", "--pp", "2", "--steps", "4",
               env={**state_env, "ELASWAVE_MAX_STAGE_BYTES": "100000"})  # fmt: skip
    assert r.returncode == JobStopped.exit_code, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(
        "elaswave: job stopped: no pipeline plan fits: no cut of 4 layers into 2 stages holds "
        "at most 1e+05 bytes per stage: the smallest largest stage is "
    ), lines
    run = Run(tmp_path / "run")
    assert run.metrics == [] and not run.of("plan_published")
    (refused,) = run.of("plan_refused")
    assert build_report(run.dir)["totals"]["stopped"] == refused["reason"]
    assert_no_orphans(run)


def test_recycle_reroutes_a_lost_stage_to_its_peer_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs
) -> None:
    """dp=2 × pp=2 under ``stage_loss: recycle`` (the ReCycle baseline): replica 0's last stage
    dies in step 4; its micro-batches run on replica 1's last stage, which runs both replicas'
    until the killed worker, respawned, takes a last stage back (its layers sent by the peer).
    Nothing else moves, the cuts and shares stay; every loss and the final model are
    bit-identical to the fault-free data-parallel run (float64 reduction)."""
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, paced(state_env, 0.03), 12, "--job-id", "pp-recycle",
        "--pp", "2", "--stage-loss", "recycle", "--max-restarts", "1",
        "--fault", "kill,rank=1,at_step=4",
    )  # fmt: skip
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [4, 3, 4]
    first, after, back = plans
    w = first["workers"]
    assert [[after["workers"][r] for r in ranks] for ranks in after["replicas"]] == [
        [w[0], w[3]], [w[2], w[3]],
    ]  # fmt: skip
    assert after["bounds"] == back["bounds"] == first["bounds"]
    assert after["microbatches"] == [8, 16, 8] and back["microbatches"] == [8, 8, 8, 8]
    synced = [e for e in run.of("state_synced") if e["epoch"] == after["epoch"]]
    assert synced and not any(e["layer_transfers"] for e in synced)
    (newcomer,) = set(back["workers"]) - set(w)
    assert [[back["workers"][r] for r in ranks] for ranks in back["replicas"]] == [
        [w[0], w[3]], [w[2], newcomer],
    ]  # fmt: skip
    synced = [e for e in run.of("state_synced") if e["epoch"] == back["epoch"]]
    moved = {(t["src"], t["dst"]) for t in synced[0]["layer_transfers"]}
    assert moved == {(back["workers"].index(w[3]), back["workers"].index(newcomer))}


def test_recycle_reroutes_to_the_least_loaded_peer_and_evaluates_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs
) -> None:
    """dp=3 × pp=2 under ``stage_loss: recycle``, evaluating every 3 steps: replica 0's last
    stage dies and replica 1's runs it; then that peer dies too, and replica 2's last stage runs
    the last stage of all three replicas (each lost stage goes to the live peer with the fewest
    roles). Losses, evaluations and the final model bit-identical to data parallelism."""
    settings = {"ELASWAVE_TRAIN__EVAL_EVERY": "3", "ELASWAVE_DATA__EVAL_SAMPLES": "16"}
    run, dp = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, state_env, 10, "--job-id", "pp-recycle3", "--pp", "2",
        "--nproc-per-node", "6", "--stage-loss", "recycle",
        "--fault", "kill,rank=1,at_step=3", "--fault", "kill,rank=3,at_step=6",
        settings=settings,
    )  # fmt: skip
    evals = [(m["step"], m["eval_loss"]) for m in run.evals]
    assert len(evals) == 3 and evals == [(m["step"], m["eval_loss"]) for m in dp.evals]
    plans = _pipeline_plans(run)
    assert [p["world"] for p in plans] == [6, 5, 4]
    w = plans[0]["workers"]
    last = plans[-1]
    assert [[last["workers"][r] for r in ranks] for ranks in last["replicas"]] == [
        [w[0], w[5]], [w[2], w[5]], [w[4], w[5]],
    ]  # fmt: skip
    assert {tuple(b) for p in plans for b in p["bounds"]} == {tuple(plans[0]["bounds"][0])}


@pytest.mark.parametrize(("pp", "lost"), [(3, 1), (4, 4)])
def test_recycle_reroutes_a_deeper_pipeline_bit_identical(
    tmp_path: Path, state_env: dict, float64_runs: Float64Runs, pp: int, lost: int
) -> None:
    """dp=2 × pp=3 and 4 under ``stage_loss: recycle``: rank ``lost`` dies (replica 0's middle
    stage; replica 1's first stage, where one 1F1B order over both replicas would deadlock); the
    same stage of the other replica runs both replicas' micro-batches, one replica's after the
    other's, each between its own replica's neighbours. Losses and the final model
    bit-identical to data parallelism."""
    run, _ = _bit_identical_to_data_parallel(
        float64_runs, tmp_path, state_env, 8, "--job-id", f"pp-recycle-{pp}",
        "--pp", str(pp), "--nproc-per-node", str(2 * pp), "--stage-loss", "recycle",
        "--fault", f"kill,rank={lost},at_step=3",
    )  # fmt: skip
    first, after = _pipeline_plans(run)
    w = first["workers"]
    d, s = divmod(lost, pp)
    expected = [w[:pp], w[pp:]]
    expected[d][s] = w[(1 - d) * pp + s]  # the other replica's rank of that stage
    assert [[after["workers"][r] for r in ranks] for ranks in after["replicas"]] == expected
