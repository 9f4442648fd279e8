"""The multi-host test bed (:mod:`elaswave.testing.netbed`) as a pytest fixture, skipped where
network namespaces cannot be made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIG

from elaswave.testing.netbed import NetBed, in_netns, skip_reason

__all__ = ["NetBed", "in_netns", "netbed_fixture"]


@pytest.fixture(name="netbed_factory")
def netbed_fixture(tmp_path: Path) -> Any:
    """``make(hosts=3, etcd_members=1, name="", racks=())`` → a started :class:`NetBed` working
    in ``tmp_path / name`` (``racks``: each host's rack, each rack on a bridge of its own),
    always torn down."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"netns test bed unavailable: {reason}")
    beds: list[NetBed] = []

    def make(
        hosts: int = 3, etcd_members: int = 1, name: str = "", racks: tuple[str, ...] = ()
    ) -> NetBed:
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        bed = NetBed(workdir, config=CONFIG, hosts=hosts, etcd_members=etcd_members, racks=racks)
        beds.append(bed)
        return bed.start()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()
