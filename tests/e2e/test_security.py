"""Who may talk to a job's etcd: TLS with client certificates, etcd auth, per-job confinement.

One real etcd per module serves TLS, admits only clients with a certificate from the test CA
(``--client-cert-auth``) and has auth on. User ``job-a`` holds a role with readwrite on
``/elaswave/job-a/`` only, created with the etcdctl recipe that ``elaswave etcd-access`` prints.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import pytest
from certs import CA, Pair
from conftest import (
    Run,
    assert_clean_run,
    cli,
    launch,
    paced,
    start,
    status_json,
    wait_for,
)

from elaswave.config import EtcdTLSConfig
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_connect import EtcdSecurity
from elaswave.daemon.etcd_server import EmbeddedEtcd, ServerTLS, etcd_binary
from elaswave.errors import EtcdUnavailable
from elaswave.keys import JobKeys

pytestmark = pytest.mark.e2e

JOB_A_PASSWORD = "a-secret"


@dataclass
class SecureEtcd:
    endpoint: str
    ca: CA
    root: Pair  # CN=root: authenticates as etcd's root user without a password
    job_a: Pair  # CN=job-a-host: a certificate for the job's daemon
    stranger: Pair  # signed by another CA

    def ctl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        etcdctl = str(Path(etcd_binary()).with_name("etcdctl"))
        cmd = [
            etcdctl,
            f"--endpoints=https://{self.endpoint}",
            f"--cacert={self.ca.cert}",
            f"--cert={self.root.cert}",
            f"--key={self.root.key}",
            *args,
        ]
        r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r

    def tls_flags(self, pair: Pair | None = None) -> list[str]:
        pair = pair or self.job_a
        return [
            "--etcd-cacert",
            str(self.ca.cert),
            "--etcd-cert",
            str(pair.cert),
            "--etcd-key",
            str(pair.key),
        ]


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    base = tmp_path_factory.mktemp("pki")
    ca = CA(base / "ca")
    server = ca.issue("etcd-server", server=True)
    other = CA(base / "other", name="other-ca")
    with EmbeddedEtcd(
        tls=ServerTLS(cert=str(server.cert), key=str(server.key), ca=str(ca.cert))
    ) as e:
        s = SecureEtcd(
            e.endpoint, ca, ca.issue("root"), ca.issue("job-a-host"), other.issue("root")
        )
        s.ctl("user", "add", "root", "--new-user-password", "root-secret")
        s.ctl("user", "grant-role", "root", "root")
        # The documented recipe, as `elaswave etcd-access` prints it.
        recipe = cli("etcd-access", "--job-id", "job-a", "--user", "job-a", env=dict(os.environ))
        assert recipe.returncode == 0, recipe.stderr
        for line in recipe.stdout.splitlines():
            args = shlex.split(line)[1:]
            if args[:2] == ["user", "add"]:
                s.ctl(*args, "--interactive=false", stdin=JOB_A_PASSWORD + "\n")
            else:
                s.ctl(*args)
        s.ctl("auth", "enable")
        yield s


def env_as(base: dict[str, str], user: str | None, password: str | None) -> dict[str, str]:
    env = dict(base)
    env.pop("ELASWAVE_ETCD_USER", None)
    env.pop("ELASWAVE_ETCD_PASSWORD", None)
    if user is not None and password is not None:
        env["ELASWAVE_ETCD_USER"] = user
        env["ELASWAVE_ETCD_PASSWORD"] = password
    return env


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0, r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_clients_without_a_good_certificate_are_refused(
    secure_etcd: SecureEtcd, state_env: dict[str, str]
) -> None:
    env = env_as(state_env, "job-a", JOB_A_PASSWORD)
    ep = ["--etcd", secure_etcd.endpoint]
    no_tls = one_line_error(cli("status", "--job-id", "job-a", *ep, env=env))
    assert "cannot reach etcd" in no_tls and "TLS" in no_tls
    ca_only = ["--etcd-cacert", str(secure_etcd.ca.cert)]
    no_cert = one_line_error(cli("status", "--job-id", "job-a", *ep, *ca_only, env=env))
    assert "certificate" in no_cert
    foreign = secure_etcd.tls_flags(secure_etcd.stranger)
    other_ca = one_line_error(cli("status", "--job-id", "job-a", *ep, *foreign, env=env))
    assert "certificate" in other_ca
    missing = secure_etcd.tls_flags()
    missing[-1] = str(Path(missing[-1]).with_name("absent.pem"))
    absent = one_line_error(cli("status", "--job-id", "job-a", *ep, *missing, env=env))
    assert "--etcd-key" in absent and "not found" in absent


def test_wrong_password_is_refused_and_the_right_one_works(
    secure_etcd: SecureEtcd, state_env: dict[str, str], tmp_path: Path
) -> None:
    args = ["status", "--job-id", "job-a", "--etcd", secure_etcd.endpoint, *secure_etcd.tls_flags()]
    wrong = cli(*args, env=env_as(state_env, "job-a", "not-the-password"))
    assert "authentication failed" in one_line_error(wrong)
    half = dict(env_as(state_env, None, None), ELASWAVE_ETCD_USER="job-a")
    assert "ELASWAVE_ETCD_PASSWORD" in one_line_error(cli(*args, env=half))
    run_dir = tmp_path / "run"
    refused = launch(
        run_dir, "--job-id", "job-a", "--etcd", secure_etcd.endpoint, *secure_etcd.tls_flags(),
        env=env_as(state_env, "job-a", "not-the-password"), timeout=120,
    )  # fmt: skip
    assert "authentication failed" in one_line_error(refused)
    assert not list(run_dir.glob("logs/*.w*.log")), "no worker may start without etcd access"
    right = cli(*args, env=env_as(state_env, "job-a", JOB_A_PASSWORD))
    # Authenticated and allowed: etcd answers, and there is simply no job running yet.
    assert "no job 'job-a'" in one_line_error(right)


def test_a_confined_user_cannot_touch_another_jobs_keys(
    secure_etcd: SecureEtcd, state_env: dict[str, str]
) -> None:
    secure_etcd.ctl("put", "/elaswave/job-b/plan", '{"epoch": 1}')
    env = env_as(state_env, "job-a", JOB_A_PASSWORD)
    flags = ["--etcd", secure_etcd.endpoint, *secure_etcd.tls_flags()]
    denied = one_line_error(cli("status", "--job-id", "job-b", *flags, env=env))
    assert "denied" in denied and "/elaswave/job-b/" in denied
    inject = ("inject-fault", "--job-id", "job-b", "--kind", "kill", "--rank", "0", *flags)
    assert "denied" in one_line_error(cli(*inject, env=env))

    sec = EtcdSecurity.load(
        EtcdTLSConfig(
            cacert=str(secure_etcd.ca.cert),
            cert=str(secure_etcd.job_a.cert),
            key=str(secure_etcd.job_a.key),
        ),
        env={"ELASWAVE_ETCD_USER": "job-a", "ELASWAVE_ETCD_PASSWORD": JOB_A_PASSWORD},
    )

    async def probe() -> tuple[bytes | None, list[str]]:
        own = await Etcd.connect(secure_etcd.endpoint, prefix=JobKeys("job-a").prefix, security=sec)
        try:
            await own.put("/elaswave/job-a/scratch", "mine")
            mine = await own.get("/elaswave/job-a/scratch")
            await own.delete("/elaswave/job-a/scratch")
            with pytest.raises(ValueError, match="outside"):
                await own.get("/elaswave/job-b/plan")  # our client refuses before asking
            # Past our client's guard, straight to etcd: the role refuses every access.
            raw, refused = own._client, []
            for name, call in (
                ("get", lambda: raw.get(b"/elaswave/job-b/plan")),
                ("range", lambda: raw.get_prefix(b"/elaswave/job-b/")),
                ("put", lambda: raw.put(b"/elaswave/job-b/plan", b"{}")),
                ("delete", lambda: raw.delete_prefix(b"/elaswave/job-b/")),
                ("root", lambda: raw.get_prefix(b"/elaswave/")),
            ):
                try:
                    await call()
                except aetcd.exceptions.ClientError as exc:
                    if "permission denied" in str(exc):
                        refused.append(name)
        finally:
            await own.close()
        return (mine.value if mine else None), refused

    mine, refused = asyncio.run(probe())
    assert mine == b"mine"
    assert refused == ["get", "range", "put", "delete", "root"]
    # Job B's key is untouched.
    got = secure_etcd.ctl("get", "/elaswave/job-b/plan", "--print-value-only")
    assert json.loads(got.stdout) == {"epoch": 1}


def test_a_job_runs_on_a_secured_etcd_while_strangers_are_refused(
    secure_etcd: SecureEtcd, state_env: dict[str, str], tmp_path: Path, reference: Run
) -> None:
    steps = 8
    env = env_as(state_env, "job-a", JOB_A_PASSWORD)
    flags = ["--etcd", secure_etcd.endpoint, *secure_etcd.tls_flags()]
    run_dir = tmp_path / "run"
    proc = start(run_dir, env, "--job-id", "job-a", "--steps", str(steps), *flags)
    refusals: list[str] = []
    stop = threading.Event()
    ca_only = EtcdSecurity.load(EtcdTLSConfig(cacert=str(secure_etcd.ca.cert)), env={})

    def stranger() -> None:  # no client certificate: refused at the TLS handshake, every time
        async def attempt() -> str:
            try:
                db = await Etcd.connect(
                    secure_etcd.endpoint, prefix="/elaswave/job-a/", security=ca_only
                )
            except EtcdUnavailable as exc:
                return str(exc)
            await db.close()
            return "admitted"

        while not stop.wait(0.2):
            refusals.append(asyncio.run(attempt()))

    thread = threading.Thread(target=stranger)
    try:
        hosts = ("get", "--prefix", "--keys-only", "/elaswave/job-a/hosts/")
        wait_for(lambda: secure_etcd.ctl(*hosts).stdout.strip(), timeout=60)
        thread.start()
        # Malformed and foreign fault requests: each is logged and ignored, none stops the job.
        malformed = [
            "not json",
            "[1, 2]",
            "7",
            '{"kind": "kill", "rank": 99}',
            '{"kind": "kill", "rank": 0, "shell": "rm -rf /"}',
        ]
        for i, bad in enumerate(malformed):
            secure_etcd.ctl("put", f"/elaswave/job-a/faults/bad-{i}", bad)
        by_cli = cli(
            "status",
            "--job-id",
            "job-a",
            "--etcd",
            secure_etcd.endpoint,
            "--etcd-cacert",
            str(secure_etcd.ca.cert),
            env=env,
        )
        assert "certificate" in one_line_error(by_cli)
        out, err = proc.communicate(timeout=180)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    run = Run(run_dir)
    assert_clean_run(run, steps, reference)
    rejected = run.of("fault_rejected")
    assert len({e["key"] for e in rejected}) == 5, rejected
    assert not run.of("fault_injected")
    assert refusals, "the stranger never tried"
    assert all("refused this client's certificate" in r for r in refusals), set(refusals)
    # Nothing of the job is left behind in etcd but its records (what a relaunch resumes from).
    left = secure_etcd.ctl("get", "--prefix", "--keys-only", "/elaswave/job-a/").stdout.split()
    assert sorted(left) == ["/elaswave/job-a/config", "/elaswave/job-a/progress"], left


def test_a_single_host_job_with_its_embedded_etcd_on_tls(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    # No external etcd: launch starts its own with TLS + client-cert auth; status finds it,
    # and its TLS files, through the discovery record. Emulated device
    # time (0.4 s a step) keeps the job, and so its etcd, up for the clients' checks.
    ca = CA(tmp_path / "pki")
    server, host = ca.issue("etcd-server", server=True), ca.issue("job-host")
    steps = 16
    run_dir = tmp_path / "run"
    env = paced(env_as(state_env, None, None), 0.1)
    proc = start(
        run_dir, env, "--job-id", "solo", "--steps", str(steps),
        "--etcd-cacert", str(ca.cert), "--etcd-cert", str(host.cert), "--etcd-key", str(host.key),
        "--etcd-server-cert", str(server.cert), "--etcd-server-key", str(server.key),
    )  # fmt: skip
    try:
        st = wait_for(lambda: status_json("solo", env), timeout=90)
        record = json.loads((Path(env["ELASWAVE_STATE_DIR"]) / "jobs" / "solo.json").read_text())
        ca_only = ["--etcd", record["etcd"][0], "--etcd-cacert", str(ca.cert)]
        refused = one_line_error(cli("status", "--job-id", "solo", *ca_only, env=env))
        assert proc.poll() is None, "the job ended before the clients' checks"
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert st["job_id"] == "solo"
    assert "password" not in json.dumps(record) and record["etcd_tls"]["cacert"] == str(ca.cert)
    assert "certificate" in refused
    assert_clean_run(Run(run_dir), steps, reference)
