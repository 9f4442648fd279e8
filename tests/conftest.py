"""For every test: jobs train on the CPU, on any machine. ``train.device`` defaults to an
accelerator where there is one, and the tests' jobs assume CPU workers (four on one host, gloo);
the GPU tests (``-m gpu``) ask for ``--device cuda`` themselves, which wins over this. Also a
fixture that makes a small real tokenizer, for the tests of training on text."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("ELASWAVE_TRAIN__DEVICE", "cpu")


@pytest.fixture
def make_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A real tokenizer made here, nothing downloaded: byte-level BPE trained on ``texts`` with
    the ``tokenizers`` library, ``eos`` its end-of-text token, saved by transformers'
    ``save_pretrained`` into a fresh directory (returned)."""

    def make(texts: list[str], *, vocab: int = 300, eos: str | None = "<eos>") -> Path:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=[eos] if eos else [], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
        core.train_from_iterator(texts, trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos)
        out = tmp_path_factory.mktemp("tokenizer")
        tok.save_pretrained(str(out))
        return out

    return make
