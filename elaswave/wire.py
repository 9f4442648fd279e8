"""The daemon↔worker control channel's wire format: JSON objects, one per line, over a Unix socket.

Nothing received is unpickled; a malformed line is dropped. Message types:

worker → daemon: ``hello`` {worker_id, pid}, ``ready``, ``event`` {event}, ``commit`` {step, loss,
epoch, world, samples, t}, ``compute`` {step, epoch, per_mb}, ``layer_costs`` {step, epoch,
layer_seconds}, ``done`` {step}
daemon → worker: ``config`` {config, host_addr}, ``plan`` {plan}, ``fault`` {fault}, ``stop``
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 1 << 20


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any] | None:
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("type"), str) else None
