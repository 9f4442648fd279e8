"""A plan as a change to the plan before it: what every host receives when a plan is published.

Every host follows the job's plans. Sent whole, each plan costs its size times the number of
hosts: a worker lost at 4,000 hosts × 8 workers (a plan of some 190 KB when the hosts' workers
joined interleaved) would send some 760 MB. Yet a new plan is mostly the one before: the
survivors keep their order, a few ranks go, newcomers are appended. So the leader writes, in the
same transaction as the plan, the plan as a *delta* of a few hundred bytes: the base epoch, the
ranks as runs of the base's ranks plus the new workers, and every other field of the new plan
(small once encoded: counts are run-length encoded). A host that holds the base applies it; any
other (it just joined, or missed an epoch) reads the whole plan.

The text (JSON)::

    {"base": 4, "epoch": 5, "ranks": [[0, 13], [14, 2], ["node-7.w0", "node-7"]],
     "plan": {...the wire format of the plan without its workers and hosts...}}

``[a, n]`` is the base's ranks ``a`` … ``a + n - 1`` in order; ``[worker, host]`` one rank not
taken from the base. A first plan has no base: ``{"base": 0, "epoch": 1}``, nothing to apply.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from elaswave.planning import planwire

if TYPE_CHECKING:
    from elaswave.planning.plan import Plan


def encode_delta(base: Plan | None, new: Plan) -> str:
    """``new`` as a change to ``base`` (``None``: the first plan, which carries nothing)."""
    if base is None:
        return json.dumps({"base": 0, "epoch": new.epoch}, separators=(",", ":"))
    index = {w: r for r, w in enumerate(base.workers)}
    ranks: list[list[Any]] = []
    for w, h in zip(new.workers, new.hosts, strict=True):
        r = index.get(w)
        if r is None or base.hosts[r] != h:
            ranks.append([w, h])
        elif ranks and isinstance(ranks[-1][0], int) and sum(ranks[-1]) == r:
            ranks[-1][1] += 1  # the next base rank: the run grows
        else:
            ranks.append([r, 1])
    rest = json.loads(planwire.encode(replace(new, workers=(), hosts=())))
    return json.dumps(
        {"base": base.epoch, "epoch": new.epoch, "ranks": ranks, "plan": rest},
        separators=(",", ":"),
        ensure_ascii=True,
    )


def delta_epochs(text: str | bytes) -> tuple[int, int]:
    """(base epoch, epoch) of a delta; ``ValueError`` if the text is not one."""
    doc = _doc(text)
    return int(doc["base"]), int(doc["epoch"])


def apply_delta(base: Plan, text: str | bytes) -> Plan:
    """The plan ``text`` describes as a change to ``base``. ``ValueError`` when it is not a
    change to this base (another base epoch, a first plan, ranks outside the base, a field
    missing or of the wrong type): the caller then reads the whole plan."""
    doc = _doc(text)
    if int(doc["base"]) != base.epoch or "plan" not in doc:
        raise ValueError(f"not a change to epoch {base.epoch}")
    workers: list[str] = []
    hosts: list[str] = []
    for item in doc["ranks"]:
        first, second = item
        if isinstance(first, int) and isinstance(second, int):
            if first < 0 or second < 1 or first + second > base.world_size:
                raise ValueError(f"ranks {first}..{first + second - 1} are not in the base")
            workers += base.workers[first : first + second]
            hosts += base.hosts[first : first + second]
        elif isinstance(first, str) and isinstance(second, str):
            workers.append(first)
            hosts.append(second)
        else:
            raise ValueError(f"bad rank item {item!r}")
    rest = planwire.decode(json.dumps(doc["plan"]))
    if rest.epoch != int(doc["epoch"]):
        raise ValueError("the delta's epoch and its plan's differ")
    return replace(rest, workers=tuple(workers), hosts=tuple(hosts))


def _doc(text: str | bytes) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"a plan delta is not JSON ({exc})") from None
    if not isinstance(doc, dict) or "base" not in doc or "epoch" not in doc:
        raise ValueError("not a plan delta")
    return doc
