"""Helpers shared by the scenarios: statistics, subprocess launches, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "gpt-tiny.yaml"
RESULTS_DIR = REPO_ROOT / "bench" / "results"

console = Console()

# Environment variables the config loader does not read as config fields (see elaswave.config).
_KEEP_ENV = {"ELASWAVE_STATE_DIR", "ELASWAVE_ETCD_USER", "ELASWAVE_ETCD_PASSWORD"}


class BenchError(RuntimeError):
    """A run failed or produced results that break a benchmark invariant."""


# ---- statistics --------------------------------------------------------------------------------
def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Median, min and max (the spread) of the non-missing values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def relative_deviation(loss: Sequence[float], ref: Sequence[float]) -> list[float]:
    """``|loss - ref| / |ref|`` step by step: how far a run's losses are from a reference's."""
    return [abs(a - b) / abs(b) for a, b in zip(loss, ref, strict=True)]


def diffs(values: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(values[:-1], values[1:], strict=True)]


# ---- configs ------------------------------------------------------------------------------------
def earlier_tree(tree: Path) -> dict[str, Any]:
    """How to run the jobs from another checkout of ElasWave (``--tree DIR``, an earlier commit,
    for a before/after comparison): its launch runs with ``PYTHONPATH=DIR``, from ``DIR``."""
    tree = tree.resolve()
    if not (tree / "elaswave" / "__init__.py").is_file():
        raise BenchError(f"--tree {tree}: not a checkout of ElasWave")
    return {"env": {"PYTHONPATH": str(tree)}, "root": tree, "module": "elaswave.cli.app"}


def write_config(path: Path, config: Path, changes: Mapping[str, Any]) -> Path:
    """``config`` with ``changes`` merged into its sections (a top-level key that is not a
    section, ``zero``, set), written to ``path``."""
    data = yaml.safe_load(config.read_text())
    for section, values in changes.items():
        if isinstance(values, Mapping):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    path.write_text(yaml.safe_dump(data))
    return path


# ---- processes ---------------------------------------------------------------------------------
def bench_env(state_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without inherited ``ELASWAVE_*`` config overrides, plus ``extra``.

    A stray ``ELASWAVE_TRAIN__STEPS`` in the caller's shell would otherwise silently change
    what is measured. Job discovery files go to ``state_dir`` so benchmark jobs do not show up
    next to the user's own jobs.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_") or k in _KEEP_ENV}
    env["ELASWAVE_STATE_DIR"] = str(state_dir)
    env["ELASWAVE_TRAIN__DEVICE"] = "cpu"  # the numbers here are CPU ones, on any machine
    env.update(extra or {})
    return env


def elaswave_launch(
    config: Path,
    run_dir: Path,
    job_id: str,
    *,
    env: Mapping[str, str],
    extra_args: Sequence[str] = (),
    timeout: float = 600.0,
) -> tuple[float, float]:
    """Run ``elaswave launch`` to completion in a subprocess; returns (start, end) wall clock."""
    cmd = [
        sys.executable, "-m", "elaswave", "launch", str(config),
        "--run-dir", str(run_dir), "--job-id", job_id, *extra_args, "--quiet",
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=dict(env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode} (run dir kept):\n{tail}")
    return start, time.time()


def launch_command(config: Path, extra_args: Sequence[str] = ()) -> str:
    """The user-facing equivalent of :func:`elaswave_launch`, for reports."""
    rel = os.path.relpath(config, REPO_ROOT)
    return " ".join(["elaswave launch", rel, "--run-dir DIR --job-id ID", *extra_args, "--quiet"])


def store_barrier(store: Any, key: str, count: int) -> None:
    """Wait until ``count`` processes reached ``key`` on a shared torch.distributed store."""
    if store.add(f"{key}/n", 1) == count:
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A run file's records (none if it does not exist yet; a line being written is skipped)."""
    from elaswave.events import read_jsonl as records

    return list(records(path))


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2
) -> Any:
    """Poll ``predicate`` until it returns something true; :class:`BenchError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise BenchError(f"{what} within {timeout:g} s")


# ---- context and output ------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.is_available(),
        "git_commit": commit or None,
        "loadavg": list(os.getloadavg()),
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ms(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value * 1000:.{digits}f}"


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    table = Table(*columns, title=title, title_justify="left")
    for column in table.columns[1:]:
        column.justify = "right"
    for row in rows:
        table.add_row(*row)
    console.print(table)
