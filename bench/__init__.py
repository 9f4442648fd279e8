"""ElasWave benchmarks: ``python -m bench --list`` shows the scenarios.

Every scenario is one module exposing ``DESCRIPTION``, ``DEFAULT_REPEAT``,
``run(repeat, config) -> dict`` (the JSON-ready result) and ``show(result)`` (rich tables).
"""

from __future__ import annotations

from bench import comm, crash, hang, hostfaults, mttr, overhead, zero

SCENARIOS = {
    "comm": comm,
    "crash": crash,
    "hang": hang,
    "hostfaults": hostfaults,
    "mttr": mttr,
    "overhead": overhead,
    "zero": zero,
}

__all__ = ["SCENARIOS"]
