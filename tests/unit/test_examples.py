"""The shipped configs and the token script: every config loads and builds its model's layout,
and text becomes a token file a job reads back, by bytes or with a local tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elaswave.config import load_config
from elaswave.runtime.workload.data import TokenFile
from elaswave.runtime.workload.load import load_workload

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "make_tokens.py"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path, env={})
    workload = load_workload(cfg)  # HF models: the meta model, cut (no weights allocated)
    assert workload.num_layers >= 3


def test_llama_1b_is_a_billion_parameters() -> None:
    cfg = load_config(ROOT / "configs" / "llama-1b.yaml", env={})
    meta = load_workload(cfg)._model  # type: ignore[attr-defined]
    assert 1.0e9 < sum(p.numel() for p in meta.parameters()) < 1.2e9


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_bytes_need_no_tokenizer(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("héllo, wörld\n" * 20, encoding="utf-8")
    r = _make(str(text), "--out", str(tmp_path / "t.u16"))
    assert r.returncode == 0, r.stderr
    assert "vocabulary 257" in r.stdout and "dtype: uint16" in r.stdout
    tokens = np.fromfile(tmp_path / "t.u16", dtype=np.uint16)
    assert tokens[-1] == 256  # the end of the document: an id no byte has
    assert bytes(tokens[:-1].astype(np.uint8)) == text.read_bytes()
    first = TokenFile(tmp_path / "t.u16", seq_len=8)[0]
    assert first.tolist() == list(text.read_bytes()[:9])


def test_a_local_tokenizer_encodes_documents(tmp_path: Path) -> None:
    """A tokenizer made here (word-level, saved with save_pretrained): its ids, each document
    ended by its end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]")
    tok.save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "1.txt").write_text("a b c")
    (tmp_path / "2.txt").write_text("c z a")
    out = tmp_path / "t.bin"
    r = _make(str(tmp_path / "1.txt"), str(tmp_path / "2.txt"), "--tokenizer",
              str(tmp_path / "tok"), "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert np.fromfile(out, dtype=np.uint16).tolist() == [2, 3, 4, 0, 4, 1, 2, 0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["missing.txt"], "no file matches 'missing.txt'"), (["--tokenizer", "nowhere"], "tokenizer")],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], fragment: str) -> None:
    (tmp_path / "a.txt").write_text("text")
    if "--tokenizer" in args:
        args = [str(tmp_path / "a.txt"), *args]
    r = _make(*args, "--out", str(tmp_path / "t.bin"))
    assert r.returncode == 2 and fragment in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "t.bin").exists()
