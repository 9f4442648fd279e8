"""A synthetic cluster at any scale: the membership that the scale benchmark (``bench/scale.py``)
and the unit tests both plan for, so that what the benchmark times is what the tests check.

Hosts are ``node-00000``, ``node-00001``…, each with ``per_host`` workers named as the host
daemons name them (``<host>.w<slot>``, :func:`elaswave.daemon.workers.worker_id` at incarnation
0), joining host after host, slot after slot.
"""

from __future__ import annotations

from elaswave.planning.plan import Member

__all__ = ["host_name", "synthetic_members"]


def host_name(index: int) -> str:
    """The name of synthetic host ``index``: ``node-00042``."""
    return f"node-{index:05d}"


def synthetic_members(hosts: int, per_host: int, *, first: int = 0) -> list[Member]:
    """The workers of hosts ``first`` … ``first + hosts - 1``, in join order (``order``): host by
    host, slot by slot. ``first`` lets a later call add hosts that join after the first ones
    (``synthetic_members(1, 8, first=12_500)``: one more host of 8 workers)."""
    return [
        Member(worker_id=f"{host_name(h)}.w{slot}", host=host_name(h), order=h * per_host + slot)
        for h in range(first, first + hosts)
        for slot in range(per_host)
    ]
