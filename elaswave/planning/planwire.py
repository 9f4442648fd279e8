"""The wire format of a :class:`~elaswave.planning.plan.Plan`: the text the leader publishes.

The leader writes the plan under one etcd key (compare-and-set) and every host watches it, so one
plan must fit in one etcd request (1.5 MiB by default). Listing every worker id, host and count
passes that at about 30,000 ranks. Real plans repeat themselves, though: hosts are numbered, a
host's workers are ``<host>.w0`` … ``<host>.w7``, counts and layer cuts are mostly equal, ranks
often follow the hosts. Version 2 writes those repetitions as runs, yet any plan (any strings)
round-trips exactly, and it stays JSON that ``status`` and people can read. At 100,000 ranks
(12,500 hosts × 8, respawns among them, 1,000 workers departed) a plan takes about 70 KB for
data parallelism and 105 KB for pp=16 with replicas cut differently, where the plain format took
3.4 and 4.6 MB; ranks in no order of the hosts (workers that joined interleaved) add about 6
bytes each. One object, compact separators, ASCII only (``\\u`` escapes, so that even lone
surrogates survive as bytes):

- ``v``: 2. A text without ``v`` is the plain format of before (every field a full list), which
  :func:`decode` still reads.
- ``epoch``, ``committed``, ``created``, ``store``, ``reason``: the plan's own.
- ``hosts``: a table of names that the worker items refer to by index, sorted (numbers by their
  value). An item is a name, or a numbered run ``[prefix, first, count]`` (or with a fourth
  entry, a suffix): ``count`` names ``prefix + number + suffix``, the numbers counting up from
  ``first`` zero-padded to its width (``["node-", "0998", 3]``: ``node-0998`` … ``node-1000``).
- ``workers``: the plan's workers, each on the host it names, listed by host and slot (so that
  a host's workers make one run however their ranks interleave), as items:

  - ``[h, s, n]``: ``n`` workers ``<host>.w<s>`` … ``<host>.w<s+n-1>`` of host ``hosts[h]``;
    ``[h, s, n, k]``: the same for ``k`` hosts in turn, ``hosts[h]`` … ``hosts[h+k-1]``;
  - ``[h, "suffix"]``: one worker ``<host>.<suffix>`` (a respawn ``w3.r2``, say);
  - ``[h, null, "id"]``: one worker whose id does not start with ``<host>.``.

- ``ranks``: rank ``r``'s worker is ``workers[ranks[r]]`` (the listing expanded); an item ``i``
  is one index, ``[i, n]`` the ``n`` indices ``i`` … ``i+n-1``. Ranks that follow the hosts give
  ``[[0, world]]``; workers that joined interleaved cost an index each (about 6 bytes).
- ``departed``, ``evicted``: worker ids in their order, as the items of ``workers`` (the host
  names only the part of the id before ``.w<slot>``) or a bare ``"id"`` of any other shape.
- ``microbatches``, ``shares``: counts; an item ``c`` is one count, ``[c, n]`` ``n`` times ``c``.
- ``replicas``: ``[start, stages, n]``: ``n`` replicas of ``stages`` consecutive ranks each, from
  rank ``start`` on; ``{"ranks": [...]}``: a replica of any other shape.
- ``bounds``: ``[[b0, b1, …], n]``: ``n`` replicas in turn whose layers are cut at these bounds.
- ``racks`` (only when some host was launched with ``--rack``): ``[host, rack]`` pairs, by host.

For example, two hosts of four workers, one of them respawned, and the worker it replaced::

    {"v":2,"epoch":3,"committed":120,"created":1700000000.5,"store":"10.0.0.1:29500",
     "reason":"...","hosts":[["node-","00",2]],"workers":[[0,0,4],[1,0,2],[1,"w2.r1"],[1,3,1]],
     "ranks":[[0,8]],"microbatches":[[3,4],[2,4]],"replicas":[],"bounds":[],"shares":[],
     "departed":[[1,2,1]],"evicted":[]}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeGuard

from elaswave.planning.plan import Plan, run_lengths

VERSION = 2

_MAX_DIGITS = 18  # longer numbers stay plain names (int() refuses over 4,300 digits)
_DIGITS = frozenset("0123456789")  # ASCII only: int() reads other digits, str() never writes them
_SLOT = re.compile(r"w(0|[1-9][0-9]{0,17})")  # exactly as ``f"w{slot}"`` writes it
_SLOT_START = re.compile(r"w([0-9]{1,18})")  # the slot of a respawn's ``w3.r2``
_WORKER = re.compile(r"(.*)\.(w[0-9]+(?:\.r[0-9]+)?)", re.DOTALL)  # <host>.w<slot>[.r<n>]


def encode(plan: Plan) -> str:
    """The plan as version-2 text."""
    gone = [_split_worker(w) for w in (*plan.departed, *plan.evicted)]
    names = sorted({*plan.hosts, *(g[0] for g in gone if g)}, key=_natural)
    index = {name: h for h, name in enumerate(names)}
    tokens = [
        _relative(index[host], worker[len(host) + 1 :])
        if worker.startswith(host + ".")
        else (index[host], None, worker)
        for worker, host in zip(plan.workers, plan.hosts, strict=True)
    ]
    listing = sorted(range(len(tokens)), key=lambda r: _listing_key(tokens[r]))
    at = [0] * len(listing)
    for i, r in enumerate(listing):
        at[r] = i
    wire = {
        "v": VERSION,
        "epoch": plan.epoch,
        "committed": plan.committed,
        "created": plan.created,
        "store": plan.store,
        "reason": plan.reason,
        "hosts": _name_items(names),
        "workers": _worker_items(tokens[r] for r in listing),
        "ranks": _index_items(at),
        "microbatches": _count_items(plan.microbatches),
        "replicas": _replica_items(plan.replicas),
        "bounds": [[list(b), n] for b, n in run_lengths(plan.bounds)],
        "shares": _count_items(plan.shares),
        "departed": _worker_items(_departed_tokens(plan.departed, index)),
        "evicted": _worker_items(_departed_tokens(plan.evicted, index)),
    }
    if plan.racks:  # only jobs whose hosts were launched with --rack
        wire["racks"] = [list(pair) for pair in plan.racks]
    return json.dumps(wire, separators=(",", ":"))


def decode(text: str | bytes) -> Plan:
    """The plan that ``text`` (either version) describes."""
    d = json.loads(text)
    if "v" not in d:
        return _plain(d)
    if d["v"] != VERSION:
        raise ValueError(f"plan wire version {d['v']!r} is not supported (expected {VERSION})")
    names = list(_names(d["hosts"]))
    listed = list(_workers(d["workers"], names))
    order = list(_indices(d["ranks"]))
    if len(order) != len(listed) or set(order) != set(range(len(listed))):
        raise ValueError(f"the plan's {len(order)} ranks do not order its {len(listed)} workers")
    hosts = tuple(h for h, _ in (listed[i] for i in order) if h is not None)
    if len(hosts) != len(order):
        raise ValueError("a plan worker has no host")
    return Plan(
        epoch=int(d["epoch"]),
        workers=tuple(listed[i][1] for i in order),
        hosts=hosts,
        microbatches=tuple(_counts(d["microbatches"])),
        store=d["store"],
        reason=d["reason"],
        created=float(d["created"]),
        departed=tuple(w for _, w in _workers(d["departed"], names)),
        replicas=tuple(_replicas(d["replicas"])),
        bounds=tuple(tuple(int(x) for x in b) for b, n in d["bounds"] for _ in range(n)),
        shares=tuple(_counts(d["shares"])),
        evicted=tuple(w for _, w in _workers(d["evicted"], names)),
        committed=int(d["committed"]),
        racks=tuple((str(h), str(r)) for h, r in d.get("racks", ())),
    )


def _plain(d: Mapping[str, Any]) -> Plan:
    """The plain format (before version 2): every field written out, optional ones may lack."""
    return Plan(
        epoch=int(d["epoch"]),
        workers=tuple(d["workers"]),
        hosts=tuple(d["hosts"]),
        microbatches=tuple(int(x) for x in d["microbatches"]),
        store=d["store"],
        reason=d.get("reason", ""),
        created=float(d.get("created", 0.0)),
        departed=tuple(d.get("departed", ())),
        replicas=tuple(tuple(int(r) for r in rep) for rep in d.get("replicas", ())),
        bounds=tuple(tuple(int(b) for b in bs) for bs in d.get("bounds", ())),
        shares=tuple(int(x) for x in d.get("shares", ())),
        evicted=tuple(d.get("evicted", ())),
        committed=int(d.get("committed", 0)),
        racks=tuple((str(h), str(r)) for h, r in d.get("racks", ())),
    )


# ---- workers: (host index, worker id) as runs ---------------------------------------------------
# A token is one worker: (h, slot) for ``<host>.w<slot>``, (h, "suffix") for ``<host>.<suffix>``,
# (h, None, id) for an id of another shape on host h, or a bare id (departed only). Runs of tokens
# become the items of the module docstring.


def _relative(h: int, suffix: str) -> tuple[int, int | str]:
    slot = _SLOT.fullmatch(suffix)
    return (h, int(slot.group(1))) if slot else (h, suffix)


def _split_worker(worker: str) -> tuple[str, str] | None:
    """(host, ``w<slot>[.r<n>]``) of a worker id of the usual shape, else ``None``."""
    m = _WORKER.fullmatch(worker)
    return (m.group(1), m.group(2)) if m else None


def _departed_tokens(workers: Sequence[str], index: Mapping[str, int]) -> Iterator[Any]:
    for worker in workers:
        split = _split_worker(worker)
        yield worker if split is None else _relative(index[split[0]], split[1])


def _listing_key(token: tuple[Any, ...]) -> tuple[int, float]:
    """Where a worker is listed: by host, then slot (a respawn ``w3.r2`` where ``w3`` would be),
    other ids last, so that a host's workers make one run whatever their ranks."""
    if isinstance(token[1], int):
        return token[0], token[1]
    m = _SLOT_START.match(token[1]) if token[1] is not None else None
    return token[0], int(m.group(1)) if m else math.inf


def _worker_items(tokens: Iterable[Any]) -> list[Any]:
    """Consecutive slots of a host become ``[h, s, n]``, runs of the same slots on consecutive
    hosts ``[h, s, n, k]``; any other token is an item of its own."""
    items: list[Any] = []
    for tok in tokens:
        last = items[-1] if items else None
        if _is_slot(tok) and _is_run(last) and last[0] == tok[0] and last[1] + last[2] == tok[1]:
            last[2] += 1
        elif _is_slot(tok):
            items.append([tok[0], tok[1], 1, 1])
        else:
            items.append(list(tok) if isinstance(tok, tuple) else tok)
    folded: list[Any] = []
    for item in items:
        last = folded[-1] if folded else None
        if _is_run(item) and _is_run(last) and last[1:3] == item[1:3] and _after(last) == item[0]:
            last[3] += 1
        else:
            folded.append(item)
    return [item[:3] if _is_run(item) and item[3] == 1 else item for item in folded]


def _after(run: list[int]) -> int:
    """The host index after a run ``[h, s, n, k]``."""
    return run[0] + run[3]


def _is_slot(tok: Any) -> bool:
    return isinstance(tok, tuple) and len(tok) == 2 and isinstance(tok[1], int)


def _is_run(item: Any) -> TypeGuard[list[Any]]:
    return isinstance(item, list) and len(item) == 4 and isinstance(item[1], int)


def _workers(items: Iterable[Any], names: Sequence[str]) -> Iterator[tuple[str | None, str]]:
    """(host, worker id) of every worker the items stand for (host ``None`` for a bare id)."""
    for item in items:
        if isinstance(item, str):
            yield None, item
        elif isinstance(item[1], int):
            h, s, n, k = item if len(item) == 4 else [*item, 1]
            hosts = names[h : h + k]
            if h < 0 or len(hosts) != k:
                raise ValueError(f"plan worker item {item} names hosts beyond the table")
            for host in hosts:
                yield from ((host, f"{host}.w{slot}") for slot in range(s, s + n))
        elif item[1] is None:
            yield names[item[0]], item[2]
        else:
            yield names[item[0]], f"{names[item[0]]}.{item[1]}"


def _index_items(indices: Iterable[int]) -> list[Any]:
    """Runs of consecutive indices ``[first, n]``; a run of one is the index alone."""
    items: list[Any] = []
    for i in indices:
        last = items[-1] if items else None
        if isinstance(last, list) and last[0] + last[1] == i:
            last[1] += 1
        elif isinstance(last, int) and last + 1 == i:
            items[-1] = [last, 2]
        else:
            items.append(i)
    return items


def _indices(items: Iterable[Any]) -> Iterator[int]:
    for item in items:
        if isinstance(item, list):
            yield from range(item[0], item[0] + item[1])
        else:
            yield int(item)


# ---- host names: numbered runs ------------------------------------------------------------------


def _name_items(names: Sequence[str]) -> list[Any]:
    """Names that count up (``node-07``, ``node-08``…) become ``[prefix, first, count]`` (with
    a fourth entry, the suffix, when one follows the number); any other name stays as it is."""
    runs: list[list[Any]] = []  # [prefix, first, count, suffix], or [name] without a number
    for name in names:
        last = runs[-1] if runs else None
        if (
            last is not None
            and len(last) == 4
            and name == _numbered(last[0], last[1], last[2], suffix=last[3])
        ):
            last[2] += 1
            continue
        parts = _split_number(name)
        runs.append([parts[0], parts[1], 1, parts[2]] if parts else [name])
    return [_name_item(run) for run in runs]


def _name_item(run: list[Any]) -> Any:
    if len(run) == 1:
        return run[0]
    prefix, first, count, suffix = run
    if count == 1:
        return prefix + first + suffix
    return [prefix, first, count, suffix] if suffix else [prefix, first, count]


def _names(items: Iterable[Any]) -> Iterator[str]:
    for item in items:
        if isinstance(item, str):
            yield item
        else:
            prefix, first, count = item[:3]
            suffix = item[3] if len(item) == 4 else ""
            yield from (_numbered(prefix, first, i, suffix=suffix) for i in range(count))


def _split_number(name: str) -> tuple[str, str, str] | None:
    """(before, digits, after) around the last run of ASCII digits in ``name``, if any."""
    end = len(name)
    while end > 0 and name[end - 1] not in _DIGITS:
        end -= 1
    start = end
    while start > 0 and name[start - 1] in _DIGITS:
        start -= 1
    if not 0 < end - start <= _MAX_DIGITS:
        return None
    return name[:start], name[start:end], name[end:]


def _natural(name: str) -> tuple[str, str, int, str]:
    """Sort key of host names: numbered names by their number (``node-9`` before ``node-10``),
    so that the sorted table makes numbered runs."""
    parts = _split_number(name)
    if parts is None:
        return name, "", -1, ""
    prefix, digits, suffix = parts
    return prefix, suffix, int(digits), digits


def _numbered(prefix: str, first: str, i: int, *, suffix: str) -> str:
    """The ``i``-th name of a numbered run (``first`` is the 0-th one's number, with its width)."""
    return f"{prefix}{str(int(first) + i).zfill(len(first))}{suffix}"


# ---- counts and pipeline layout -----------------------------------------------------------------


def _count_items(values: Sequence[int]) -> list[Any]:
    return [v if n == 1 else [v, n] for v, n in run_lengths(values)]


def _counts(items: Iterable[Any]) -> list[int]:
    """The counts the items stand for (a run is one list product: every host of a large job
    expands these on every plan)."""
    out: list[int] = []
    for item in items:
        if isinstance(item, list):
            out += [int(item[0])] * int(item[1])
        else:
            out.append(int(item))
    return out


def _replica_items(replicas: Sequence[Sequence[int]]) -> list[Any]:
    """Replicas of consecutive ranks, each starting where the last ended and all as long, become
    ``[start, stages, n]``; any other one ``{"ranks": [...]}``."""
    items: list[Any] = []
    for ranks in replicas:
        last = items[-1] if items else None
        consecutive = len(ranks) > 0 and tuple(ranks) == tuple(range(ranks[0], ranks[-1] + 1))
        if not consecutive:
            items.append({"ranks": list(ranks)})
        elif isinstance(last, list) and last[1] == len(ranks) and _end(last) == ranks[0]:
            last[2] += 1
        else:
            items.append([ranks[0], len(ranks), 1])
    return items


def _end(run: list[int]) -> int:
    """The rank after a replica run's last one."""
    start, stages, n = run
    return start + stages * n


def _replicas(items: Iterable[Any]) -> Iterator[tuple[int, ...]]:
    for item in items:
        if isinstance(item, dict):
            yield tuple(int(r) for r in item["ranks"])
        else:
            start, stages, n = item
            for first in range(start, start + stages * n, stages) if stages else [start] * n:
                yield tuple(range(first, first + stages))
