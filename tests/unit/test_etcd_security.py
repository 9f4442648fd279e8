"""Who may talk to a job's etcd, the pure parts: TLS/credential options, key confinement, and
what the daemon accepts from etcd's ``faults/``. Live counterparts: tests/e2e/test_security.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_cli_errors import isolated_env, no_side_effects, one_error_line, runner  # noqa: F401

from elaswave.cli.app import app
from elaswave.cli.jobs import fault_target_error
from elaswave.config import EtcdTLSConfig, etcd_credentials, load_config
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_connect import EtcdSecurity, explain
from elaswave.errors import ConfigError, FaultSpecError
from elaswave.faults import FaultSpec, decode_request
from elaswave.keys import JobKeys, confinement_commands
from elaswave.planning.plan import Plan

PEM_CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


# ---- every key of a job lies under its prefix ----------------------------------------------
@pytest.mark.parametrize("job_id", ["a", "job-a", "job-a2", "x.y_z"])
def test_every_job_key_starts_with_the_prefix(job_id: str) -> None:
    keys = JobKeys(job_id)
    assert keys.prefix == f"/elaswave/{job_id}/"
    made = [v for k, v in vars(keys).items() if isinstance(v, str) and k not in ("job_id",)]
    made += [keys.host("h/1"), keys.worker("w"), keys.fault("f")]
    assert len(made) >= 13
    assert all(key.startswith(keys.prefix) for key in made), made
    # A job whose id extends another's never shares its prefix ("job-a" vs "job-a2").
    assert not JobKeys(job_id + "2").prefix.startswith(keys.prefix)


class _Unreachable:
    """Stands in for the aetcd client: any request that gets this far fails the test."""

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{name} reached etcd")

        return call


def _offline_etcd(prefix: str = "/elaswave/a/") -> Etcd:
    async def no_member(name: str, wait: float) -> Any:
        raise AssertionError(f"{name} was asked to fail over")

    return Etcd(
        _Unreachable(), "nowhere:1", 1.0, prefix=prefix, endpoints=["nowhere:1"], opener=no_member
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("get", ("/elaswave/b/plan",)),
        ("get_prefix", ("/elaswave/",)),
        ("get_prefix", ("/elaswave/ab/",)),
        ("put", ("/elaswave/b/x", "v")),
        ("delete", ("/other",)),
        ("delete_prefix", ("/elaswave/",)),
        ("delete_prefix_but", ("/elaswave/", "/elaswave/a/starting")),
        ("delete_prefix_but", ("/elaswave/a/", "/elaswave/b/starting")),
        ("create", ("/elaswave/b/leader", "h")),
        ("compare_and_put", ("/elaswave/b/plan", "p")),
        ("put_and_delete", ("/elaswave/a/x", "v", "/elaswave/b/y")),
    ],
)
def test_the_client_refuses_keys_outside_its_prefix(method: str, args: tuple[Any, ...]) -> None:
    db = _offline_etcd()
    kwargs = {"mod_revision": 0} if method == "compare_and_put" else {}
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(getattr(db, method)(*args, **kwargs))


def test_the_client_refuses_to_watch_outside_its_prefix() -> None:
    async def first() -> None:
        async for _ in _offline_etcd().watch_prefix("/elaswave/b/"):
            break

    with pytest.raises(ValueError, match="outside"):
        asyncio.run(first())


def test_confinement_recipe_grants_the_prefix_only() -> None:
    cmds = confinement_commands("job-a", "alice")
    grant = next(c for c in cmds if "grant-permission" in c)
    assert grant[-2:] == ["readwrite", "/elaswave/job-a/"] and "--prefix=true" in grant
    assert ["etcdctl", "user", "grant-role", "alice", "elaswave-job-a"] in cmds


def test_etcd_access_prints_the_recipe() -> None:
    result = runner.invoke(app, ["etcd-access", "--job-id", "job-a"])
    assert result.exit_code == 0, result.output
    assert (
        "grant-permission elaswave-job-a --prefix=true readwrite /elaswave/job-a/" in result.stdout
    )
    assert "bad id" in one_error_line(runner.invoke(app, ["etcd-access", "--job-id", "bad id"]))


# ---- TLS options and credentials -----------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"cert": "c.pem"}, "together"),
        ({"cacert": "ca.pem", "key": "k.pem"}, "together"),
        ({"cert": "c.pem", "key": "k.pem"}, "needs the CA"),
        ({"cacert": "ca", "server_cert": "s"}, "server_cert and server_key"),
        ({"cacert": "ca", "server_cert": "s", "server_key": "k"}, "client certificates"),
    ],
)
def test_tls_options_are_checked_together(fields: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        EtcdTLSConfig(**fields)


def test_tls_options_from_yaml_env_and_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("etcd_tls: {cacert: y-ca.pem, cert: y.pem, key: y-key.pem}\n")
    cfg = load_config(
        cfg_file,
        env={"ELASWAVE_ETCD_TLS__CACERT": "env-ca.pem"},
        overrides={"etcd_tls.key": "flag-key.pem"},
    )
    assert (cfg.etcd_tls.cacert, cfg.etcd_tls.cert, cfg.etcd_tls.key) == (
        "env-ca.pem",
        "y.pem",
        "flag-key.pem",
    )
    with pytest.raises(ConfigError, match="for the embedded etcd"):
        load_config(
            overrides={
                "etcd": ["h:1"],
                "etcd_tls.cacert": "ca",
                "etcd_tls.cert": "c",
                "etcd_tls.key": "k",
                "etcd_tls.server_cert": "s",
                "etcd_tls.server_key": "sk",
            }
        )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"ELASWAVE_ETCD_USER": "u", "ELASWAVE_ETCD_PASSWORD": "p"}, ("u", "p")),
        ({"ELASWAVE_ETCD_USER": "", "ELASWAVE_ETCD_PASSWORD": ""}, None),
        ({"ELASWAVE_ETCD_USER": "u"}, "ELASWAVE_ETCD_PASSWORD"),
        ({"ELASWAVE_ETCD_PASSWORD": "p"}, "ELASWAVE_ETCD_USER"),
    ],
)
def test_credentials_come_from_the_environment(env: dict[str, str], expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            etcd_credentials(env)
    else:
        assert etcd_credentials(env) == expected


def test_credentials_are_not_config(tmp_path: Path) -> None:
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("etcd_password: hunter2\n")
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(cfg_file)
    assert "password" not in str(load_config(env={"ELASWAVE_ETCD_PASSWORD": "p"}).to_dict())


def test_security_reads_pem_files_and_never_shows_secrets(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(PEM_CERT)
    (tmp_path / "c.pem").write_bytes(PEM_CERT)
    (tmp_path / "k.pem").write_bytes(PEM_KEY)
    (tmp_path / "junk.pem").write_text("hello")
    tls = EtcdTLSConfig(
        cacert=str(tmp_path / "ca.pem"), cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem")
    )
    sec = EtcdSecurity.load(tls, env={"ELASWAVE_ETCD_USER": "u", "ELASWAVE_ETCD_PASSWORD": "s3"})
    assert sec.tls and sec.cacert == PEM_CERT and sec.key == PEM_KEY and sec.user == "u"
    assert "s3" not in repr(sec) and "PRIVATE" not in repr(sec)
    with pytest.raises(ConfigError, match="--etcd-cacert: file not found"):
        EtcdSecurity.load(EtcdTLSConfig(cacert=str(tmp_path / "absent.pem")), env={})
    with pytest.raises(ConfigError, match="--etcd-cacert: .* is not a PEM certificate"):
        EtcdSecurity.load(EtcdTLSConfig(cacert=str(tmp_path / "junk.pem")), env={})


@pytest.mark.parametrize(
    ("detail", "fragment"),
    [
        ("etcdserver: authentication failed, invalid user ID or password", "wrong ELASWAVE_ETCD"),
        ("etcdserver: user name is empty", "requires authentication"),
        ("etcdserver: permission denied", "permission denied"),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:10000412:SSL "
            "routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE: OK",
            "refused this client's certificate",
        ),
        (
            "Tls handshake failed: error:1000007d:SSL routines:OPENSSL_internal:"
            "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
            "not signed by --etcd-cacert",
        ),
        ("failed to connect to all addresses; ipv4:127.0.0.1:1: Socket closed", "--etcd-cacert"),
        ("Peer name 10.0.0.5 is not in peer certificate", "check its SAN"),
    ],
)
def test_refusals_are_explained_in_one_line(detail: str, fragment: str) -> None:
    reason = explain(Exception(detail))
    assert fragment in reason and "\n" not in reason


# ---- fault requests: what the daemon accepts from etcd -------------------------------------
@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b"7", "JSON object"),
        (b"null", "JSON object"),
        (b'{"rank": 1}', "missing the fault kind"),
        (b'{"kind": "kill", "rank": 1, "cmd": "x"}', "unknown field"),
        (b'{"kind": "reboot", "rank": 1}', "unknown fault kind"),
        (b'{"kind": "kill", "rank": "x"}', "integer"),
        (b'{"kind": "kill", "rank": {"a": 1}}', "integer"),
        (b'{"kind": "kill", "rank": -1}', ">= 0"),
        (b'{"kind": "kill", "rank": 1, "at_step": Infinity}', "integer"),
        (b'{"kind": "kill", "rank": 1, "target": "disk"}', "target"),
        (b"[" * 100_000, "limit"),
        (b"[" * 4000, "not JSON"),
    ],
)
def test_malformed_fault_requests_are_refused(value: bytes, fragment: str) -> None:
    with pytest.raises(FaultSpecError, match=fragment):
        decode_request(value)


def test_a_wellformed_fault_request_is_accepted() -> None:
    spec = decode_request(b'{"kind": "kill", "rank": 2, "at_step": 5}')
    assert spec == FaultSpec(kind="kill", rank=2, at_step=5)  # type: ignore[arg-type]


PLAN = Plan(
    epoch=3,
    workers=("h.w0", "h.w1", "h.w2"),
    hosts=("h", "h", "h"),
    microbatches=(6, 5, 5),
    store="127.0.0.1:1",
)


@pytest.mark.parametrize(
    ("rank", "live", "done", "fragment"),
    [
        (1, {"h.w0", "h.w1", "h.w2"}, False, None),
        (3, {"h.w0", "h.w1", "h.w2"}, False, "out of range"),
        (99, {"h.w0", "h.w1", "h.w2"}, False, "ranks 0..2"),
        (1, {"h.w0", "h.w2"}, False, "is gone"),
        (0, {"h.w0", "h.w1", "h.w2"}, True, "already finished"),
    ],
)
def test_fault_targets_must_be_in_the_current_plan(
    rank: int, live: set[str], done: bool, fragment: str | None
) -> None:
    fault = FaultSpec(kind="kill", rank=rank)  # type: ignore[arg-type]
    problem = fault_target_error("j", fault, PLAN, live, done)
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem


# ---- CLI: bad TLS input is one line, before anything starts ---------------------------------
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--etcd-cert", "c.pem"], "together"),
        (["--etcd-cacert", "absent-ca.pem"], "--etcd-cacert: file not found"),
        (
            [
                "--etcd",
                "h:1",
                "--etcd-cacert",
                "ca.pem",
                "--etcd-cert",
                "c.pem",
                "--etcd-key",
                "absent.pem",
            ],
            "--etcd-key: file not found",
        ),
        (["--etcd-server-cert", "s.pem", "--etcd-server-key", "k.pem"], "needs the CA"),
    ],
)
def test_launch_bad_tls_flags(
    args: list[str], fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("ca.pem", "c.pem"):
        (tmp_path / name).write_bytes(PEM_CERT)
    assert fragment in one_error_line(runner.invoke(app, ["launch", *args]))


def test_launch_half_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASWAVE_ETCD_USER", "alice")
    line = one_error_line(runner.invoke(app, ["launch", "--etcd", "h:1"]))
    assert "ELASWAVE_ETCD_PASSWORD" in line


@pytest.mark.parametrize("command", [["status"], ["inject-fault", "--kind", "kill", "--rank", "0"]])
def test_status_and_inject_fault_check_tls_files(command: list[str], tmp_path: Path) -> None:
    args = [*command, "--job-id", "j", "--etcd", "h:1", "--etcd-cacert", str(tmp_path / "no.pem")]
    assert "file not found" in one_error_line(runner.invoke(app, args))
