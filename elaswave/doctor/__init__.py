"""``elaswave doctor``: is this host ready to train? The first thing to run on a new cluster.

Four sections, each check PASS / WARN / FAIL with a one-line reason
(:mod:`elaswave.doctor.verdicts` decides, :mod:`elaswave.doctor.probes` and
:mod:`elaswave.doctor.smoke` look):

versions  elaswave, Python, torch (and its CUDA build), transformers (the optional ``hf``
          extra), the etcd binary an embedded etcd runs and its ``--version``
devices   CPU and gloo (two ranks all-reduce over loopback), CUDA devices, NCCL's version and
          whether it shrinks a communicator in place, Ascend through torch_npu, and which
          device ``--device auto`` picks
network   a free loopback port outside the ephemeral range; with etcd endpoints, the address
          other hosts reach this one on and whether etcd answers there
smoke     a two-worker job with an embedded etcd and a real SIGKILL of rank 1 mid-run: it must
          exit 0, commit every step once, recover in place (its MTTR is reported) and leave no
          process running
"""

from __future__ import annotations

from collections.abc import Callable

from elaswave.doctor.verdicts import FAIL, PASS, STATUSES, WARN, Check, exit_code

__all__ = ["FAIL", "PASS", "STATUSES", "WARN", "Check", "diagnose", "exit_code"]


def diagnose(
    *,
    device: str = "cpu",
    etcd: list[str] | None = None,
    smoke: bool = True,
    smoke_timeout: float | None = None,
    on_smoke: Callable[[str], None] | None = None,
) -> list[Check]:
    """Every check, in section order. ``device``: where the smoke run's workers compute (a
    ``train.device`` kind); ``etcd``: endpoints (``host:port``) to check the network against;
    ``smoke`` False skips the smoke run (a WARN: not verified); ``on_smoke(what)`` is called as
    it starts (it takes tens of seconds)."""
    from elaswave.doctor import probes
    from elaswave.doctor.smoke import SMOKE_TIMEOUT_S, run_smoke, smoke_device
    from elaswave.doctor.verdicts import smoke_not_run

    checks = probes.versions()
    found_checks, found = probes.devices()
    checks += found_checks
    checks += [probes.ports_check(), probes.host_address_check(etcd or [])]
    if not smoke:
        checks.append(smoke_not_run(WARN, "--skip-smoke"))
        return checks
    kind, refused = smoke_device(device, found)
    if refused is not None:
        checks.append(refused)
        return checks
    assert kind is not None
    if on_smoke is not None:
        on_smoke(f"smoke run: 2 {kind} workers, a kill mid-run")
    checks.append(run_smoke(kind, smoke_timeout or SMOKE_TIMEOUT_S))
    return checks
