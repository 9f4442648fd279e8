"""Snapshot checksum + copy: the pure-torch word sums against zlib's CRC-32 (native, stdlib).

Every snapshot step checksums each rank's staged shard pieces before they are sent, and every
verification checksums the kept copies, so the checksum is on the step's critical path. Per round
and size (the shard of both Adam moments of gpt-tiny at W = 4 and W = 2, and a 4 M-element
shard), each variant runs ``ITERS`` times after one warm-up call, in one thread (a worker's
``threads_per_worker``); the figure is the median per-call time over rounds. ``copy`` is a plain
clone of both moments, the floor any snapshot pays. Both checksums are also checked to catch a
flipped bit and two swapped words.
"""

from __future__ import annotations

import statistics
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from bench.common import console, ms, print_table, summarize

DESCRIPTION = "ZeRO snapshot checksum: pure-torch word sums vs zlib CRC-32, with and without copy"
DEFAULT_REPEAT = 5
ITERS = 5


def torch_words(*tensors: torch.Tensor) -> int:
    """The checksum ElasWave used before: plain and position-weighted sums of the 32-bit words."""
    total = 0
    for t in tensors:
        words = t.detach().contiguous().view(torch.int32).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64)
        plain = int(words.sum())
        weighted = int((words * weights).sum())
        total = (total * 1_000_003 + plain * 7 + weighted) % (1 << 62)
    return total


def crc32(*tensors: torch.Tensor) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().contiguous().numpy(), crc)
    return crc


VARIANTS = {
    "copy": lambda m, v: (m.clone(), v.clone()),
    "torch": torch_words,
    "crc32": crc32,
    "copy+torch": lambda m, v: torch_words(m.clone(), v.clone()),
    "copy+crc32": lambda m, v: crc32(m.clone(), v.clone()),
}


def _sizes() -> dict[str, int]:
    from bench.common import DEFAULT_CONFIG
    from elaswave.config import load_config
    from elaswave.planning.shards import ShardLayout
    from elaswave.runtime.workload.load import build_model

    segments = build_model(load_config(DEFAULT_CONFIG, env={})).segments()
    return {
        "gpt-tiny W=4": ShardLayout.even(segments, 4).shard_size(0),
        "gpt-tiny W=2": ShardLayout.even(segments, 2).shard_size(0),
        "4M elements": 4_000_000,
    }


def _detects(fn: Any) -> bool:
    m, v = torch.randn(1000), torch.randn(1000)
    base = fn(m, v)
    flipped = m.clone()
    flipped.view(torch.int32)[17] ^= 1 << 9
    swapped = v.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    return fn(flipped, v) != base and fn(m, swapped) != base


def run(repeat: int, config: Path) -> dict[str, Any]:
    del config  # sizes come from the default config's model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = _sizes()
        times: dict[str, dict[str, list[float]]] = {s: {v: [] for v in VARIANTS} for s in sizes}
        for r in range(1, repeat + 1):
            for label, n in sizes.items():
                m, v = torch.randn(n), torch.rand(n)
                for name, fn in VARIANTS.items():
                    fn(m, v)
                    start = time.perf_counter()
                    for _ in range(ITERS):
                        fn(m, v)
                    times[label][name].append((time.perf_counter() - start) / ITERS)
                line = ", ".join(f"{k} {ms(statistics.median(x[-1:]), 2)}" for k, x in
                                 times[label].items())  # fmt: skip
                console.print(f"round {r}/{repeat} {label}: {line} ms")
    finally:
        torch.set_num_threads(threads)
    summary = {s: {v: summarize(t) for v, t in per.items()} for s, per in times.items()}
    return {
        "scenario": "checksum",
        "command": "python -m bench checksum",
        "repeat": repeat,
        "iters": ITERS,
        "sizes": sizes,
        "times": times,
        "summary": summary,
        "detects_flip_and_swap": {n: _detects(VARIANTS[n]) for n in ("torch", "crc32")},
        "speedup_crc32_vs_torch": {
            s: summary[s]["torch"]["median"] / summary[s]["crc32"]["median"] for s in sizes
        },
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for label, n in result["sizes"].items():
        s = result["summary"][label]
        rows.append((label, f"{n * 8 / 1e6:.2f}",
                     *(ms(s[v]["median"], 2) for v in VARIANTS),
                     f"{result['speedup_crc32_vs_torch'][label]:.1f}×"))  # fmt: skip
    print_table(
        f"checksum of both Adam moments, one thread, median of {result['repeat']} rounds "
        f"× {result['iters']} calls, ms",
        ("shard", "MB", *VARIANTS, "crc32\nspeed-up"),
        rows,
    )
    console.print(f"detects a flipped bit and a word swap: {result['detects_flip_and_swap']}")
