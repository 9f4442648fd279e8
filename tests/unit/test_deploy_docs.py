"""docs/deploy.md's recipes, checked without a cluster: the Slurm scripts run with Slurm's
commands, etcd and elaswave stood in for (the real Slurm runs them in tests/e2e/test_slurm.py),
the Kubernetes manifests parse, and every launch flag and ``ELASWAVE_*`` variable in them is one
ElasWave reads."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from elaswave.cli.app import app
from elaswave.config import load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def _launch_flags() -> set[str]:
    text = CliRunner().invoke(app, ["launch", "--help"], terminal_width=200).output
    return set(re.findall(r"--[a-z][a-z-]+", text))


# Slurm's commands, etcd and elaswave stood in for: srun runs its command once per node (one
# after the other) with the node's SLURMD_NODENAME, as Slurm would; each command is logged.
SRUN = """#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"srun": opts, "command": args}) + "\\n")
listed = opts.get("--nodelist")
nodes = listed.split(",") if listed else [f"n{i}" for i in range(1, int(opts["--nodes"]) + 1)]
codes = [subprocess.run(args, env={**os.environ, "SLURMD_NODENAME": n}).returncode for n in nodes]
sys.exit(max(codes))
"""
LOGGED = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"%s": sys.argv[1:], "node": os.environ.get("SLURMD_NODENAME")}) + "\\n")
if "--run-dir" in sys.argv:  # a launch makes its run directory
    os.makedirs(sys.argv[sys.argv.index("--run-dir") + 1], exist_ok=True)
fail = dict(x.split(":") for x in os.environ.get("STANDIN_FAIL", "").split(",") if x)
sys.exit(int(fail.get(os.environ.get("SLURMD_NODENAME"), 0)))
"""


def _run_slurm_script(name: str, tmp_path: Path, *args: str, fail: str = "", node: str = ""):
    """The docs' script ``name`` run in ``tmp_path`` with the stand-ins; (result, log)."""
    (script,) = [b for b in _blocks("bash") if f"#SBATCH --job-name={name}\n" in b]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_ins = {
        "srun": SRUN, "etcd": LOGGED % "etcd", "elaswave": LOGGED % "elaswave",
        "scontrol": "#!/bin/sh\nprintf 'n1\\nn2\\nn3\\nn4\\n'\n", "sleep": "#!/bin/sh\n",
    }  # fmt: skip
    for cmd, text in stand_ins.items():
        (bin_dir / cmd).write_text(text)
        (bin_dir / cmd).chmod(0o755)
    log = tmp_path / f"{name}.log"
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "77", "SLURM_NNODES": "4",
           "PATH": f"{bin_dir}:/usr/bin:/bin", "STANDIN_LOG": str(log),
           "STANDIN_FAIL": fail}  # fmt: skip
    if node:
        env["SLURMD_NODENAME"] = node
    ran = subprocess.run(["bash", "-c", script + "\nwait", name, *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return ran, [json.loads(line) for line in log.read_text().splitlines()]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_slurm_script_starts_etcd_on_three_nodes_and_a_launch_per_node(
    tmp_path: Path,
) -> None:
    ran, log = _run_slurm_script("elaswave", tmp_path)
    assert ran.returncode == 0, ran.stderr
    steps = {"etcd" if "exec etcd" in e["command"][-1] else "launch": e["srun"] for e in log
             if "srun" in e}  # fmt: skip
    etcd_step, launch_step = steps["etcd"], steps["launch"]
    # the etcd step shares the nodes and survives a node's loss; its task count is its own
    assert {"--overlap", "--no-kill"} <= set(etcd_step), etcd_step
    assert etcd_step["--ntasks"] == "3" and etcd_step["--nodelist"] == "n1,n2,n3"
    assert launch_step["--no-kill"] == "" and launch_step["--kill-on-bad-exit"] == "0"
    etcd = {e["node"]: e["etcd"] for e in log if "etcd" in e}
    assert sorted(etcd) == ["n1", "n2", "n3"]
    for node, argv in etcd.items():
        assert _flag(argv, "--name") == node
        assert _flag(argv, "--data-dir") == f"runs/slurm-77/etcd/{node}"
        assert _flag(argv, "--initial-cluster") == (
            "n1=http://n1:2380,n2=http://n2:2380,n3=http://n3:2380"
        )
    launches = {e["node"]: e["elaswave"] for e in log if "elaswave" in e}
    assert sorted(launches) == ["n1", "n2", "n3", "n4"]
    for node, argv in launches.items():
        assert argv[:2] == ["launch", "job.yaml"]
        assert _flag(argv, "--host-id") == node  # the docs: host ids are the node names
        assert _flag(argv, "--run-dir") == f"runs/slurm-77/{node}"  # one run directory each
        assert _flag(argv, "--job-id") == "slurm-77"
        assert _flag(argv, "--etcd") == "n1:2379,n2:2379,n3:2379"
        assert _flag(argv, "--nnodes") == "3:4"
        assert _flag(argv, "--durable-dir") == "runs/slurm-77/checkpoints"  # shared, per job
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= _launch_flags(), flags - _launch_flags()
    codes = {
        p.parent.name: p.read_text().strip() for p in (tmp_path / "runs").glob("*/*/exit-code")
    }
    assert codes == dict.fromkeys(launches, "0")


@pytest.mark.parametrize(
    ("fail", "code"),
    [("n2:137", 0), ("n1:137,n2:137,n3:137,n4:137", 1), ("n1:4,n2:4,n3:4,n4:4", 1)],
)
def test_the_slurm_job_succeeds_when_any_launch_does(tmp_path: Path, fail: str, code: int) -> None:
    """A launch exits 0 exactly when the job committed its last step: one launch killed leaves
    the job COMPLETED; every launch failing fails it."""
    ran, _ = _run_slurm_script("elaswave", tmp_path, fail=fail)
    assert ran.returncode == code, ran.stderr


def test_the_join_script_launches_one_more_host_of_the_running_job(tmp_path: Path) -> None:
    _, main = _run_slurm_script("elaswave", tmp_path)
    ran, log = _run_slurm_script("elaswave-join", tmp_path, "77", node="n5")
    assert ran.returncode == 0, ran.stderr
    (joining,) = [e["elaswave"] for e in log if "elaswave" in e]
    first = next(e["elaswave"] for e in main if "elaswave" in e)
    assert _flag(joining, "--host-id") == "n5"
    assert _flag(joining, "--run-dir") == "runs/slurm-77/n5"

    def same(argv: list[str]) -> list[str]:  # the launch's flags but its own name and directory
        out = list(argv)
        for name in ("--host-id", "--run-dir"):
            del out[out.index(name) : out.index(name) + 2]
        return out

    assert same(joining) == same(first)


def test_the_manual_recipe_uses_launch_flags_only() -> None:
    (manual,) = [b for b in _blocks("bash") if "on every training host" in b]
    ran = subprocess.run(["bash", "-n"], input=manual, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    launch = manual.split("elaswave launch", 1)[1].split("\n\n")[0]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", launch))
    assert {"--etcd", "--host-id", "--host-addr", "--nnodes"} <= flags <= _launch_flags()


def test_the_kubernetes_manifests_parse_and_speak_elaswave() -> None:
    (manifests,) = _blocks("yaml")
    docs = list(yaml.safe_load_all(manifests))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "StatefulSet"]
    job = yaml.safe_load(docs[0]["data"]["job.yaml"])
    (container,) = docs[1]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["elaswave", "launch"]
    flags = {a for a in container["args"] if a.startswith("--")}
    assert flags <= _launch_flags(), flags - _launch_flags()
    env = {
        e["name"]: e.get("value", "x")
        for e in container["env"]
        if e["name"].startswith("ELASWAVE_")
    }
    cfg = load_config(None, env=env, overrides={})  # every variable is a config key
    assert cfg.etcd == ["etcd-0.etcd:2379", "etcd-1.etcd:2379", "etcd-2.etcd:2379"]
    assert job["elastic"]["nnodes"] == "3:4"
