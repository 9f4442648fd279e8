"""Reading a job's stream back the way its readers do: TensorBoard's own two loaders (the Python
``EventAccumulator`` and the Rust data server that ``tensorboard`` uses by default where it is
installed) and a W&B offline run file."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def accumulate(run_dir: Path) -> Any:
    """A run directory loaded by TensorBoard's Python reader, every point kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def texts(acc: Any, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def data_server_scalars(logdir: Path, tags: list[str]) -> dict[str, dict[str, list[tuple]]]:
    """run -> tag -> [(step, value)] as TensorBoard's Rust data server loads ``logdir`` (every
    point: no downsampling); raises ``NoDataServerError`` where it is not installed."""
    from tensorboard.context import RequestContext
    from tensorboard.data import provider, server_ingester
    from tensorboard.util import grpc_util

    ingester = server_ingester.SubprocessServerDataIngester(
        server_ingester.get_server_binary(), str(logdir), reload_interval=0,
        channel_creds_type=grpc_util.ChannelCredsType.LOCAL, samples_per_plugin={"scalars": 0},
    )  # fmt: skip
    ingester.start()
    data, ctx = ingester.data_provider, RequestContext()
    deadline = time.monotonic() + 30
    while not data.list_runs(ctx, experiment_id="") and time.monotonic() < deadline:
        time.sleep(0.1)
    out = data.read_scalars(
        ctx, experiment_id="", plugin_name="scalars", downsample=1_000_000,
        run_tag_filter=provider.RunTagFilter(tags=tags),
    )  # fmt: skip
    return {
        run: {tag: [(p.step, p.value) for p in points] for tag, points in by_tag.items()}
        for run, by_tag in out.items()
    }


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): a 7-byte header, then 32 KiB blocks
    of chunks (crc32, length, type: full / first / middle / last), each record a protobuf. The
    file may be read while W&B's service still appends to it: a chunk cut short at the end is
    not read (nor the record it belongs to)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # the writer is still appending this chunk
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: Path, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every history row of the W&B offline run(s) under ``run_dir``, in order, as
    ``{"_step": int, key: value}``. W&B's own service process writes the file after the run
    has finished (``finish()`` returns first): read each once its ``exit`` record is there."""
    import json
    import time

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        deadline = time.monotonic() + timeout
        while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)):
            assert time.monotonic() < deadline, f"{path} was never finished"
            time.sleep(0.1)
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append(row)
    return rows
