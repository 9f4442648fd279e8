"""Training on your own text (``data.source: text``, :mod:`elaswave.data.text`): every reader, the
packing with end-of-document ids, the cache key, the cache's reuse, its lock and its atomic
writes, and one line for every bad input. Real files, a real tokenizer made here (nothing is
downloaded)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from elaswave.cli.tokenizing import TokenizingView
from elaswave.config import JobConfig
from elaswave.data import cache as cache_mod
from elaswave.data.encode import ByteEncoder, HFEncoder
from elaswave.data.sources import documents, expand
from elaswave.data.text import BYTE_EOS, model_vocab, prepare, resolve_text, tokenize_to
from elaswave.errors import ConfigError
from elaswave.runtime.workload.data import TokenFile

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["The quick brown fox jumps over the lazy dog.\n", "Zwölf Boxkämpfer jagen Viktor.",
        "elastic training keeps the global batch", "héllo wörld\n\nsecond paragraph"]  # fmt: skip


def corpus(root: Path) -> dict[str, Path]:
    """One file of each kind: a .txt (one document), a .jsonl (two, a blank line and an empty
    document between them), a .parquet (two rows, in two row groups)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    lines = [json.dumps({"text": DOCS[1], "id": 1}), "", json.dumps({"text": ""}),
             json.dumps({"id": 3, "text": DOCS[2]})]  # fmt: skip
    (root / "b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": [DOCS[3], DOCS[0]], "n": [1, 2]}), root / "c.parquet",
                   row_group_size=1)  # fmt: skip
    return {"txt": root / "a.txt", "jsonl": root / "b.jsonl", "parquet": root / "c.parquet"}


GLOBS = ["*.txt", "*.jsonl", "*.parquet"]
IN_ORDER = [DOCS[0], DOCS[1], DOCS[2], DOCS[3], DOCS[0]]  # the documents GLOBS read


def globs(root: Path) -> list[str]:
    return [str(root / g) for g in GLOBS]


def made(root: Path) -> list[str]:
    """The globs of a fresh corpus in ``root``."""
    corpus(root)
    return globs(root)


def read(path: Path, dtype: str = "uint16") -> list[int]:
    return np.fromfile(path, dtype=dtype).tolist()


def byte_tokens(docs: list[str]) -> list[int]:
    return [t for d in docs for t in [*d.encode("utf-8"), BYTE_EOS]]


# -- readers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "docs"),
    [("txt", [DOCS[0]]), ("jsonl", [DOCS[1], DOCS[2]]), ("parquet", [DOCS[3], DOCS[0]])],
)
def test_each_reader_gives_its_documents_and_their_bytes(
    tmp_path: Path, kind: str, docs: list[str]
) -> None:
    path = corpus(tmp_path)[kind]
    (source,) = expand([str(path)])
    assert source.kind == kind
    read_docs = list(documents(source, "text"))
    assert [t for t, _ in read_docs if t] == docs
    assert sum(n for _, n in read_docs) == path.stat().st_size  # progress reaches the end


def test_globs_expand_in_order_sorted_and_once(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text(name)
    sources = expand([str(tmp_path / "c.md"), str(tmp_path / "*.txt"), str(tmp_path / "*")])
    assert [s.path.name for s in sources] == ["c.md", "a.txt", "b.txt"]
    assert [s.kind for s in sources] == ["txt"] * 3


def test_a_text_field_other_than_text(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "abc", "text": 1}) + "\n")
    pq.write_table(pa.table({"body": ["de"]}), tmp_path / "y.parquet")
    c = prepare([str(tmp_path / "x.jsonl"), str(tmp_path / "y.parquet")],
                cache_dir=tmp_path / "cache", text_field="body")  # fmt: skip
    assert read(c.path) == byte_tokens(["abc", "de"])


# -- packing -------------------------------------------------------------------------------------


def test_bytes_are_packed_each_document_ended_by_256(tmp_path: Path) -> None:
    c = prepare(made(tmp_path / "in"), cache_dir=tmp_path / "cache")
    assert (c.vocab, c.eos, c.dtype, c.tokenized) == (257, 256, "uint16", True)
    assert read(c.path) == byte_tokens(IN_ORDER)  # the empty document left no mark
    assert c.tokens == len(byte_tokens(IN_ORDER))


def test_a_tokenizer_packs_its_ids_each_document_ended_by_its_eos(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    from transformers import AutoTokenizer

    tok_dir = make_tokenizer(DOCS * 5)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    c = prepare(made(tmp_path / "in"), cache_dir=tmp_path / "cache", tokenizer=tok_dir)
    expected = [i for d in IN_ORDER for i in [*tok(d, add_special_tokens=False)["input_ids"],
                                              tok.eos_token_id]]  # fmt: skip
    assert read(c.path) == expected
    assert len(expected) < len(byte_tokens(IN_ORDER))  # its merges really were used
    assert (c.eos, c.vocab) == (tok.eos_token_id, len(tok))


def test_the_token_file_is_cut_into_seq_len_plus_one_windows(tmp_path: Path) -> None:
    """The job reads the cached file as a ``tokens`` job reads its file: sample k is tokens
    k·T .. k·T + T (T + 1 of them, the last one the next sample's first)."""
    c = prepare(made(tmp_path / "in"), cache_dir=tmp_path / "cache")
    tokens, seq = read(c.path), 16
    data = TokenFile(c.path, seq_len=seq, dtype=c.dtype)
    assert len(data) == (len(tokens) - 1) // seq
    for k in range(len(data)):
        assert data[k].tolist() == tokens[k * seq : k * seq + seq + 1]


# -- the key -------------------------------------------------------------------------------------


def _key(root: Path, field: str = "text", tokenizer: Path | None = None) -> str:
    encoder = ByteEncoder() if tokenizer is None else HFEncoder(tokenizer, "data.tokenizer")
    return cache_mod.corpus_key(expand(globs(root)), field, encoder.digest)


def test_the_key_follows_content_field_and_tokenizer_only(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    files = corpus(tmp_path / "a")
    base = _key(tmp_path / "a")
    # Not otherwise: the same bytes elsewhere, touched, with other names.
    corpus(tmp_path / "b")
    os.utime(tmp_path / "b" / "a.txt", (1, 1))
    (tmp_path / "b" / "b.jsonl").rename(tmp_path / "b" / "renamed.jsonl")
    assert _key(tmp_path / "b") == base
    only_txt = [str(files["txt"])]
    assert cache_mod.corpus_key(expand(only_txt), "other", "bytes:eos=256") == cache_mod.corpus_key(
        expand(only_txt), "text", "bytes:eos=256"
    )  # no field is read from a .txt file
    # Content: one byte of one file.
    corpus(tmp_path / "c")
    (tmp_path / "c" / "a.txt").write_text(DOCS[0].replace("fox", "fix"))
    assert _key(tmp_path / "c") != base
    # Field.
    assert _key(tmp_path / "a", field="body") != base
    # Tokenizer: bytes vs a tokenizer, and a tokenizer whose one file changed.
    tok = make_tokenizer(DOCS)
    with_tok = _key(tmp_path / "a", tokenizer=tok)
    assert with_tok != base
    (tok / "weights.safetensors").write_bytes(b"not part of a tokenizer")
    assert _key(tmp_path / "a", tokenizer=tok) == with_tok
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    assert _key(tmp_path / "a", tokenizer=tok) != with_tok


# -- the cache -----------------------------------------------------------------------------------


def test_a_second_prepare_reuses_the_file_and_loads_no_tokenizer(
    tmp_path: Path, make_tokenizer: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = make_tokenizer(DOCS)
    inputs = made(tmp_path / "in")
    first = prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok)
    stamp = first.path.stat().st_mtime_ns, first.path.stat().st_ino

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache_mod, "_tokenize", forbidden)
    monkeypatch.setattr(HFEncoder, "load", forbidden)
    again = prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok)
    assert again == dataclasses.replace(first, tokenized=False)
    assert (again.path.stat().st_mtime_ns, again.path.stat().st_ino) == stamp


def test_a_damaged_cache_entry_is_tokenized_again(tmp_path: Path) -> None:
    inputs = made(tmp_path / "in")
    first = prepare(inputs, cache_dir=tmp_path / "cache")
    whole = first.path.read_bytes()
    first.path.write_bytes(whole[:-2])  # truncated behind our back
    again = prepare(inputs, cache_dir=tmp_path / "cache")
    assert again.tokenized and again.path.read_bytes() == whole


def test_the_cache_names_the_same_file_as_make_tokens_writes(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    tok = make_tokenizer(DOCS)
    inputs = made(tmp_path / "in")
    cached = prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok)
    script = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_tokens.py"), *inputs,
         "--tokenizer", str(tok), "--out", str(tmp_path / "t.bin")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "t.bin").read_bytes() == cached.path.read_bytes()
    direct = tokenize_to(tmp_path / "u.bin", inputs, tokenizer=tok)
    assert direct.path.read_bytes() == cached.path.read_bytes()


_RACER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from elaswave.data import cache, encode

    plain = encode.ByteEncoder.encode
    def slow(self, texts):
        time.sleep(0.25)
        return plain(self, texts)
    encode.ByteEncoder.encode = slow
    cache.BATCH_DOCS = 1  # one document per batch: a slow tokenizer
    notes = []
    class Notes:
        def note(self, line): notes.append(line)
        def start(self, what, total): pass
        def advance(self, n): pass
        def stop(self): pass
    start_at = float(sys.argv[3])
    time.sleep(max(0.0, start_at - time.time()))
    c = cache.prepare([sys.argv[1]], cache_dir=Path(sys.argv[2]), progress=Notes())
    print(json.dumps({"tokenized": c.tokenized, "path": str(c.path), "notes": notes}))
    """
)


def test_racing_launches_tokenize_once_and_both_get_the_whole_file(tmp_path: Path) -> None:
    """Two processes on one cache directory, started together: one tokenizes (six batches, ~1.5
    s), the other waits for its lock and then reuses the file."""
    docs = [f"document {i} " * 20 for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    start_at = str(time.time() + 2.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path / "in.jsonl"),
                          str(tmp_path / "cache"), start_at],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["tokenized"] for r in results) == [False, True]
    waiter = next(r for r in results if not r["tokenized"])
    assert any(n.startswith("waiting for ") for n in waiter["notes"]), waiter  # really raced
    assert results[0]["path"] == results[1]["path"]
    assert read(Path(results[0]["path"])) == byte_tokens(docs)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")) == []


def test_a_tokenizer_killed_midway_leaves_nothing_cached(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": "x" * 50}) + "\n"
                                               for _ in range(40)))  # fmt: skip
    cache = tmp_path / "cache"
    p = subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path / "in.jsonl"), str(cache),
                          "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 30
    while not list(cache.glob(".*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(cache.glob(".*.tmp")), "never started writing"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert not list(cache.glob("*.tokens")) and not list(cache.glob("*.json"))
    c = prepare([str(tmp_path / "in.jsonl")], cache_dir=cache)  # the lock died with it
    assert c.tokenized and read(c.path) == byte_tokens(["x" * 50] * 40)
    assert not list(cache.glob(".*.tmp"))  # the dead writer's leftovers are gone


def test_bytes_and_a_cached_tokenizer_import_no_torch(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    tok = make_tokenizer(DOCS)
    inputs = made(tmp_path / "in")
    prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok)
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from elaswave.data.text import prepare
        prepare({inputs!r}, cache_dir=Path({str(tmp_path / "b")!r}))
        c = prepare({inputs!r}, cache_dir=Path({str(tmp_path / "cache")!r}),
                    tokenizer=Path({str(tok)!r}))
        assert not c.tokenized
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# -- bad input: one line each --------------------------------------------------------------------


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


BAD: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("no match", lambda d: [str(d / "*.txt")], "no file matches '{d}/*.txt'"),
    ("empty txt", lambda d: [str(_write(d / "e.txt", b""))], "{d}/e.txt has no text"),
    ("empty jsonl", lambda d: [str(_write(d / "e.jsonl", '{"text": ""}\n\n'))],
     "{d}/e.jsonl has no text"),
    ("empty parquet", lambda d: [str(_parquet(d / "e.parquet", {"text": pa.array([], "string")}))],
     "{d}/e.parquet has no text"),
    ("missing field", lambda d: [str(_write(d / "m.jsonl", '{"text": "a"}\n{"body": "b"}\n'))],
     "{d}/m.jsonl:2: no 'text' field"),
    ("not json", lambda d: [str(_write(d / "m.jsonl", '{"text": "a"}\n{text: b}\n'))],
     "{d}/m.jsonl:2: not valid JSON"),
    ("not an object", lambda d: [str(_write(d / "m.jsonl", '["a"]\n'))],
     "{d}/m.jsonl:1: not a JSON object"),
    ("field not text", lambda d: [str(_write(d / "m.jsonl", '{"text": 3}\n'))],
     "{d}/m.jsonl:1: 'text' is int, not text"),
    ("missing column", lambda d: [str(_parquet(d / "m.parquet", {"body": ["a"]}))],
     "{d}/m.parquet has no column 'text' (data.text_field; columns: body)"),
    ("null row", lambda d: [str(_parquet(d / "m.parquet", {"text": ["a", None]}))],
     "{d}/m.parquet row 1: 'text' is null"),
    ("column not text", lambda d: [str(_parquet(d / "m.parquet", {"text": [1, 2]}))],
     "{d}/m.parquet: column 'text' is int64, not text"),
    ("not parquet", lambda d: [str(_write(d / "m.parquet", "hello"))],
     "{d}/m.parquet is not a parquet file"),
    ("latin-1 txt", lambda d: [str(_write(d / "l.txt", "café".encode("latin-1")))],
     "{d}/l.txt is not UTF-8 text (byte 3"),
    ("latin-1 jsonl", lambda d: [str(_write(d / "l.jsonl", b'{"text": "a"}\n{"text": "\xe9"}\n'))],
     "{d}/l.jsonl line 2 is not UTF-8 text"),
    ("lone surrogate", lambda d: [str(_write(d / "s.jsonl", '{"text": "a\\ud800b"}\n'))],
     "{d}/s.jsonl is not UTF-8 text"),
    ("other kind", lambda d: [str(_write(d / "x.csv", "a,b"))],
     "{d}/x.csv is not a .txt, .md, .jsonl or .parquet file"),
]  # fmt: skip


def _parquet(path: Path, columns: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize(
    ("files", "fragment"), [(f, m) for _, f, m in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input_is_one_line_naming_the_file(
    tmp_path: Path, files: Callable[[Path], list[str]], fragment: str
) -> None:
    d = tmp_path / "in"
    d.mkdir()
    with pytest.raises(ConfigError) as err:
        prepare(files(d), cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and fragment.format(d=d) in message, message
    assert not list((tmp_path / "cache").glob("*.tokens"))  # nothing cached


def test_a_vocabulary_past_the_models_is_refused_before_tokenizing(
    tmp_path: Path, make_tokenizer: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = made(tmp_path / "in")
    with pytest.raises(
        ConfigError,
        match=r"^data: UTF-8 bytes has a vocabulary of 257 \(end of "
        r"document 256 included\), more than the model's vocab_size 256$",
    ):
        prepare(inputs, cache_dir=tmp_path / "cache", vocab_size=256)
    tok = make_tokenizer(DOCS, vocab=300)
    monkeypatch.setattr(cache_mod, "_tokenize", lambda *a, **k: pytest.fail("tokenized first"))
    with pytest.raises(ConfigError, match=r"has a vocabulary of 300 .* vocab_size 299$"):
        prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok, vocab_size=299)
    monkeypatch.undo()
    prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok, vocab_size=300)
    with pytest.raises(ConfigError, match="vocab_size 299$"):  # a cached file: checked too
        prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok, vocab_size=299)


@pytest.mark.parametrize("case", ["missing", "unloadable", "no eos", "empty"])
def test_a_tokenizer_that_cannot_serve_is_one_line(
    tmp_path: Path, make_tokenizer: Callable[..., Path], case: str
) -> None:
    inputs = made(tmp_path / "in")
    tok = tmp_path / "tok"
    if case == "unloadable":
        tok.mkdir()
        (tok / "tokenizer.json").write_text("{not json")
        (tok / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    elif case == "no eos":
        tok = make_tokenizer(DOCS, eos=None)
    elif case == "empty":
        tok.mkdir()
    fragment = {
        "missing": "is not a directory",
        "unloadable": "cannot load a tokenizer from it",
        "no eos": "has no eos_token",
        "empty": "holds no tokenizer files",
    }[case]
    with pytest.raises(ConfigError) as err:
        prepare(inputs, cache_dir=tmp_path / "cache", tokenizer=tok)
    assert "\n" not in str(err.value) and fragment in str(err.value), str(err.value)
    assert str(err.value).startswith(f"data.tokenizer {str(tok)!r}")


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = corpus(tmp_path / "in")["parquet"]
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"needs pyarrow: pip install 'elaswave\[hf\]'$"):
        prepare([str(path)], cache_dir=tmp_path / "cache")


def test_an_unwritable_cache_dir_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir .*: cannot create it"):
        prepare(made(tmp_path / "in"), cache_dir=tmp_path / "file" / "cache")


def test_a_hit_needs_no_write_access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache others filled, mounted read-only: a hit is served without writing (no lock, no
    directory made); a miss is the one-line refusal."""
    inputs, cache = made(tmp_path / "in"), tmp_path / "cache"
    c = prepare(inputs, cache_dir=cache)

    def read_only(path: Path) -> None:
        raise ConfigError(f"data.cache_dir {str(path)!r} is not writable")

    monkeypatch.setattr(cache_mod, "_make_dir", read_only)
    monkeypatch.setattr(cache_mod, "_locked", lambda *a: pytest.fail("locked for a hit"))
    assert prepare(inputs, cache_dir=cache).path == c.path
    (tmp_path / "in" / "a.txt").write_text("changed")
    with pytest.raises(ConfigError, match="is not writable"):
        prepare(inputs, cache_dir=cache)


# -- the job's config ----------------------------------------------------------------------------


def _text_job(tmp_path: Path, **data: Any) -> JobConfig:
    corpus(tmp_path / "in")
    return JobConfig.from_dict({
        "model": {"vocab_size": 260, "seq_len": 8},
        "data": {"source": "text", "files": globs(tmp_path / "in"),
                 "cache_dir": str(tmp_path / "cache"), **data},
    })  # fmt: skip


def test_resolve_text_names_the_token_file_the_workers_read(tmp_path: Path) -> None:
    cfg = resolve_text(_text_job(tmp_path))
    assert cfg.data.source == "text" and cfg.data.dtype == "uint16"
    path = Path(cfg.data.path or "")
    assert path.is_absolute() and path.parent == (tmp_path / "cache").resolve()
    assert read(path) == byte_tokens(IN_ORDER)
    # What the workers get (the config as a dict) builds the same config and reads that file.
    again = JobConfig.from_dict(cfg.to_dict())
    assert again == cfg
    from elaswave.runtime.workload.load import load_workload

    data = load_workload(again).dataset(again.train.seed)
    assert data[0].tolist() == read(path)[:9]


def test_hosts_agree_on_the_same_text_reached_by_other_paths(tmp_path: Path) -> None:
    from elaswave.config.jobs import config_difference, training_config

    one = resolve_text(_text_job(tmp_path / "h1"))
    two = resolve_text(_text_job(tmp_path / "h2"))
    assert one.data.path != two.data.path  # another cache, other globs
    assert config_difference(training_config(one), training_config(two)) == ""
    job = _text_job(tmp_path / "h3")
    (tmp_path / "h3" / "in" / "a.txt").write_text("other text")
    three = resolve_text(job)
    diff = config_difference(training_config(one), training_config(three))
    assert diff.startswith("data.path: job has "), diff


def test_resolve_text_takes_model_pretrained_s_tokenizer(
    tmp_path: Path, make_tokenizer: Callable[..., Path]
) -> None:
    tok = make_tokenizer(DOCS)
    (tok / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512}))
    cfg = _text_job(tmp_path).to_dict()
    cfg["model"] = {"source": "hf", "pretrained": str(tok), "seq_len": 8}
    resolved = resolve_text(JobConfig.from_dict(cfg))
    c = prepare(globs(tmp_path / "in"), cache_dir=tmp_path / "cache", tokenizer=tok)
    assert resolved.data.path == str(c.path.resolve()) and not c.tokenized


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"path": "x.bin"}, "data.path is for data.source: tokens"),
        ({"files": []}, "data.source=text needs data.files"),
    ],
)
def test_resolve_text_refuses(tmp_path: Path, data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_text(_text_job(tmp_path, **data))


def test_too_little_text_for_one_sample(tmp_path: Path) -> None:
    _write(tmp_path / "in" / "s.txt", "abc")
    cfg = JobConfig.from_dict({"model": {"vocab_size": 257, "seq_len": 8}, "data": {
        "source": "text", "files": [str(tmp_path / "in" / "s.txt")],
        "cache_dir": str(tmp_path / "cache")}})  # fmt: skip
    with pytest.raises(ConfigError, match="4 tokens is too short for one sample of seq_len 8"):
        resolve_text(cfg)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"data": {"files": ["a.txt"]}}, "data.files needs data.source: text"),
        ({"data": {"source": "tokens", "path": "t.bin", "tokenizer": "t"}},
         "data.tokenizer needs data.source: text"),
        ({"data": {"source": "text", "files": ["a.txt"], "text_field": " "}},
         "data.text_field must name"),
        ({"model": {"source": "module", "factory": "m:f"},
          "data": {"source": "text", "files": ["a.txt"]}}, "a model.source: module workload"),
    ],
)  # fmt: skip
def test_text_config_errors(config: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        JobConfig.from_dict(config)


def test_model_vocab_without_building_the_model(tmp_path: Path) -> None:
    from elaswave.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300}))
    assert model_vocab(ModelConfig(vocab_size=300)) == 300
    assert model_vocab(ModelConfig(source="hf", hf={"model_type": "llama", "vocab_size": 9})) == 9
    assert model_vocab(ModelConfig(source="hf", hf={"model_type": "llama"})) is None
    assert model_vocab(ModelConfig(source="hf", pretrained=str(tmp_path))) == 300


# -- what launch shows ---------------------------------------------------------------------------


def test_on_a_terminal_tokenizing_is_a_bar(tmp_path: Path) -> None:
    text = StringIO()
    console = Console(file=text, width=120, force_terminal=True)
    c = prepare(made(tmp_path / "in"), cache_dir=tmp_path / "cache",
                progress=TokenizingView(console, interactive=True))  # fmt: skip
    shown = text.getvalue()
    assert "tokenizing" in shown and "━" in shown and "1.6/1.6 kB" in shown, shown
    assert f"tokenized into {c.path}" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\s*\n\s*", "", shown)


def test_off_a_terminal_tokenizing_is_plain_lines(tmp_path: Path) -> None:
    text = StringIO()
    view = TokenizingView(Console(file=text, width=200), interactive=False)
    inputs = made(tmp_path / "in")
    c = prepare(inputs, cache_dir=tmp_path / "cache", progress=view)
    prepare(inputs, cache_dir=tmp_path / "cache", progress=view)
    lines = text.getvalue().splitlines()
    assert re.fullmatch(
        r"tokenizing [\d.]+ (bytes|KB) of text \(once: the tokens are cached\)", lines[0]
    )
    assert re.fullmatch(rf"tokenized into {re.escape(str(c.path))} \({c.tokens} tokens, "
                        r"\d+\.\d s\)", lines[1])  # fmt: skip
    assert lines[2] == f"tokens cached: {c.path} ({c.tokens} tokens)"
    assert len(lines) == 3
