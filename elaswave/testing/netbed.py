"""A multi-host test bed on one machine: every host is a Linux network namespace (needs root and
iproute2). The multi-host tests and the benchmarks (``chaos``, ``hostfaults``) run on it.

Each node (a training host ``h<i>`` or an etcd member ``e<j>``) gets its own namespace with ``lo``
and one ``eth0``, joined by veth pairs to a bridge in a switch namespace, on a private /24. Nothing
touches the caller's namespace: no address, no route, no link there. The etcd members are real
etcd binaries (``ip netns exec``), the hosts real ``elaswave launch`` daemons, so gloo, the
rendezvous store and etcd all talk over the veths.

The topology is a :class:`Switch` (the Slurm bed, :mod:`elaswave.testing.slurmbed`, builds its
nodes on one too).

Faults: ``cut``/``heal`` bring a host's ``eth0`` down/up (the partition the ``partition`` fault
kind makes), ``kill_host`` SIGKILLs a daemon and its workers as a power loss would (all stopped
before any dies: :func:`kill_at_once`), ``kill_etcd`` SIGKILLs a member.
``close`` kills whatever is left and deletes the namespaces, also after a failed test.
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from elaswave.daemon.etcd_server import etcd_binary
from elaswave.daemon.netns import set_links

CLONE_NEWNET = 0x40000000
SUBNET = "10.87.0"  # private, and only ever configured inside the bed's own namespaces
CLIENT_PORT = 2379  # fixed ports are safe here: every member has a namespace of its own
PEER_PORT = 2380


def skip_reason() -> str | None:
    """Why the bed cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"ewprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def in_netns(ns: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread that has entered namespace ``ns`` (the caller's stays as it is)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns})")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def elaswave_cmd(*args: str) -> list[str]:
    """An ``elaswave`` command line, run by this interpreter."""
    return [sys.executable, "-m", "elaswave", *args]


class Switch:
    """Network namespaces joined by veth pairs to one bridge: every node attached gets a namespace
    ``<tag><node>`` with ``lo`` and one ``eth0`` on a private /24, the bridge lives in the switch
    namespace ``<tag>sw``. Nothing is configured in the caller's namespace. The multi-host bed
    and the Slurm bed (:mod:`elaswave.testing.slurmbed`) build their machines on it."""

    def __init__(self, tag: str, subnet: str = SUBNET) -> None:
        self.tag = tag
        self.subnet = subnet
        self.namespaces: list[str] = []
        self.addr: dict[str, str] = {}  # node -> its address on the bridge

    def ns(self, node: str) -> str:
        return f"{self.tag}{node}"

    def start(self) -> Switch:
        switch = self.ns("sw")
        self._add_ns(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        return self

    def add_bridge(self, k: int) -> str:
        """A second-tier switch (a rack's): bridge ``br<k>`` joined to ``br0`` by the veth pair
        ``up<k>`` (on ``br<k>``) / ``dn<k>`` (on ``br0``), the link between the racks that a test
        reads the counters of or shapes with ``tc``. Returns the bridge's name."""
        sw, bridge = self.ns("sw"), f"br{k}"
        _ip("-n", sw, "link", "add", bridge, "type", "bridge")
        _ip("-n", sw, "link", "add", f"up{k}", "type", "veth", "peer", "name", f"dn{k}")
        _ip("-n", sw, "link", "set", f"up{k}", "master", bridge)
        _ip("-n", sw, "link", "set", f"dn{k}", "master", "br0")
        for link in (bridge, f"up{k}", f"dn{k}"):
            _ip("-n", sw, "link", "set", link, "up")
        return bridge

    def attach(self, node: str, bridge: str = "br0") -> str:
        """A namespace for ``node`` on ``bridge``; its address."""
        ns, i = self.ns(node), len(self.addr)
        self._add_ns(ns)
        port = f"p{i}"
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
            "netns", self.ns("sw"))  # fmt: skip
        _ip("-n", self.ns("sw"), "link", "set", port, "master", bridge)
        _ip("-n", self.ns("sw"), "link", "set", port, "up")
        self.addr[node] = f"{self.subnet}.{i + 2}"
        _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return self.addr[node]

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def pids(self, node: str) -> list[int]:
        """Every process in ``node``'s namespace (``ip netns pids``)."""
        r = subprocess.run(["ip", "netns", "pids", self.ns(node)], capture_output=True,
                           text=True)  # fmt: skip
        return [int(p) for p in r.stdout.split()]

    def close(self) -> None:
        """Delete the namespaces (the caller has ended the processes in them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


class NetBed:
    def __init__(
        self,
        workdir: Path,
        *,
        config: Path,
        hosts: int,
        etcd_members: int = 1,
        racks: Sequence[str] = (),
        label_racks: bool = True,
    ) -> None:
        """``racks``: each host's rack label (empty: one switch). The first rack's hosts and
        the etcd members sit on ``br0``, each other rack's on a bridge of its own joined to
        ``br0`` by one link (:meth:`Switch.add_bridge`); every host launches with ``--rack``
        (``label_racks=False``: without, so the job does not know the racks it runs on)."""
        if racks and len(racks) != hosts:
            raise ValueError(f"need one rack label per host ({hosts}), got {len(racks)}")
        self.racks = dict(zip([f"h{i}" for i in range(hosts)], racks, strict=True)) if racks else {}
        self.label_racks = label_racks
        self.workdir = workdir
        self.config = config  # the job every host launches
        self.net = Switch(f"ew{secrets.token_hex(3)}")
        self.tag = self.net.tag
        self.hosts = [f"h{i}" for i in range(hosts)]
        self.members = [f"e{j}" for j in range(etcd_members)]
        self.namespaces = self.net.namespaces
        self.addr = self.net.addr
        self.etcd: dict[str, subprocess.Popen[bytes]] = {}
        self.daemons: dict[str, subprocess.Popen[str]] = {}
        self.run_dirs: dict[str, Path] = {}

    def ns(self, node: str) -> str:
        return self.net.ns(node)

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.addr[m]}:{CLIENT_PORT}" for m in self.members)

    # ---- topology ---------------------------------------------------------------------------
    def start(self) -> NetBed:
        self.net.start()
        bridges = {}
        for k, label in enumerate(dict.fromkeys(self.racks.values())):
            bridges[label] = self.net.add_bridge(k) if k else "br0"
        for node in self.hosts + self.members:
            self.net.attach(node, bridges.get(self.racks.get(node, ""), "br0"))
        self._start_etcd()
        return self

    def _start_etcd(self, timeout: float = 30.0) -> None:
        for m in self.members:
            self._spawn_etcd(m)
        self._wait_etcd(self.members, timeout)

    def _spawn_etcd(self, m: str) -> None:
        """Start member ``m`` (again: a restarted member finds its data directory and rejoins
        with its keys, revisions and leases)."""
        cluster = ",".join(f"{n}=http://{self.addr[n]}:{PEER_PORT}" for n in self.members)
        a = self.addr[m]
        data = self.workdir / f"etcd-{m}"
        args = [
            "ip", "netns", "exec", self.ns(m), etcd_binary(),
            "--name", m,
            "--data-dir", str(data),
            "--listen-client-urls", f"http://{a}:{CLIENT_PORT}",
            "--advertise-client-urls", f"http://{a}:{CLIENT_PORT}",
            "--listen-peer-urls", f"http://{a}:{PEER_PORT}",
            "--initial-advertise-peer-urls", f"http://{a}:{PEER_PORT}",
            "--initial-cluster", cluster,
            "--initial-cluster-state", "new",
            "--log-level", "error",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]  # fmt: skip
        log = open(self.workdir / f"etcd-{m}.log", "ab")  # noqa: SIM115 - owned by the proc
        self.etcd[m] = subprocess.Popen(args, stdout=log, stderr=log)

    def _wait_etcd(self, members: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for m in members:
            url = f"http://{self.addr[m]}:{CLIENT_PORT}/health"
            while not in_netns(self.ns(m), functools.partial(_healthy, url)):
                if time.monotonic() > deadline or self.etcd[m].poll() is not None:
                    raise RuntimeError(f"etcd member {m} did not become healthy")
                time.sleep(0.1)

    # ---- hosts ------------------------------------------------------------------------------
    def launch(self, host: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
        """``elaswave launch`` of the bed's job config as ``host``, inside its namespace."""
        run_dir = self.workdir / host
        self.run_dirs[host] = run_dir
        rack = ("--rack", self.racks[host]) if host in self.racks and self.label_racks else ()
        cmd = elaswave_cmd(
            "launch", str(self.config), "--run-dir", str(run_dir), "--quiet",
            "--host-id", host, "--etcd", self.endpoints, *rack, *args,
        )  # fmt: skip
        out = open(self.workdir / f"{host}.out", "w")  # noqa: SIM115 - owned by the proc
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.daemons[host] = proc
        return proc

    def cli(self, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """One ``elaswave`` command, run from the first etcd member's namespace."""
        cmd = ["ip", "netns", "exec", self.ns(self.members[0]), *elaswave_cmd(*args)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    def output(self, host: str) -> str:
        path = self.workdir / f"{host}.out"
        return path.read_text()[-3000:] if path.exists() else ""

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait for every launched daemon to exit; their exit codes."""
        deadline = time.monotonic() + timeout
        codes = {}
        for host, proc in self.daemons.items():
            try:
                codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{host} still running: {self.output(host)}") from None
        return codes

    # ---- faults -----------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        set_links(self.ns(host), up=False)

    def heal(self, host: str) -> None:
        set_links(self.ns(host), up=True)

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL the host's daemon and every process under it, all at once."""
        return _kill_tree(self.daemons[host].pid)

    def kill_etcd(self, member: str) -> None:
        self.etcd[member].kill()
        self.etcd[member].wait()

    def restart_etcd(self, member: str, timeout: float = 30.0) -> None:
        """Start a killed member again on its data directory and wait until it is healthy."""
        self._spawn_etcd(member)
        self._wait_etcd([member], timeout)

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.daemons.values():
            if proc.poll() is None:
                _kill_tree(proc.pid)
            proc.wait()
        for member in self.etcd.values():
            if member.poll() is None:
                member.kill()
            member.wait()
        self.net.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return b'"health":"true"' in resp.read()
    except (urllib.error.URLError, OSError):
        return False


def _kill_tree(pid: int) -> list[int]:
    def tree() -> list[int]:
        try:
            root = psutil.Process(pid)
            return [pid, *(p.pid for p in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    return kill_at_once(tree)


def kill_at_once(listed: Callable[[], list[int]], timeout: float = 10.0) -> list[int]:
    """A power loss for the processes ``listed()`` names: none of them may act on another's
    death, as none could if the power went. (Killed one by one, they can: an ``srun`` whose
    main process dies before its helper ends its step on every node.) So every one is stopped
    first, parents before children (SIGSTOP); then they are SIGKILLed children first, a level
    of the process tree at a time, each level gone before the next, so no exit ever leaves a
    stopped process group orphaned (the kernel would wake it with SIGHUP and SIGCONT, and an
    ``srun`` ends its step on SIGHUP). The pids."""
    deadline = time.monotonic() + timeout
    stopped: list[int] = []
    while new := [p for p in listed() if p not in stopped]:  # a fork between listings too
        for pid in sorted(new, key=depths(_parents(new)).__getitem__):
            _signal(pid, signal.SIGSTOP)
        stopped += new
        while not all(_stopped_or_gone(p) for p in new):
            _check(deadline, f"processes that ignore SIGSTOP: {new}")
            time.sleep(0.01)
    depth = depths(_parents(stopped))
    for level in sorted(set(depth.values()), reverse=True):
        pids = [p for p in stopped if depth[p] == level]
        while left := [p for p in pids if alive(p)]:
            for pid in left:
                _signal(pid, signal.SIGKILL)
            _check(deadline, f"processes that survive SIGKILL: {left}")
            time.sleep(0.01)
    while left := [p for p in listed() if alive(p)]:
        for pid in left:
            _signal(pid, signal.SIGKILL)
        _check(deadline, f"processes that survive SIGKILL: {left}")
        time.sleep(0.05)
    return stopped


def _parents(pids: list[int]) -> dict[int, int]:
    parent = {}
    for pid in pids:
        try:
            parent[pid] = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            parent[pid] = 0
    return parent


def depths(parent: dict[int, int]) -> dict[int, int]:
    """Each pid's depth in the process tree its ``parent`` map makes (0: its parent is not in
    the map)."""
    depth: dict[int, int] = {}

    def of(pid: int) -> int:
        if pid not in depth:
            up = parent[pid]
            depth[pid] = 0 if up not in parent or up == pid else of(up) + 1
        return depth[pid]

    for pid in parent:
        of(pid)
    return depth


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stopped_or_gone(pid: int) -> bool:
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    # stopped, dead already, or inside the kernel, where it stops on its way out
    return status in (
        psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
        psutil.STATUS_DISK_SLEEP,
    )  # fmt: skip


def _check(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(what)
