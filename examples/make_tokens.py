"""Turn text into a token file that ``data.source: tokens`` trains on.

    python examples/make_tokens.py TEXT [TEXT ...] --out tokens.bin [--tokenizer DIR]

With ``--tokenizer``, a tokenizer you have locally (a directory ``save_pretrained`` wrote, e.g.
next to a model you fine-tune; nothing is downloaded) encodes the text, documents separated by
its end-of-text token. Without it, the text's UTF-8 bytes are the tokens: a vocabulary of 256
that needs no tokenizer (set the model's ``vocab_size`` to at least 256).

The file is the tokens back to back as unsigned integers (uint16 when the vocabulary fits,
else uint32); the script prints the ``data`` section to put in the job config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def encode(texts: list[str], tokenizer: str | None) -> tuple[np.ndarray, int]:
    """The tokens of ``texts`` and the vocabulary size they are drawn from."""
    if tokenizer is None:
        data = b"".join(t.encode("utf-8") for t in texts)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64), 256
    from transformers import AutoTokenizer  # the hf extra

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int64), len(tok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="+", type=Path, help="UTF-8 text files")
    parser.add_argument("--out", required=True, type=Path, help="the token file to write")
    parser.add_argument("--tokenizer", help="a local tokenizer directory (default: bytes)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.text if not p.is_file()]
    if missing:
        print(f"error: no such file: {missing[0]}", file=sys.stderr)
        return 2
    texts = [p.read_text(encoding="utf-8") for p in args.text]
    try:
        tokens, vocab = encode(texts, args.tokenizer)
    except (OSError, ValueError) as exc:
        print(f"error: tokenizer {args.tokenizer}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    dtype = "uint16" if vocab <= np.iinfo(np.uint16).max + 1 else "uint32"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype(dtype).tofile(args.out)
    print(f"{len(tokens)} tokens, vocabulary {vocab}, written to {args.out}")
    print(f"data: {{source: tokens, path: {args.out}, dtype: {dtype}}}  # model vocab >= {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
