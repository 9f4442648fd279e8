"""What etcd TLS, client certificates and auth cost: etcd round trips and a whole job.

1. etcd round trips through ElasWave's own client (:class:`elaswave.daemon.etcd.Etcd`), against
   one embedded etcd per mode: ``plain`` (no TLS), ``tls`` (TLS, client certificate required),
   ``tls+auth`` (plus etcd auth, a user confined to the job's prefix by the etcdctl recipe of
   ``elaswave etcd-access``). Measured: connect (handshake + authentication), put, get, and a
   compare-and-put transaction, ``OPS`` of each per round.
2. A fault-free gpt-tiny job (``elaswave launch``) on an embedded etcd without and with TLS:
   median step time and total wall time. Training itself never touches etcd; the daemon does
   a few etcd writes per committed step (progress) and keeps its lease alive.

Certificates come from a throwaway CA made with the ``cryptography`` package (the test helper in
tests/e2e/certs.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
    bench_env,
    console,
    elaswave_launch,
    launch_command,
    ms,
    print_table,
    read_jsonl,
    summarize,
)

DESCRIPTION = "etcd TLS + client certs + auth: etcd op latency and fault-free job time vs plain"
DEFAULT_REPEAT = 1
OPS = 200
MODES = ("plain", "tls", "tls+auth")
PASSWORD = "bench-secret"
OP_NAMES = ("connect", "put", "get", "cas")


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-security-"))
    pki = _load_certs().CA(tmp / "pki")
    server, client = pki.issue("etcd-server", server=True), pki.issue("root")
    ops: dict[str, dict[str, list[float]]] = {m: {k: [] for k in OP_NAMES} for m in MODES}
    for i in range(1, repeat + 1):
        for mode in MODES:
            samples = _etcd_round(mode, pki, server, client)
            for k in OP_NAMES:
                ops[mode][k] += samples[k]
            console.print(
                f"round {i}/{repeat}, {mode}: put median {ms(statistics.median(samples['put']), 2)}"
                f" ms; load {os.getloadavg()[0]:.1f}"
            )
    jobs: dict[str, list[dict[str, float]]] = {"plain": [], "tls": []}
    tls_args = [
        "--etcd-cacert",
        str(pki.cert),
        "--etcd-cert",
        str(client.cert),
        "--etcd-key",
        str(client.key),
        "--etcd-server-cert",
        str(server.cert),
        "--etcd-server-key",
        str(server.key),
    ]
    env = bench_env(tmp / "state")
    for i in range(1, repeat + 1):
        for mode, extra in (("plain", []), ("tls", tls_args)):
            run_dir = tmp / f"{mode}-{i}"
            began, ended = elaswave_launch(
                config, run_dir, f"bench-sec-{os.getpid()}-{i}", env=env, extra_args=extra
            )
            steps = [m["step_seconds"] for m in read_jsonl(run_dir / "metrics.jsonl")]
            jobs[mode].append(
                {"wall_s": ended - began, "step_s": statistics.median(s for s in steps if s)}
            )
            console.print(
                f"round {i}/{repeat}, job {mode}: {ended - began:.1f} s, median step "
                f"{ms(jobs[mode][-1]['step_s'])} ms; load {os.getloadavg()[0]:.1f}"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": "security",
        "repeat": repeat,
        "ops_per_round": OPS,
        "etcd_ops": {m: {k: summarize(v) for k, v in ops[m].items()} for m in MODES},
        "etcd_ops_p90": {m: {k: _p90(v) for k, v in ops[m].items()} for m in MODES},
        "jobs": {
            m: {k: summarize(r[k] for r in runs) for k in ("wall_s", "step_s")}
            for m, runs in jobs.items()
        },
        "command_plain": launch_command(config),
        "command_tls": launch_command(
            config,
            [
                "--etcd-cacert CA --etcd-cert C --etcd-key K",
                "--etcd-server-cert S --etcd-server-key SK",
            ],
        ),
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for mode in MODES:
        med, p90 = result["etcd_ops"][mode], result["etcd_ops_p90"][mode]
        rows.append([mode] + [f"{ms(med[k]['median'], 2)} / {ms(p90[k], 2)}" for k in OP_NAMES])
    print_table("etcd round trips, ms (median / p90)", ["mode", *OP_NAMES], rows)
    jobs = result["jobs"]
    print_table(
        "fault-free gpt-tiny job (median over rounds)",
        ["etcd", "wall s", "median step ms"],
        [[m, f"{jobs[m]['wall_s']['median']:.1f}", ms(jobs[m]["step_s"]["median"])] for m in jobs],
    )


def _p90(xs: list[float]) -> float | None:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None


def _load_certs() -> Any:
    path = REPO_ROOT / "tests" / "e2e" / "certs.py"
    spec = importlib.util.spec_from_file_location("elaswave_bench_certs", path)
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _etcd_round(mode: str, pki: Any, server: Any, client: Any) -> dict[str, list[float]]:
    from elaswave.config import EtcdTLSConfig
    from elaswave.daemon.etcd_connect import EtcdSecurity
    from elaswave.daemon.etcd_server import EmbeddedEtcd, ServerTLS, etcd_binary
    from elaswave.keys import JobKeys, confinement_commands

    keys = JobKeys("bench")
    tls = mode != "plain"
    server_tls = ServerTLS(cert=str(server.cert), key=str(server.key), ca=str(pki.cert))
    with EmbeddedEtcd(tls=server_tls if tls else None) as etcd:
        security = EtcdSecurity()
        if tls:
            files = EtcdTLSConfig(cacert=str(pki.cert), cert=str(client.cert), key=str(client.key))
            env = {"ELASWAVE_ETCD_USER": "bench", "ELASWAVE_ETCD_PASSWORD": PASSWORD}
            security = EtcdSecurity.load(files, env=env if mode == "tls+auth" else {})
        if mode == "tls+auth":
            ctl = [
                str(Path(etcd_binary()).with_name("etcdctl")),
                f"--endpoints=https://{etcd.endpoint}",
                f"--cacert={pki.cert}",
                f"--cert={client.cert}",
                f"--key={client.key}",
            ]
            steps = [
                ["user", "add", "root", "--new-user-password", "root-pw"],
                ["user", "grant-role", "root", "root"],
            ]
            for cmd in confinement_commands("bench", "bench"):
                extra = ["--new-user-password", PASSWORD] if cmd[1:3] == ["user", "add"] else []
                steps.append(cmd[1:] + extra)
            steps.append(["auth", "enable"])
            for step in steps:
                r = subprocess.run(ctl + step, capture_output=True, text=True, timeout=30)
                if r.returncode != 0:
                    raise BenchError(f"etcdctl {' '.join(step[:2])}: {r.stderr.strip()[-300:]}")
        return asyncio.run(_measure(etcd.endpoint, keys.prefix, security))


async def _measure(endpoint: str, prefix: str, security: Any) -> dict[str, list[float]]:
    from elaswave.daemon.etcd import Etcd

    out: dict[str, list[float]] = {k: [] for k in OP_NAMES}
    for _ in range(10):
        t = time.perf_counter()
        db = await Etcd.connect(endpoint, prefix=prefix, security=security)
        out["connect"].append(time.perf_counter() - t)
        await db.close()
    db = await Etcd.connect(endpoint, prefix=prefix, security=security)
    try:
        rev = 0
        for i in range(OPS):
            t = time.perf_counter()
            await db.put(prefix + "progress", f'{{"step": {i}}}')
            out["put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            kv = await db.get(prefix + "progress")
            out["get"].append(time.perf_counter() - t)
            assert kv is not None
            rev = kv.mod_revision
            t = time.perf_counter()
            if not await db.compare_and_put(prefix + "progress", "x", mod_revision=rev):
                raise BenchError("compare-and-put lost against nobody")
            out["cas"].append(time.perf_counter() - t)
        await db.delete_prefix(prefix)
    finally:
        await db.close()
    return out
