"""Named Linux network namespaces (``ip netns``): which one this process runs in, and cutting or
restoring a namespace's links. Partition faults act through these, so they work only where a host
is a namespace on this machine (the multi-host test bed), and say so elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from elaswave.errors import ElasWaveError

NETNS_DIR = Path("/run/netns")


def current_netns() -> str | None:
    """The ``ip netns`` name of this process's network namespace (``None``: not a named one)."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        names = sorted(p.name for p in NETNS_DIR.iterdir())
    except OSError:
        return None
    for name in names:
        try:
            if os.stat(NETNS_DIR / name).st_ino == mine:
                return name
        except OSError:
            continue
    return None


def _ip(*args: str) -> str:
    ip = shutil.which("ip")
    if ip is None:
        raise ElasWaveError("the 'ip' command (iproute2) is not installed")
    r = subprocess.run([ip, *args], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise ElasWaveError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def links(ns: str) -> list[str]:
    """The interfaces of namespace ``ns`` other than loopback."""
    names = []
    for line in _ip("-n", ns, "-o", "link", "show").splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if name != "lo":
            names.append(name)
    return names


def set_links(ns: str, up: bool) -> list[str]:
    """Bring every non-loopback link of ``ns`` down (a partition) or back up (a heal)."""
    if not (NETNS_DIR / ns).exists():
        raise ElasWaveError(f"no network namespace {ns!r} on this machine")
    names = links(ns)
    for name in names:
        _ip("-n", ns, "link", "set", "dev", name, "up" if up else "down")
    return names
