"""``data.source: text`` end to end: a corpus of .txt, .md, .jsonl and .parquet files and a real
tokenizer made here (byte-level BPE, ``save_pretrained``; nothing downloaded) train a small
llama through a SIGKILL, and every loss is bit for bit that of the fault-free run from the token
file ``examples/make_tokens.py`` writes for the same files. Exactly, not within 1e-6: both runs
read byte-identical token files (checked) in the deterministic mode (float64 reduction), and
the kill changes no loss in that mode, as the HF tests show for token files.

A second launch of the same text reuses the cached token file: it says so, writes nothing to
the cache, and trains on the same samples (its losses are the first run's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import F64, ROOT, Run, assert_clean_run, elaswave_cmd

pytestmark = pytest.mark.e2e

STEPS = 6
FIELD = "content"
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "vocab_size": 320, "max_position_embeddings": 64}  # fmt: skip


def _corpus(root: Path) -> tuple[list[str], list[str]]:
    """This repository's docs as a corpus of every kind; returns (globs, the texts)."""
    root.mkdir()
    paragraphs = [p for p in (ROOT / "docs" / "architecture.md").read_text().split("\n\n") if p]
    (root / "intro.txt").write_text((ROOT / "README.md").read_text()[:2500])
    (root / "deploy.md").write_text((ROOT / "docs" / "deploy.md").read_text()[:1500])
    lines = [json.dumps({FIELD: p, "n": i}) for i, p in enumerate(paragraphs[:12])]
    (root / "arch.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({FIELD: paragraphs[12:24]}), root / "arch.parquet", row_group_size=5)
    globs = [str(root / "*.txt"), str(root / "*.md"), str(root / "*.jsonl"),
             str(root / "*.parquet")]  # fmt: skip
    return globs, [(root / "intro.txt").read_text(), *paragraphs[:24]]


def _config(path: Path, data: dict[str, Any]) -> Path:
    cfg = {
        "model": {"source": "hf", "seq_len": 32, "hf": LLAMA},
        "data": data,
        "train": {"steps": STEPS, "global_batch": 8, "micro_batch_size": 2, "seed": 3,
                  "lr": 0.01},
        "elastic": {"nproc_per_node": 2, "nnodes": "1:1", "max_restarts": 0},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(config: Path, base: Path, job: str, *args: str, quiet: bool = True) -> tuple[Run, str]:
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}
    cmd = elaswave_cmd("launch", str(config), "--run-dir", str(base / "run"), "--job-id", job,
                       *(["--quiet"] if quiet else []), *args)  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(base / "run"), r.stdout


def test_text_trains_like_its_token_file_and_a_second_launch_reuses_it(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    globs, texts = _corpus(tmp_path / "corpus")
    tok = make_tokenizer(texts, vocab=LLAMA["vocab_size"])
    cache = tmp_path / "cache"
    text = {"source": "text", "files": globs, "text_field": FIELD, "tokenizer": str(tok),
            "cache_dir": str(cache)}  # fmt: skip
    text_cfg = _config(tmp_path / "text.yaml", text)

    run = _launch(text_cfg, tmp_path / "text", "text-kill", "--fault", "kill,rank=1,at_step=3")[0]
    (cached,) = cache.glob("*.tokens")
    assert len(run.of("fault_injected")) == 1
    config_json = json.loads((tmp_path / "text" / "run" / "config.json").read_text())
    assert config_json["data"]["path"] == str(cached.resolve())  # what the workers read

    made = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_tokens.py"), *globs, "--tokenizer",
         str(tok), "--text-field", FIELD, "--out", str(tmp_path / "corpus.u16")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "corpus.u16").read_bytes() == cached.read_bytes()
    tokens = np.fromfile(cached, dtype=np.uint16)
    assert int(tokens.max()) < LLAMA["vocab_size"] and len(tokens) > 8 * STEPS * 33
    given = {"source": "tokens", "dtype": "uint16", "path": str(tmp_path / "corpus.u16")}
    token_cfg = _config(tmp_path / "tokens.yaml", given)
    reference = _launch(token_cfg, tmp_path / "tokens", "text-ref")[0]

    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
    assert run.metrics[-1]["world_size"] == 1 and run.losses[STEPS] < run.losses[1]

    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    again, shown = _launch(text_cfg, tmp_path / "again", "text-again", "--steps", "2", quiet=False)
    assert f"tokens cached: {cached}" in shown and "tokenizing" not in shown, shown
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp
    assert again.losses == {s: run.losses[s] for s in (1, 2)}
