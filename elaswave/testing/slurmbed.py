"""A real Slurm cluster on one machine, for tests and benchmarks: Debian's ``slurmctld``,
``slurmd`` and ``munge`` (22.05), one ``slurmd`` per node, every node a machine of its own as far
as the job can tell. Needs root, iproute2, util-linux's ``unshare`` and the packages (Debian:
``apt-get install slurmctld slurmd munge slurm-client``); :func:`skip_reason` says what is missing.

Nodes: ``ctl`` (munged, slurmctld; the login node the Slurm commands run on) and ``n1`` … ``nN``
(one slurmd each). Each is a network namespace of :class:`~elaswave.testing.netbed.Switch` (one
bridge, a private /24, nothing on the machine's own network), and its daemon runs in a UTS namespace
with the node's name as hostname and a mount namespace of its own: a tmpfs on ``/tmp`` (node-local,
gone with the node), the bed's ``hosts`` file on ``/etc/hosts`` (every node resolves every other by
name), an empty tmpfs on ``/sys/fs/cgroup`` (slurmd's cgroup plugin finds nothing of the machine's)
and, bound back into the private ``/tmp``, the working directory (shared by every node, like a
cluster's filesystem) and the Python environment. Everything a job starts lives in those namespaces,
so :meth:`SlurmBed.power_off` (SIGKILL to every process of a node, all stopped before any dies: a
power loss) and the checks that nothing is left running see exactly one node.

slurm.conf: ``ReturnToService=2`` (a node that comes back is idle again), ``SlurmdTimeout=5`` (a
dead node is marked DOWN within seconds), ``KillWait=5``, ``JobRequeue=1`` (Slurm's default: a
batch job whose node fails is requeued unless it asked for ``--no-kill``), ``cred_expire=8`` (a
requeued job may start again after 9 s, not 121; still far longer than a launch credential
takes to reach a node of the bed) and a scheduling pass every 2 s (so it does),
``select/linear`` (whole nodes), ``proctrack/linuxproc`` (no cgroups), no accounting (``scontrol
show job`` and the ``jobcomp`` file say how a job ended). munged runs with a key of the bed's own
on a private socket (``AuthInfo=socket=…``); every spool, state, pid and log file lies under
``<workdir>/slurm``.

:meth:`SlurmBed.close` kills every process in the bed's namespaces and deletes them, also after a
failed test: no process, namespace or mount is left.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

import elaswave
from elaswave.testing.netbed import Switch, alive, kill_at_once
from elaswave.testing.netbed import skip_reason as netns_skip_reason

__all__ = ["SlurmBed", "skip_reason"]

CONTROLLER = "ctl"
PACKAGES = "slurmctld slurmd munge slurm-client"  # Debian's, 22.05 in bookworm
DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "munged", "mungekey")
COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue", "unshare")
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
SOCKET_PATH_MAX = 107  # sun_path
# A step credential's lifetime, which is also how long a requeued job waits before it may start
# again (Slurm's default: 120 s).
CRED_EXPIRE = 8


def skip_reason() -> str | None:
    """Why a Slurm bed cannot run here (``None``: it can)."""
    reason = netns_skip_reason()
    if reason:
        return reason
    path = f"{os.environ.get('PATH', '')}:{SBIN}"
    missing = [b for b in DAEMONS + COMMANDS if shutil.which(b, path=path) is None]
    if missing:
        return (
            f"Slurm is not installed (no {', '.join(missing)}; Debian: apt-get install {PACKAGES})"
        )
    probe = ["unshare", "--uts", "--mount", "--propagation", "private", "true"]
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make UTS and mount namespaces: {r.stderr.strip()}"
    return None


class SlurmBed:
    """``nodes`` compute nodes ``n1`` … ``nN`` and a controller, sharing ``workdir``."""

    def __init__(self, workdir: Path, *, nodes: int = 5) -> None:
        self.workdir = workdir.resolve()  # every node sees it: the cluster's shared filesystem
        self.dir = self.workdir / "slurm"  # the bed's config, keys, state, spool and logs
        self.net = Switch(f"sl{secrets.token_hex(3)}")
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}  # munged, ctl, n1 … : their daemon
        self.env = _login_env(self.dir / "slurm.conf")

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge.sock"

    def ns(self, node: str) -> str:
        return self.net.ns(node)

    # ---- bring-up ---------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SlurmBed:
        if len(str(self.munge_socket)) > SOCKET_PATH_MAX:
            raise RuntimeError(f"the bed's directory is too deep for a socket: {self.dir}")
        (self.dir / "log").mkdir(parents=True, exist_ok=True)
        self.net.start()
        for node in [CONTROLLER, *self.nodes]:
            self.net.attach(node)
        hosts = ["127.0.0.1 localhost", *(f"{a} {n}" for n, a in self.net.addr.items())]
        (self.dir / "hosts").write_text("\n".join(hosts) + "\n")
        self.conf.write_text(self._slurm_conf())
        # slurmd loads a cgroup plugin whatever the other plugins are; v1 on an empty tmpfs
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        key = self.dir / "munge.key"
        subprocess.run(["mungekey", "--create", "--force", "--bits", "1024", "--keyfile", str(key)],
                       check=True, capture_output=True, env=self.env)  # fmt: skip
        self._start_munged(timeout)
        self.daemons[CONTROLLER] = self._boot(CONTROLLER, "slurmctld -D -i")
        deadline = time.monotonic() + timeout
        while self.command("scontrol", "ping", check=False).returncode != 0:
            self._check_alive(CONTROLLER, deadline, "slurmctld did not answer")
            time.sleep(0.2)
        for node in self.nodes:
            self.power_on(node)
        self.wait_nodes(self.nodes, "idle", timeout=timeout)
        return self

    def _slurm_conf(self) -> str:
        d = self.dir
        addr = self.net.addr
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={addr[n]} CPUs={os.cpu_count() or 1} RealMemory=1000 "
            "State=UNKNOWN"
            for n in self.nodes
        )
        return f"""\
ClusterName=elaswave-bed
SlurmctldHost={CONTROLLER}({addr[CONTROLLER]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/spool/%n/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
SlurmdTimeout=5
SlurmctldTimeout=5
MessageTimeout=5
KillWait=5
MinJobAge=3600
JobRequeue=1
{nodes}
PartitionName=bed Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""

    def _start_munged(self, timeout: float) -> None:
        d = self.dir
        cmd = ["ip", "netns", "exec", self.ns(CONTROLLER), "munged", "--foreground", "--force",
               f"--key-file={d / 'munge.key'}", f"--socket={self.munge_socket}",
               f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
               f"--log-file={d / 'log' / 'munged.log'}"]  # fmt: skip
        self.daemons["munged"] = _spawn(cmd, self.dir / "log" / "munged.out", self.env)
        deadline = time.monotonic() + timeout
        while not self.munge_socket.exists():
            self._check_alive("munged", deadline, "munged did not create its socket")
            time.sleep(0.05)

    def _boot(self, node: str, daemon: str) -> subprocess.Popen[bytes]:
        """Start ``daemon`` as ``node``: in its network namespace, with its hostname, its own
        /tmp and the shared directories bound back into it."""
        q = shlex.quote
        keep = _shared_paths(self.workdir)
        lines = [
            "set -e",
            f"hostname {q(node)}",
            f"mount --bind {q(str(self.dir / 'hosts'))} /etc/hosts",
            *(f"exec {3 + i}<{q(str(p))}" for i, p in enumerate(keep)),
            "mount -t tmpfs -o mode=1777 tmpfs /tmp",
            "mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup",
        ]
        for i, p in enumerate(keep):  # the shared directories, through the fds opened above
            lines += [f"mkdir -p {q(str(p))}",
                      f"mount --no-canonicalize --bind /proc/self/fd/{3 + i} {q(str(p))}",
                      f"exec {3 + i}<&-"]  # fmt: skip
        lines.append(f"exec {daemon}")
        cmd = ["ip", "netns", "exec", self.ns(node), "unshare", "--uts", "--mount",
               "--propagation", "private", "bash", "-c", "\n".join(lines)]  # fmt: skip
        return _spawn(cmd, self.dir / "log" / f"{node}.out", self.env)

    def _check_alive(self, name: str, deadline: float, what: str) -> None:
        proc = self.daemons[name]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {self.log(name)}")

    # ---- nodes ------------------------------------------------------------------------------
    def power_on(self, node: str) -> None:
        """Start ``node``'s slurmd (again: a node that was powered off comes back empty)."""
        (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
        self.daemons[node] = self._boot(node, "slurmd -D")

    def power_off(self, node: str, timeout: float = 10.0) -> list[int]:
        """A power loss: every process of ``node`` (its slurmd, the job steps, whatever they
        started) stopped, then SIGKILLed (:func:`~elaswave.testing.netbed.kill_at_once`); its /tmp
        goes with them. The pids killed."""
        killed = kill_at_once(functools.partial(self.pids, node), timeout)
        proc = self.daemons.get(node)
        if proc is not None:
            proc.wait(timeout=timeout)
        return killed

    def pids(self, node: str) -> list[int]:
        """The live processes of ``node`` (zombies are not)."""
        return [p for p in self.net.pids(node) if alive(p)]

    def left_running(self, node: str) -> list[str]:
        """What runs on ``node`` besides its slurmd: ``pid name args`` of each."""
        daemon = self.daemons.get(node)
        out = []
        for pid in self.pids(node):
            if daemon is not None and pid == daemon.pid:
                continue
            try:
                out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:200]}")
            except psutil.NoSuchProcess:
                continue
        return out

    def find(self, node: str, pattern: str) -> list[psutil.Process]:
        """The live processes of ``node`` whose command line matches ``pattern`` (a regex)."""
        found = []
        for pid in self.pids(node):
            try:
                proc = psutil.Process(pid)
                if re.search(pattern, " ".join(proc.cmdline())):
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        return found

    def node_states(self) -> dict[str, str]:
        r = self.command("sinfo", "--noheader", "--Node", "--format=%N %T")
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def wait_nodes(self, nodes: list[str], state: str, timeout: float = 60.0) -> None:
        """Wait until every node of ``nodes`` is in ``state`` (``idle``, ``down`` …, as sinfo
        says it, a trailing ``*`` or ``~`` aside)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*~#$@+-") == state for n in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not {state}: {states}\n{self.log('slurmctld')}")
            time.sleep(0.3)

    # ---- jobs -------------------------------------------------------------------------------
    def command(
        self, *args: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command on the login node, in the working directory."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns(CONTROLLER), *args], env=self.env, cwd=self.workdir,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, script: Path, *options: str, args: tuple[str, ...] = ()) -> int:
        """Submit ``script`` (with ``args``) from the working directory; its job id."""
        r = self.command("sbatch", "--parsable", *options, str(script), *args)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, Restarts …)."""
        r = self.command("scontrol", "--oneliner", "show", "job", str(job_id))
        return dict(f.partition("=")[::2] for f in r.stdout.split() if "=" in f)

    def wait_job(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (``COMPLETED``, ``RUNNING`` …)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {job.get('JobState')}, not {states}")
            time.sleep(0.3)

    def scancel(self, job_id: int) -> None:
        self.command("scancel", str(job_id))

    def requeue(self, job_id: int) -> None:
        self.command("scontrol", "requeue", str(job_id))

    def output(self, job_id: int) -> str:
        """The tail of the job's ``slurm-<id>.out``."""
        path = self.workdir / f"slurm-{job_id}.out"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def log(self, name: str) -> str:
        """The tail of a daemon's log (``slurmctld``, ``munged``, a node)."""
        d = self.dir / "log"
        names = {"slurmctld": "slurmctld.log", "munged": "munged.log"}
        path = d / names.get(name, f"slurmd-{name}.log")
        if not path.exists():
            path = d / f"{name}.out"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # ---- teardown ---------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Kill every process of the bed (jobs, slurmds, slurmctld, munged) and delete its
        namespaces; their mounts go with the last process in them."""
        try:
            for node in [*self.nodes, CONTROLLER, "sw"]:
                if self.ns(node) in self.net.namespaces:
                    kill_at_once(functools.partial(self.pids, node), timeout)
            for proc in self.daemons.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=timeout)
        finally:
            self.net.close()


def _login_env(conf: Path) -> dict[str, str]:
    """The environment of the login node's shell: this Python's scripts (``elaswave``,
    ``etcd``) and the daemons' sbin on PATH, the bed's slurm.conf, and nothing of a Slurm job
    this process itself may run in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = ":".join([bin_dir, env.get("PATH", "/usr/bin:/bin"), SBIN])
    env["SLURM_CONF"] = str(conf)
    env["TMPDIR"] = "/tmp"  # the node's own
    return env


def _shared_paths(workdir: Path) -> list[Path]:
    """What a node must see of the machine's /tmp (it gets a /tmp of its own): the shared
    working directory, and this Python and the elaswave package if they lie there."""
    candidates = {workdir, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent,
                  Path(elaswave.__file__).parents[1]}  # fmt: skip
    tmp = Path("/tmp")
    under = sorted({p.resolve() for p in candidates if p.resolve().is_relative_to(tmp)})
    return [p for p in under if not any(p != q and p.is_relative_to(q) for q in under)]


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
