"""The worker template and what the daemon decides about it, without etcd.

The protocol runs against a real template process; the daemon side runs in a child interpreter
(it makes its process a child subreaper, which the test runner's own process should not become).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from elaswave.daemon.template import (
    BACKWARD_PRELOADS,
    OPTIM_PRELOADS,
    Template,
    builds_torch_optimizers,
    hf_model_type,
    preloads,
)
from elaswave.runtime.device import Accelerators, may_have_accelerators, probe_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("source", "zero", "modules"),
    [
        ("gpt", 0, []),
        ("module", 1, []),
        ("hf", 0, ["elaswave.runtime.workload.hf"]),
        ("gpt", 3, ["torch.fx.experimental.symbolic_shapes"]),
        ("hf", 3, ["elaswave.runtime.workload.hf", "torch.fx.experimental.symbolic_shapes"]),
        ("timm", 0, ["elaswave.runtime.workload.module", "timm"]),
        ("torchvision", 0, ["elaswave.runtime.workload.module", "torchvision"]),
    ],
)
def test_preloads_follow_the_workload_source(source: str, zero: int, modules: list[str]) -> None:
    assert preloads(source, zero) == modules


@pytest.mark.parametrize(
    ("zero", "torch_optim", "modules"),
    [
        (0, False, []),
        (0, True, ["torch._dynamo"]),  # what Optimizer's constructor imports
        (3, True, ["torch.fx.experimental.symbolic_shapes", "torch._dynamo"]),
    ],
)
def test_torch_optimizers_preload_what_each_worker_would_import(
    zero: int, torch_optim: bool, modules: list[str]
) -> None:
    assert preloads("gpt", zero, torch_optim=torch_optim) == modules


@pytest.mark.parametrize(
    ("script", "optimizer", "lr_schedule", "builds"),
    [
        (False, "adamw", "cosine", False),  # the runtime's own update
        (True, "adamw", "constant", True),  # a script's loop builds its own
        (False, "torch.optim.RMSprop", "constant", True),
        (False, "sgd", "torch.optim.lr_scheduler.OneCycleLR", True),
    ],
)
def test_which_jobs_build_torch_optimizers(
    script: bool, optimizer: str, lr_schedule: str, builds: bool
) -> None:
    got = builds_torch_optimizers(script=script, optimizer=optimizer, lr_schedule=lr_schedule)
    assert got is builds


def test_the_optimizer_preload_is_what_building_one_imports() -> None:
    """In a fresh interpreter, building a torch.optim optimizer imports every module of
    OPTIM_PRELOADS and BACKWARD_PRELOADS: the preload is not a guess."""
    code = (
        "import sys, torch; torch.optim.AdamW([torch.zeros(1, requires_grad=True)]); "
        f"print(all(m in sys.modules for m in {[*OPTIM_PRELOADS, *BACKWARD_PRELOADS]!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize(
    ("model_type", "family"),
    [("llama", ["transformers.models.llama.modeling_llama"]),
     ("gpt_neox", ["transformers.models.gpt_neox.modeling_gpt_neox"]),
     ("xlm-roberta", ["transformers.models.xlm_roberta.modeling_xlm_roberta"]),
     ("", []), ("../evil", []), ("Llama", [])],
)  # fmt: skip
def test_an_hf_model_s_family_module_is_preloaded(model_type: str, family: list[str]) -> None:
    assert preloads("hf", 0, model_type) == ["elaswave.runtime.workload.hf", *family]
    assert preloads("gpt", 0, model_type) == []  # only for a Hugging Face workload


def test_the_preloaded_family_module_is_where_transformers_has_it() -> None:
    (_, module) = preloads("hf", 0, "llama")
    assert importlib.util.find_spec(module) is not None


def test_hf_model_type_from_the_config_or_the_pretrained_directory(tmp_path: Path) -> None:
    assert hf_model_type({"model_type": "qwen2", "hidden_size": 8}, None) == "qwen2"
    assert hf_model_type({}, None) == ""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert hf_model_type({}, str(tmp_path)) == "gpt2"
    assert hf_model_type({}, str(tmp_path / "missing")) == ""
    assert hf_model_type({"model_type": "llama"}, str(tmp_path / "missing")) == "llama"


def test_configure_asks_the_template_for_the_jobs_preloads(tmp_path: Path) -> None:
    """A template started before the job is known is told its log, then what to import."""
    stdin = io.BytesIO()
    early = tmp_path / "early.log"
    early.touch()
    template = Template(SimpleNamespace(stdin=stdin), early)  # type: ignore[arg-type]
    template.configure(model_source="hf", log_path=tmp_path / "run" / "template.log",
                       device_env={}, zero=3)  # fmt: skip
    sent = [json.loads(line) for line in stdin.getvalue().splitlines()]
    assert sent == [
        {"op": "log", "path": str(tmp_path / "run" / "template.log")},
        {"op": "preload", "modules": preloads("hf", 3)},
    ]
    assert template.log_path == tmp_path / "run" / "template.log" and not early.exists()


@pytest.mark.parametrize(
    ("entries", "may"),
    [
        ([], False),
        (["null", "tty0", "shm", "fuse"], False),
        (["nvidia0", "nvidiactl"], True),
        (["nvidiactl", "nvidia-uvm"], False),  # the driver without a device
        (["dxg"], True),  # CUDA under WSL2
        (["kfd", "dri"], True),  # ROCm
        (["davinci3", "davinci_manager"], True),  # Ascend
    ],
)
def test_accelerator_nodes(entries: list[str], may: bool) -> None:
    assert may_have_accelerators(entries) is may


def test_worker_environments() -> None:
    """One OpenMP thread unless set, no etcd credentials; NCCL's settings only off the CPU,
    never over the user's."""
    from elaswave.daemon.workers import base_environment, device_environment

    user = {"PATH": "/bin", "ELASWAVE_ETCD_PASSWORD": "x", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    base = base_environment(user)
    assert base == {"PATH": "/bin", "TORCH_NCCL_BLOCKING_WAIT": "1", "OMP_NUM_THREADS": "1"}
    assert base_environment({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert device_environment("cpu", user) == {}
    extra = device_environment("cuda", user)
    assert extra and "TORCH_NCCL_BLOCKING_WAIT" not in extra
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in extra


def test_auto_on_a_host_without_accelerator_nodes_imports_no_torch(tmp_path: Path) -> None:
    (tmp_path / "null").touch()
    code = textwrap.dedent(f"""
        import sys
        from elaswave.runtime.device import probe_for
        found = probe_for("auto", dev={str(tmp_path)!r})
        print(found.cuda, found.npu, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0", "False"]
    assert probe_for("cpu") == Accelerators()


def test_the_launch_side_imports_no_torch() -> None:
    """What ``launch`` and its daemon import: no torch (the template has it)."""
    code = textwrap.dedent("""
        import sys
        import elaswave.cli.app, elaswave.daemon.launch, elaswave.data.checks
        import elaswave.runtime.durable.layout, elaswave.export
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


DAEMON_SIDE = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from pathlib import Path
    from elaswave.config import JobConfig
    from elaswave.daemon.template import Template, TemplateGone
    from elaswave.daemon.workers import base_environment

    async def main(tmp):
        out = {}
        t = Template.start(env=base_environment(), log_path=tmp / "early.log")
        t.configure(model_source="gpt", log_path=tmp / "template.log",
                    device_env={})
        out["ready"] = await t.ready(120) > 0
        out["early_log_gone"] = not (tmp / "early.log").exists()
        good = JobConfig.from_dict({}).to_dict()
        out["good"] = await t.preflight(good, 60)
        bad = JobConfig.from_dict({"model": {"source": "module",
            "factory": "examples.mlp_classifier:mlp_classifier", "args": {"width": -1}}})
        out["bad"] = await t.preflight(bad.to_dict(), 60)
        procs = []
        for i in range(3):
            argv = ["--control", str(tmp / "none.sock"), "--worker-id", f"w{i}"]
            p, _ = await t.spawn("worker", argv, tmp / f"w{i}.log", timeout=60)
            procs.append(p)
        out["codes"] = [await asyncio.wait_for(p.wait(), 60) for p in procs]
        store, answer = await t.spawn("store", ["--host", "127.0.0.1"], tmp / "store.log",
                                      timeout=60)
        out["store_parent"] = int(open(f"/proc/{store.pid}/stat").read().rsplit(")")[1].split()[1])
        import torch.distributed as dist
        client = dist.TCPStore("127.0.0.1", answer["port"], is_master=False)
        client.set("k", "v")
        out["store"] = client.get("k").decode()
        store.terminate()
        out["store_code"] = await asyncio.wait_for(store.wait(), 30)
        await t.warm(60)
        victim, _ = await t.spawn("worker", ["--control", "x", "--worker-id", "v"],
                                  tmp / "v.log", timeout=60)
        victim.kill()
        out["killed"] = await asyncio.wait_for(victim.wait(), 30)
        os.kill(t.pid, signal.SIGKILL)
        t.proc.wait()
        try:
            await t.spawn("worker", ["--control", "x", "--worker-id", "late"], tmp / "l.log",
                          timeout=10)
            out["gone"] = None
        except TemplateGone as exc:
            out["gone"] = str(exc)
        out["me"] = os.getpid()
        print(json.dumps(out))

    asyncio.run(main(Path(sys.argv[1])))
""")


def test_template_forks_adopted_workers_and_a_store(tmp_path: Path) -> None:
    """Workers forked through the template are the daemon's children (their exit codes and
    signals come through), the store serves a real TCPStore, the preflight check answers
    one line, and a dead template is reported, not waited for."""
    r = subprocess.run(
        [sys.executable, "-c", DAEMON_SIDE, str(tmp_path)], cwd=ROOT, capture_output=True,
        text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ready"] and out["good"] is None
    assert out["early_log_gone"]  # the template started before the run directory moved to it
    assert out["bad"].startswith("model.factory 'examples.mlp_classifier:mlp_classifier'")
    assert out["store_parent"] == out["me"]  # adopted by the daemon, not the template's child
    assert out["codes"] == [1, 1, 1]  # no daemon socket: each worker exits 1, seen through waitpid
    for i in range(3):
        assert "No such file or directory" in (tmp_path / f"w{i}.log").read_text()
    assert out["store"] == "v" and out["store_code"] == 0
    assert out["killed"] == -9
    assert out["gone"] is not None and "killed by SIGKILL" in out["gone"]
