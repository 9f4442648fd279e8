"""What a ZeRO pipeline stage keeps between steps: the store of its intervals (moments, and under
ZeRO-3 the parameters too), and the window's buffers that ZeRO-3 frees and takes back."""

from __future__ import annotations

import pytest
import torch

from elaswave.runtime.optim import FlatParams, OptimHyper, Spans, update_
from elaswave.runtime.strategies.pipeline.stagestate import MomentStore

INTERVALS = [(10, 14), (20, 23)]


def _filled(params: bool) -> MomentStore:
    store = MomentStore(INTERVALS, params=params)
    for i, t in enumerate(store.arrays):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32) + 100 * i)
    return store


@pytest.mark.parametrize(("params", "width"), [(False, 2), (True, 3)])
def test_a_piece_travels_as_one_message_with_every_array(params: bool, width: int) -> None:
    store = _filled(params)
    assert len(store.arrays) == width and store.nbytes == width * 7 * 4
    message = store.packed(11, 13)
    assert message.numel() == width * 2
    other = MomentStore([(11, 13)], params=params)
    other.unpack(11, 13, message)
    for mine, theirs in zip(store.views(11, 13), other.views(11, 13), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("params", [False, True])
def test_fill_from_copies_exactly_what_both_keep(params: bool) -> None:
    source = _filled(params)
    target = MomentStore([(12, 22)], params=params)
    target.fill_from(source)
    for array, src in zip(target.arrays, source.arrays, strict=True):
        # kept by both: 12..14 (source slots 2, 3) and 20..22 (slots 4, 5); the rest stays 0
        expect = torch.zeros(10)
        expect[0:2], expect[8:10] = src[2:4], src[4:6]
        assert torch.equal(array, expect)


def test_a_zero3_store_updates_its_own_parameters_as_zero1_updates_the_window() -> None:
    """The same AdamW bits, whether the parameters are the store's (ZeRO-3) or the window's."""
    hyper = OptimHyper(lr=0.1)
    hyper.hold_groups(0, 30, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    window = torch.randn(30, generator=gen)
    grad = Spans(torch.randn(30, generator=gen))
    zero1, zero3 = MomentStore(INTERVALS), MomentStore(INTERVALS, params=True)
    for a, b in INTERVALS:
        zero3.views(a, b)[0].copy_(window[a:b])
    updated = window.clone()
    for step in (1, 2, 3):
        zero1.update(Spans(updated), grad, step, hyper=hyper)
        zero3.update(Spans(torch.full((30,), float("nan"))), grad, step, hyper=hyper)
    assert zero3.params is not None
    for a, b in INTERVALS:
        assert torch.equal(zero3.views(a, b)[0], updated[a:b])
        assert not torch.equal(updated[a:b], window[a:b])
    assert torch.equal(zero1.exp_avg, zero3.exp_avg)
    assert torch.equal(zero1.exp_avg_sq, zero3.exp_avg_sq)
    expect = window[10:14].clone()
    m, v = torch.zeros(4), torch.zeros(4)
    for step in (1, 2, 3):
        update_(
            expect,
            grad[10:14],
            m,
            exp_avg_sq=v,
            step=step,
            h=hyper,
            groups=hyper.groups_of(slice(10, 14)),
        )
    assert torch.equal(expect, updated[10:14])


def test_a_released_window_keeps_its_views_and_takes_memory_back() -> None:
    layer = torch.nn.Linear(3, 4)
    flat = FlatParams(layer)
    flat.release()
    assert flat.data.untyped_storage().nbytes() == flat.grad.untyped_storage().nbytes() == 0
    assert layer.weight.untyped_storage().nbytes() == 0  # the views share the freed storage
    flat.reserve()
    flat.data.copy_(torch.arange(16, dtype=torch.float32))
    assert torch.equal(layer.weight.detach().reshape(-1), torch.arange(12, dtype=torch.float32))
    assert flat.grads_in_place()
    flat.reserve()  # a second reserve changes nothing
    assert torch.equal(flat.data, torch.arange(16, dtype=torch.float32))


def test_the_parameter_gather_waits_as_a_collective() -> None:
    """A rank waiting in the gather for a peer that is gone (or cut off) must not look hung:
    the daemon's hang verdict spares a rank in a collective, never one stuck computing."""
    from types import SimpleNamespace

    from elaswave.planning.stageshards import Piece
    from elaswave.runtime.strategies.pipeline.stage import Pipeline

    phases: list[str] = []
    seen: list[str] = []

    def p2p(group: str, sends: list, recvs: list, *, abort: object) -> None:
        seen.append(phases[-1])
        for _, t, _ in recvs:
            t.fill_(7.0)

    pipe = object.__new__(Pipeline)
    pipe.e = SimpleNamespace(
        enter=phases.append,
        comm=SimpleNamespace(rank=lambda group: 1, p2p=p2p),
        state=SimpleNamespace(params=Spans(torch.zeros(8))),
    )
    pipe.gather = [Piece(src=0, dst=1, start=2, stop=5)]
    pipe._gather(lambda: False)
    assert seen == ["collective"] and phases[-1] == "compute"
    assert pipe.e.state.params[2:5].tolist() == [7.0, 7.0, 7.0]


def test_a_zero3_stage_reports_its_parts_when_the_end_cannot_gather() -> None:
    """When the job's last collective fails, a rank reports digests of what it holds without
    one: a ZeRO-3 stage's window is freed by then, so that is its parts."""
    from types import SimpleNamespace

    from elaswave.runtime.strategies.base import state_digests
    from elaswave.runtime.strategies.pipeline.strategy import PipelineStages

    strategy = object.__new__(PipelineStages)
    store = _filled(True)
    strategy.pipe = SimpleNamespace(store=store)
    held = strategy.held_here()
    assert [part for part, _ in held] == [0, 1, 2]
    assert all(t is kept for (_, t), kept in zip(held, store.arrays, strict=True))
    params, state = state_digests(held)
    assert params != state
