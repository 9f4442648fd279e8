"""ElasWave benchmarks: ``python -m bench --list`` shows the scenarios.

Every scenario is one module exposing ``DESCRIPTION``, ``DEFAULT_REPEAT``,
``run(repeat, config) -> dict`` (the JSON-ready result) and ``show(result)`` (rich tables).
"""

from __future__ import annotations

from bench import (
    chaos,
    checksum,
    comm,
    controlplane,
    cpushare,
    crash,
    gpustep,
    gradgroups,
    gradstep,
    hang,
    hf,
    hier,
    hostfaults,
    mttr,
    overhead,
    partition,
    pipeline,
    prune,
    racks,
    redo,
    scale,
    security,
    stagemem,
    stagestart,
    stagezero,
    startup,
    straggler,
    zero,
    zero3,
)

SCENARIOS = {
    "chaos": chaos,
    "checksum": checksum,
    "comm": comm,
    "controlplane": controlplane,
    "cpushare": cpushare,
    "crash": crash,
    "gpustep": gpustep,
    "gradgroups": gradgroups,
    "gradstep": gradstep,
    "hang": hang,
    "hf": hf,
    "hier": hier,
    "hostfaults": hostfaults,
    "mttr": mttr,
    "overhead": overhead,
    "partition": partition,
    "pipeline": pipeline,
    "prune": prune,
    "racks": racks,
    "redo": redo,
    "scale": scale,
    "security": security,
    "stagemem": stagemem,
    "stagestart": stagestart,
    "stagezero": stagezero,
    "startup": startup,
    "straggler": straggler,
    "zero": zero,
    "zero3": zero3,
}

__all__ = ["SCENARIOS"]
