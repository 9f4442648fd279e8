"""``python -m bench <scenario> [--repeat N] [--json OUT]`` and ``python -m bench --list``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench import SCENARIOS
from bench.common import DEFAULT_CONFIG, RESULTS_DIR, BenchError, console, machine_info, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("scenario", nargs="?", choices=sorted(SCENARIOS))
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--repeat", type=int, default=None, help="runs / rounds (scenario default)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="result file (default bench/results/<scenario>.json)")  # fmt: skip
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="job config (default configs/gpt-tiny.yaml; hf: its own)")  # fmt: skip
    parser.add_argument("--hosts", type=_sizes, default=None, metavar="N,N,...",
                        help="scale: simulated host counts (default 100,1000)")  # fmt: skip
    parser.add_argument("--tree", type=Path, default=None, metavar="DIR",
                        help="startup, stagestart: also run the jobs from this checkout (an "
                             "earlier commit), for a before/after comparison")  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="gpustep: cuda (default), or cpu: a dry run of its "
                             "plumbing")  # fmt: skip
    parser.add_argument("--parts", type=_parts, default=None, metavar="PART,...",
                        help="hier: only these parts (dp, zero3, zero1, pp, killed, "
                             "zero3-killed, wide, curve)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.list:
        for name, module in sorted(SCENARIOS.items()):
            console.print(f"[bold]{name:<10}[/bold] {module.DESCRIPTION} "
                          f"(default --repeat {module.DEFAULT_REPEAT})")  # fmt: skip
        return 0
    if args.scenario is None:
        parser.error("give a scenario (or --list)")
    module = SCENARIOS[args.scenario]
    repeat = module.DEFAULT_REPEAT if args.repeat is None else args.repeat
    if repeat < 1:
        parser.error("--repeat must be >= 1")
    before = machine_info()
    start = time.time()
    try:
        extra: dict[str, object] = {}
        if args.hosts is not None:
            if args.scenario != "scale":
                parser.error("--hosts is an option of the scale scenario only")
            extra["hosts"] = args.hosts
        if args.tree is not None:
            if args.scenario not in ("startup", "stagestart"):
                parser.error("--tree is an option of the startup and stagestart scenarios only")
            extra["tree"] = args.tree
        if args.device is not None:
            if args.scenario != "gpustep":
                parser.error("--device is an option of the gpustep scenario only")
            extra["device"] = args.device
        if args.parts is not None:
            if args.scenario != "hier":
                parser.error("--parts is an option of the hier scenario only")
            extra["parts"] = args.parts
        result = module.run(repeat, args.config.resolve(), **extra)
    except BenchError as exc:
        console.print(f"[red]benchmark failed:[/red] {exc}", highlight=False, soft_wrap=True)
        return 1
    result["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start))
    result["duration_s"] = round(time.time() - start, 1)
    result["machine"] = before
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    out = args.json or RESULTS_DIR / f"{args.scenario}.json"
    write_json(out, result)
    module.show(result)
    console.print(f"result: {out}  ({result['duration_s']:.0f} s)")
    return 0


def _parts(text: str) -> list[str]:
    from bench.hier import PARTS

    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if not parts or unknown:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"expected host counts like 100,1000, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"host counts must be >= 2, got {text!r}")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
