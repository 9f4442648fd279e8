"""ElasWave benchmarks: ``python -m bench --list`` shows the scenarios.

Every scenario is one module exposing ``DESCRIPTION``, ``DEFAULT_REPEAT``,
``run(repeat, config) -> dict`` (the JSON-ready result) and ``show(result)`` (rich tables).
"""

from __future__ import annotations

from bench import comm, crash, hang, mttr, overhead, straggler, zero

SCENARIOS = {
    "comm": comm,
    "crash": crash,
    "hang": hang,
    "mttr": mttr,
    "overhead": overhead,
    "straggler": straggler,
    "zero": zero,
}

__all__ = ["SCENARIOS"]
