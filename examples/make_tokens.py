"""Turn text into a token file that ``data.source: tokens`` trains on.

    python examples/make_tokens.py FILES [FILES ...] --out tokens.bin [--tokenizer DIR]
                                   [--text-field text]

FILES are files or globs of .txt (one document each), .jsonl (one per line, its
``--text-field``) and .parquet (one per row of that column; needs pyarrow, the ``hf`` extra).
With ``--tokenizer``, a tokenizer you have locally (a directory ``save_pretrained`` wrote, e.g.
next to a model you fine-tune; nothing is downloaded) encodes the text, each document ended by
its end-of-text token. Without it, the text's UTF-8 bytes are the tokens (0..255) and 256 ends
each document: a vocabulary of 257 that needs no tokenizer (set the model's ``vocab_size`` to at
least 257).

This is what ``data.source: text`` does inside ``elaswave launch`` (the same library,
:mod:`elaswave.data.text`, byte for byte), minus the cache: use it to look at the tokens, or to
ship one file instead of the text. The file is the tokens back to back as unsigned integers
(uint16 when the vocabulary fits, else uint32); the script prints the ``data`` section to put
in the job config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elaswave.data.text import tokenize_to
from elaswave.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="text files or globs: .txt, .jsonl, .parquet")
    parser.add_argument("--out", required=True, type=Path, help="the token file to write")
    parser.add_argument(
        "--tokenizer", type=Path, help="a local tokenizer directory (default: bytes)"
    )
    parser.add_argument("--text-field", default="text", help="the .jsonl field / parquet column")
    args = parser.parse_args(argv)
    try:
        corpus = tokenize_to(
            args.out, args.files, text_field=args.text_field, tokenizer=args.tokenizer
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{corpus.tokens} tokens, vocabulary {corpus.vocab}, written to {args.out}")
    print(
        f"data: {{source: tokens, path: {args.out}, dtype: {corpus.dtype}}}"
        f"  # model vocab >= {corpus.vocab}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
