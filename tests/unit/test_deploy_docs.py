"""docs/deploy.md's recipes, checked as far as this machine allows: the Slurm script runs with
Slurm's commands stood in for, the Kubernetes manifests parse, and every launch flag and
``ELASWAVE_*`` variable in them is one ElasWave reads."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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


def test_the_slurm_script_starts_etcd_on_three_nodes_and_launches_on_every_node() -> None:
    (script,) = [b for b in _blocks("bash") if "#SBATCH" in b]
    stand_ins = (
        "scontrol() { printf 'n1\\nn2\\nn3\\nn4\\n'; }\n"
        'srun() { echo "srun $*"; }\n'
        "sleep() { :; }\n"
        "wait_all() { wait; }\n"
    )
    body = script.replace("#!/bin/bash\n", "")
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "77", "SLURM_NNODES": "4",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    ran = subprocess.run(
        ["bash", "-c", stand_ins + body + "\nwait"], env=env, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    etcd = [ln for ln in lines if "etcd --name" in ln]
    assert len(etcd) == 1 and "--nodes=3" in etcd[0] and "--nodelist=n1,n2,n3" in etcd[0]
    assert '--initial-cluster "n1=http://n1:2380,n2=http://n2:2380,n3=http://n3:2380"' in ran.stdout
    (launch,) = [ln for ln in lines if "elaswave launch" in ln]
    assert "--etcd n1:2379,n2:2379,n3:2379" in launch and "--nnodes 3:4" in launch
    assert "--job-id slurm-77" in launch
    flags = set(re.findall(r" (--[a-z][a-z-]+)", launch.split("elaswave launch", 1)[1]))
    assert flags and flags <= _launch_flags(), flags - _launch_flags()


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
