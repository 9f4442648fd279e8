"""Per-stage durable checkpoints: every rank writes what it owns, rank 0 commits, any reader gets
the whole state back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elaswave.runtime.durable.checkpoints import PIECES, DurableCheckpoints, latest, load

N = 40
# Three ranks' intervals: rank 1 owns two of them, rank 2 nothing (a replica's second holder).
OWNED = {0: [(0, 10)], 1: [(10, 25), (25, 40)], 2: []}


def _state(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    base = torch.arange(N, dtype=torch.float32) + step
    return base, base * 2, base * 3


def _save(directory: Path, step: int, ranks: list[int], *, commit_s: float = 30.0) -> None:
    params, m, v = _state(step)
    stores = {r: DurableCheckpoints(directory, commit_s=commit_s) for r in ranks}
    for r in sorted(ranks, reverse=True):  # rank 0 last: it waits for the others anyway
        pieces = [(a, b, params[a:b], m[a:b], v[a:b]) for a, b in OWNED[r]]
        stores[r].save_pieces_async(step, 0.5 + step, rank=r, world=3, attempt="e1", pieces=pieces)
    for store in stores.values():
        store.flush()
    if 0 in stores and stores[0]._committing is not None:
        stores[0]._committing.result()


def test_the_parts_of_every_rank_load_as_the_whole_state(tmp_path: Path) -> None:
    _save(tmp_path, 10, [0, 1, 2])
    path = latest(tmp_path)
    assert path == tmp_path / "step-00000010"
    index = json.loads((path / PIECES).read_text())
    assert index["pieces"] == [[0, 10, 0], [10, 25, 1], [25, 40, 1]]
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["rank-00000", "rank-00001"]
    state = load(path, N)
    params, m, v = _state(10)
    assert state.step == 10 and state.loss == 10.5
    assert torch.equal(state.params, params) and torch.equal(state.exp_avg, m)
    assert torch.equal(state.exp_avg_sq, v)


def test_a_checkpoint_missing_a_rank_is_never_visible(tmp_path: Path) -> None:
    _save(tmp_path, 10, [0, 1, 2])
    _save(tmp_path, 20, [0, 2], commit_s=0.3)  # rank 1 died before writing its part
    assert latest(tmp_path) == tmp_path / "step-00000010"
    assert load(tmp_path / "step-00000010", N).step == 10
    assert not (tmp_path / "step-00000020").exists()


def test_a_discarded_step_is_not_committed_later(tmp_path: Path) -> None:
    """A check found the state corrupt after step 10 was written: a commit of step 20 that was
    still waiting for a part must not land."""
    _save(tmp_path, 10, [0, 1, 2])
    params, m, v = _state(20)
    zero = DurableCheckpoints(tmp_path, commit_s=1.0)
    zero.save_pieces_async(20, 0.0, rank=0, world=3, attempt="e1",
                           pieces=[(0, 10, params[:10], m[:10], v[:10])])  # fmt: skip
    zero.discard_after(10)
    _save(tmp_path, 20, [1, 2])  # the other ranks' parts arrive after the discard
    assert zero._committing is not None
    zero._committing.result()
    assert latest(tmp_path) == tmp_path / "step-00000010"
    assert not list(tmp_path.glob("step-00000020*"))
    # The redone step 20, under the next plan, is written and committed as usual.
    params, m, v = _state(20)
    zero.save_pieces_async(20, 0.0, rank=0, world=3, attempt="e2",
                           pieces=[(0, 10, params[:10], m[:10], v[:10])])  # fmt: skip
    for r in (1, 2):
        store = DurableCheckpoints(tmp_path)
        pieces = [(a, b, params[a:b], m[a:b], v[a:b]) for a, b in OWNED[r]]
        store.save_pieces_async(20, 0.0, rank=r, world=3, attempt="e2", pieces=pieces)
        store.flush()
    zero._committing.result()
    assert latest(tmp_path) == tmp_path / "step-00000020"
    assert torch.equal(load(tmp_path / "step-00000020", N).params, params)


def test_a_part_of_another_model_size_is_a_clear_error(tmp_path: Path) -> None:
    _save(tmp_path, 10, [0, 1, 2])
    path = latest(tmp_path)
    assert path is not None
    with pytest.raises(ValueError, match="holds a model of 40 parameters, this one has 41"):
        load(path, N + 1)
