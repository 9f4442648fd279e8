"""``layer_costs: online``: the plan after a fault is cut with layer times measured while training.

dp=2 × pp=2 on real worker processes: the first plan uses the workers' start-up profiles; every
stage then times its layers in real steps and reports them every ``cost_every`` steps; after a
SIGKILL the leader's next plan uses those measurements, and training still matches the
fault-free run.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from conftest import CONFIG, Run, assert_clean_run, launch, paced

from elaswave.planning.pipeplan import balanced_shares
from elaswave.runtime.workload.gpt import gpt_layer_costs

STEPS = 16


def test_plan_after_a_fault_uses_online_layer_costs(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    # paced: the reports of steps 4 and 8 reach the leader before the kill at step 12 plans
    # (unpaced, four steps can take less than a report's way through the daemons)
    env = {**paced(state_env, 0.02), "ELASWAVE_LAYER_COSTS": "online", "ELASWAVE_COST_EVERY": "4"}
    r = launch(
        tmp_path / "run", "--job-id", "pp-online", "--pp", "2", "--steps", str(STEPS),
        "--fault", "kill,rank=1,at_step=12",
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, reference)
    plans = run.of("plan_published")
    assert [p["world"] for p in plans] == [4, 3]
    first, second = plans
    # Before any step: the start-up profile.
    assert first["cost_source"] == "profile" and first["measured_layers"] == []
    # After the kill at step 12 (reports at steps 4 and 8): what the stages measured, for every
    # layer (the dead rank's layers were also run by the other replica's stage).
    assert second["cost_source"] == "online"
    assert second["measured_layers"] == [0, 1, 2, 3]
    costs = second["layer_costs"]
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert costs != first["layer_costs"]
    # Seconds, not FLOPs: the measured ratios between layers are not the estimate's (the
    # embedding, a gather, is estimated ~1,700× cheaper than a block; it does not time so).
    model = yaml.safe_load(CONFIG.read_text())["model"]
    estimate = gpt_layer_costs(
        **{k: model[k] for k in ("vocab_size", "seq_len", "d_model", "n_layer")}
    )
    ratios = [c / e for c, e in zip(costs, estimate, strict=True)]
    assert max(ratios) / min(ratios) > 10, (costs, estimate)
    # The survivor of replica 0 took over every layer; the replicas' shares of the global batch
    # balance their step times predicted from the measured costs.
    assert second["bounds"] == [[0, 4], [0, 2, 4]]
    shares = [second["microbatches"][ranks[0]] for ranks in second["replicas"]]
    slowest = [
        max(sum(costs[a:b]) for a, b in zip(cut, cut[1:], strict=False)) for cut in second["bounds"]
    ]
    assert shares == list(balanced_shares(16, slowest, [1, 2]))
