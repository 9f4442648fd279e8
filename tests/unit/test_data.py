from pathlib import Path

import numpy as np
import pytest
import torch

from elaswave.runtime.workload.data import (
    MicroBatch,
    SyntheticTokens,
    TokenFile,
    microbatches,
    sample_ids,
    write_token_file,
)
from elaswave.runtime.workload.gpt import GPTConfig, GPTWorkload


@pytest.mark.parametrize(
    ("num_samples", "global_batch"),
    [(16, 4), (10, 3), (7, 7), (5, 8), (1, 1), (13, 1), (3, 10)],
)
def test_sample_ids_cover_each_epoch_exactly_once(num_samples: int, global_batch: int) -> None:
    epochs = 3
    steps = -(-epochs * num_samples // global_batch)
    stream: list[int] = []
    for step in range(1, steps + 1):
        ids = sample_ids(11, step, global_batch, num_samples=num_samples)
        assert len(ids) == global_batch
        stream.extend(ids)
    for e in range(epochs):
        chunk = stream[e * num_samples : (e + 1) * num_samples]
        assert sorted(chunk) == list(range(num_samples))


def test_sample_ids_deterministic_and_pure() -> None:
    first = sample_ids(3, 5, 8, num_samples=100)
    sample_ids(3, 1, 8, num_samples=100)
    sample_ids(4, 5, 8, num_samples=100)
    assert sample_ids(3, 5, 8, num_samples=100) == first
    assert all(isinstance(i, int) for i in first)


def test_sample_ids_match_numpy_permutation() -> None:
    perm = np.random.Generator(np.random.PCG64([3, 0])).permutation(100)
    assert sample_ids(3, 2, 8, num_samples=100) == perm[8:16].tolist()


def test_sample_ids_seed_and_epoch_change_order() -> None:
    a = [i for s in range(1, 6) for i in sample_ids(0, s, 4, num_samples=20)]
    b = [i for s in range(1, 6) for i in sample_ids(1, s, 4, num_samples=20)]
    c = [i for s in range(6, 11) for i in sample_ids(0, s, 4, num_samples=20)]
    assert a != b
    assert a != c


@pytest.mark.parametrize(
    "args", [(0, 0, 4, 10), (0, 1, 0, 10), (0, 1, 4, 0), (0, 1, -1, 10), (-1, 1, 4, 10)]
)
def test_sample_ids_rejects_bad_sizes(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        seed, step, global_batch, num_samples = args
        sample_ids(seed, step, global_batch, num_samples=num_samples)


def test_synthetic_tokens_deterministic() -> None:
    ds = SyntheticTokens(seed=1, vocab_size=50, seq_len=16, num_samples=20)
    again = SyntheticTokens(seed=1, vocab_size=50, seq_len=16, num_samples=20)
    other = SyntheticTokens(seed=2, vocab_size=50, seq_len=16, num_samples=20)
    assert len(ds) == 20
    x = ds[3]
    assert x.dtype == torch.int64 and x.shape == (17,)
    assert int(x.min()) >= 0 and int(x.max()) < 50
    assert torch.equal(x, again[3])
    assert torch.equal(x, ds[np.int64(3)])
    assert not torch.equal(x, ds[4])
    assert not torch.equal(x, other[3])


def test_synthetic_tokens_are_predictable() -> None:
    ds = SyntheticTokens(seed=0, vocab_size=64, seq_len=64, num_samples=32)
    seqs = torch.stack([ds[i] for i in range(len(ds))])
    pairs = seqs[:, :-1] * 64 + seqs[:, 1:]
    distinct_bigrams = torch.unique(pairs).numel()
    assert distinct_bigrams < 0.25 * 64 * 64


@pytest.mark.parametrize("bad", [-1, 20, 100])
def test_synthetic_tokens_index_error(bad: int) -> None:
    ds = SyntheticTokens(seed=0, vocab_size=10, seq_len=4, num_samples=20)
    with pytest.raises(IndexError):
        ds[bad]


@pytest.mark.parametrize(("dtype", "high"), [("uint16", 2**16), ("uint32", 2**32)])
def test_token_file_round_trip(tmp_path: Path, dtype: str, high: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, high, size=103, dtype=np.int64)
    tokens[0] = high - 1
    path = tmp_path / f"tokens_{dtype}.bin"
    write_token_file(path, tokens, dtype=dtype)
    ds = TokenFile(path, seq_len=10, dtype=dtype)
    assert len(ds) == 10
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == torch.int64
        assert sample.tolist() == tokens[i * 10 : i * 10 + 11].tolist()
    with pytest.raises(IndexError):
        ds[10]


def test_token_file_from_list(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    write_token_file(path, list(range(9)))
    ds = TokenFile(str(path), seq_len=4)
    assert len(ds) == 2
    assert ds[1].tolist() == [4, 5, 6, 7, 8]


def test_token_file_bad_dtype(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, list(range(20)))
    with pytest.raises(ValueError, match="dtype"):
        TokenFile(path, seq_len=4, dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        write_token_file(path, [1, 2], dtype="float32")


def test_token_file_too_short(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    write_token_file(path, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="too short"):
        TokenFile(path, seq_len=4)
    empty = tmp_path / "empty.bin"
    write_token_file(empty, [])
    with pytest.raises(ValueError, match="too short"):
        TokenFile(empty, seq_len=4)


def test_token_file_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        TokenFile(tmp_path / "missing.bin", seq_len=4)


def test_write_token_file_rejects_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "x.bin", [0, 2**16])
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "x.bin", [-1, 3], dtype="uint32")


def test_gpt_collate_shifts_targets() -> None:
    ds = SyntheticTokens(seed=0, vocab_size=30, seq_len=8, num_samples=10)
    gpt = GPTWorkload(GPTConfig(vocab_size=30, seq_len=8, n_layer=1, n_head=1, d_model=4))
    inputs, targets = gpt.collate([ds[i] for i in [2, 5, 7]])
    assert inputs.shape == targets.shape == (3, 8)
    assert inputs.dtype == targets.dtype == torch.int64
    for row, i in enumerate([2, 5, 7]):
        assert torch.equal(inputs[row], ds[i][:-1])
        assert torch.equal(targets[row], ds[i][1:])


def test_microbatches_partition_the_step() -> None:
    mbs = microbatches(5, 3, 12, micro_batch_size=4, num_samples=50)
    assert [m.id for m in mbs] == [0, 1, 2]
    assert all(isinstance(m, MicroBatch) and len(m.sample_ids) == 4 for m in mbs)
    flat = [i for m in mbs for i in m.sample_ids]
    assert flat == sample_ids(5, 3, 12, num_samples=50)
    assert mbs == microbatches(5, 3, 12, micro_batch_size=4, num_samples=50)


def test_microbatches_single_and_errors() -> None:
    (only,) = microbatches(0, 1, 6, micro_batch_size=6, num_samples=10)
    assert only.id == 0 and len(only.sample_ids) == 6
    with pytest.raises(ValueError):
        microbatches(0, 1, 10, micro_batch_size=4, num_samples=10)
    with pytest.raises(ValueError):
        microbatches(0, 1, 8, micro_batch_size=0, num_samples=10)


def test_microbatch_is_frozen() -> None:
    mb = MicroBatch(id=0, sample_ids=(1, 2))
    with pytest.raises(AttributeError):
        mb.id = 1  # type: ignore[misc]
