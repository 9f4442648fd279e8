"""A durable checkpoint counts only when every file it lists is whole and unchanged: each way a
checkpoint rots (a file truncated, a byte flipped, a file or its metadata deleted, never
finished) is caught, named, and passed over for the newest intact one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elaswave.runtime.durable.checkpoints import DurableCheckpoints, load
from elaswave.runtime.durable.layout import MANIFEST, check, newest_intact, resume_point

N = 1000


def _whole(root: Path, *steps: int) -> None:
    store = DurableCheckpoints(root, keep=5)
    for step in steps:
        t = torch.arange(N, dtype=torch.float32) + step
        store.save_async(step, float(step), t, exp_avg=t * 2, exp_avg_sq=t * 3)
        store.flush()


def _pieces(root: Path, step: int) -> None:
    t = torch.arange(N, dtype=torch.float32) + step
    stores = [DurableCheckpoints(root, keep=5) for _ in range(2)]
    owned = [(0, 400), (400, N)]
    for r in (1, 0):
        a, b = owned[r]
        stores[r].save_pieces_async(step, float(step), rank=r, world=2, attempt="e1",
                                    pieces=[(a, b, t[a:b], t[a:b], t[a:b])])  # fmt: skip
    for s in stores:
        s.flush()
    assert stores[0]._committing is not None
    stores[0]._committing.result()


def _data_file(path: Path) -> Path:
    return max((p for p in path.rglob("*.distcp")), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> str:
    f = _data_file(path)
    size = f.stat().st_size
    with f.open("r+b") as fh:
        fh.truncate(size // 2)
    return f"{f.relative_to(path).as_posix()} has {size // 2} of its {size} bytes"


def _flip(path: Path) -> str:
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    return f"{f.relative_to(path).as_posix()} does not match its checksum"


def _drop_metadata(path: Path) -> str:
    meta = path / ".metadata" if (path / ".metadata").is_file() else path / "pieces.json"
    meta.unlink()
    return f"{meta.name} is missing"


def _drop_manifest(path: Path) -> str:
    (path / MANIFEST).unlink()
    return f"{MANIFEST} is missing (never finished, or written without checksums)"


ROTS: dict[str, Callable[[Path], str]] = {
    "truncated": _truncate, "flipped": _flip, "metadata": _drop_metadata,
    "manifest": _drop_manifest,
}  # fmt: skip


@pytest.mark.parametrize("layout", ["whole", "pieces"])
@pytest.mark.parametrize("rot", sorted(ROTS))
def test_a_rotten_checkpoint_is_passed_over_for_the_one_before(
    tmp_path: Path, layout: str, rot: str
) -> None:
    for step in (10, 20):
        _whole(tmp_path, step) if layout == "whole" else _pieces(tmp_path, step)
    newest = tmp_path / "step-00000020"
    assert check(newest) is None and newest_intact(tmp_path).path == newest
    why = ROTS[rot](newest)
    assert check(newest) == why
    choice = newest_intact(tmp_path)
    assert choice.path == tmp_path / "step-00000010" and choice.step == 10
    assert choice.failures() == f"step-00000020: {why}"
    assert torch.equal(load(choice.path, N).params, torch.arange(N, dtype=torch.float32) + 10)
    # An explicit --resume of the rotten one is refused, naming the file and the way out.
    path, refused = resume_point(tmp_path)
    assert path is None and refused.count("\n") == 0
    assert why in refused and "--resume" in refused and "step-00000010" in refused
    assert resume_point(tmp_path / "step-00000010") == (tmp_path / "step-00000010", "")


def test_none_intact_and_none_at_all(tmp_path: Path) -> None:
    assert newest_intact(tmp_path / "absent").path is None
    assert resume_point(tmp_path) == (
        None,
        f"--resume: no complete durable checkpoint in {tmp_path}",
    )
    _whole(tmp_path, 5)
    _truncate(tmp_path / "step-00000005")
    choice = newest_intact(tmp_path)
    assert choice.path is None and choice.failures().startswith("step-00000005: ")


def test_a_manifest_that_lies_or_is_garbage(tmp_path: Path) -> None:
    _whole(tmp_path, 5)
    path = tmp_path / "step-00000005"
    (path / MANIFEST).write_text("{not json")
    assert check(path) == f"{MANIFEST} is unreadable"
    (path / MANIFEST).write_text('{"files": {}}')
    assert check(path) == f"{MANIFEST} lists neither .metadata nor pieces.json"


def test_export_reads_only_an_intact_checkpoint(tmp_path: Path) -> None:
    from elaswave.errors import ElasWaveError
    from elaswave.export import find_checkpoint

    _whole(tmp_path, 10, 20)
    why = _flip(tmp_path / "step-00000020")
    assert find_checkpoint(tmp_path, None) == (tmp_path / "step-00000010", f"step-00000020: {why}")
    assert find_checkpoint(tmp_path, 10) == (tmp_path / "step-00000010", "")
    with pytest.raises(ElasWaveError, match=f"step 20 in .* failed its check: {why}"):
        find_checkpoint(tmp_path, 20)
    _truncate(tmp_path / "step-00000010")
    with pytest.raises(ElasWaveError, match="no intact checkpoint in .*step-00000020: .*"):
        find_checkpoint(tmp_path, None)
