"""Ranks agree on a call before they move data (docs/design.md §Ranks agree).

Every transfer assumes all ranks computed the same plan. :func:`agree` checks that with one
all-gather of a fixed :data:`ROW` of int64 per rank: a marker, the global rank, and 64-bit
blake2b digests of the agreement point's name, of the field names and of the field values (no
pickled objects, no salted ``hash()``). When every row matches, the fingerprint is remembered
for the group and later calls with it make no exchange at all. When rows differ, a few more
small exchanges, decided from the gathered rows and so the same on every rank, fetch what is
needed to name each differing field and each rank's value, and every rank raises the same
``ValueError``::

    ds_ring: the ranks disagree on ring_dilated_attention before moving any data:
    heads: rank 0 has 4, rank 1 has 2. ...

Limit of the cache: a rank whose call changes to one it has not agreed on, while the others
repeat one they have, is the only rank that exchanges; it waits (bounded by the timeout) and
raises a :class:`~ds_ring.comm.errors.CommTimeoutError` that names this possibility. Agreements
that are rare and must always hold (a Topology, a config section, a checkpoint) pass
``cache=False`` and exchange every time.
"""

from __future__ import annotations

import hashlib
import numbers
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ds_ring.comm.collectives import all_gather
from ds_ring.comm.errors import CommError
from ds_ring.comm.group_ranks import group_rank, group_size
from ds_ring.comm.job import job
from ds_ring.comm.spans import group_members

__all__ = ["Value", "agree", "gather_texts", "ROW"]

Value = int | float | bool | str | torch.dtype | torch.device | Sequence[int] | torch.Tensor | None
"""What a field may hold; a tensor counts as the list of its values (e.g. ``cu_seqlens``)."""


ROW = 5
"""int64 per rank in the one exchange of an agreement: marker, global rank, op, names, values."""
_MARKER = int.from_bytes(b"ds_ring!", "little", signed=True)
_MAX_SHOWN = 160  # characters of a value shown in an error before it is abbreviated
_CACHE_SIZE = 1024  # distinct fingerprints remembered per group (least recently used dropped)

_lock = threading.Lock()


def agree(
    fields: Mapping[str, Value],
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "agree",
    timeout_s: float | None = None,
    fix: str | None = None,
    cache: bool = True,
    device: torch.device | str | None = None,
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all of them pass equal ``fields``.

    Args:
        fields: name → value of everything the plan depends on, same names in the same order on
            every rank (values compared exactly: ``4`` differs from ``4.0`` and from ``True``;
            lists and tuples compare alike).
        group: the ranks that must agree (``None``: the world); a group whose backend takes the
            exchanged tensors (CPU tensors unless ``device`` says otherwise).
        op: the agreement point, e.g. ``"ring_dilated_attention"``: named in errors and events
            (as ``agree:<op>``), and part of the cache key.
        timeout_s: bound on each wait in seconds (``None``: :data:`~ds_ring.comm.wait.DEFAULT_TIMEOUT_S`).
        fix: what the error tells the user to change (default: make the same call on every rank).
        cache: skip the exchange for a fingerprint already agreed for ``(group, op)`` (steady state:
            only the local digest, microseconds). ``False`` for rare calls that must always be
            checked (see the cache's limit in the module docstring), and for callers that cache themselves.
        device: where the exchanged integers live (``None``: the CPU). Control traffic belongs on a group
            whose backend takes CPU tensors (:func:`ds_ring.comm.group_ranks.takes_cpu`); only a caller with no
            such group passes the data's device (one host read of the gathered table follows).

    A world of one, or no process group, agrees with itself.

    Raises:
        ValueError: on every rank, naming each differing field and every rank's value.
        CommError: an exchange failed or timed out (a peer is dead, or not at this agreement).
    """
    if not dist.is_initialized():
        return
    # The cache is keyed on the values themselves (typed, so 4, 4.0 and True stay apart): a hit
    # costs a tuple's hash, not the texts and digests an exchange needs.
    key = (op, tuple(fields), tuple(map(_frozen, fields.values())))
    verified = _cache(group) if cache else None
    if verified is not None:
        with _lock:
            if key in verified:
                verified.move_to_end(key)
                return
    if group_size(group) == 1:
        return
    names = list(fields)
    texts = [_text(fields[name]) for name in names]
    row = [
        _MARKER,
        group_rank(None),
        _digest(op),
        _digest("\0".join(names)),
        _digest("\0".join(f"{n}={t}" for n, t in zip(names, texts, strict=True))),
    ]
    exchange = _Exchange(group, op, timeout_s, device)
    rows = exchange.gather_ints(row)
    strangers = sum(r[0] != _MARKER for r in rows)
    if strangers:
        raise ValueError(
            f"ds_ring: while the ranks agreed on {op}, {strangers} rank(s) sent something else: they are in "
            f"another collective of this group; every rank must make the same calls in the same order"
        )
    ranks = [r[1] for r in rows]
    for index, label, mine in ((2, "the agreement point", op), (3, "the checked fields", f"[{', '.join(names)}]")):
        if len({r[index] for r in rows}) > 1:  # another call site, or another version of ds_ring
            shown = [texts[0] for texts in exchange.gather_texts([mine])]
            fix = "every rank must run the same code (and the same ds_ring version) and reach the same agreement"
            raise ValueError(_message(op, [(label, ranks, shown)], fix))
    if len({r[4] for r in rows}) > 1:
        digests = exchange.gather_ints([_digest(t) for t in texts])
        differing = [i for i in range(len(names)) if len({d[i] for d in digests}) > 1]
        shown = exchange.gather_texts([_shown(texts[i]) for i in differing])
        rows_by_field = [(names[i], ranks, [s[j] for s in shown]) for j, i in enumerate(differing)]
        raise ValueError(_message(op, rows_by_field, fix or _SAME_CALL))
    if verified is not None:
        with _lock:
            verified[key] = None
            if len(verified) > _CACHE_SIZE:
                verified.popitem(last=False)


def gather_texts(
    texts: list[str], *, group: dist.ProcessGroup | None, op: str, timeout_s: float | None
) -> list[list[str]]:
    """Every rank's ``texts`` (the same count on every rank), one list per rank in group-rank order; two small
    all-gathers over ``group`` (a group whose backend takes CPU tensors), bounded by ``timeout_s``."""
    return _Exchange(group, op, timeout_s, None).gather_texts(texts)


class _Exchange:
    """All-gathers of an agreement; every rank gets every rank's values, in group-rank order."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        op: str,
        timeout_s: float | None,
        device: torch.device | str | None,
    ) -> None:
        self.group, self.op, self.timeout_s, self.device = group, f"agree:{op}", timeout_s, device

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on every rank), one list per rank."""
        table = torch.tensor(values, dtype=torch.int64, device=self.device).view(1, -1)
        return self._gather(table).tolist()

    def gather_texts(self, texts: list[str]) -> list[list[str]]:
        """Every rank's ``texts`` (the same count on every rank): lengths first, then padded bytes."""
        blob = "\0".join(texts).encode()
        lengths = [row[0] for row in self.gather_ints([len(blob)])]
        padded = torch.zeros(1, max(1, *lengths), dtype=torch.uint8)
        if blob:
            padded[0, : len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if self.device is not None:
            padded = padded.to(self.device)
        rows = self._gather(padded).tolist()
        return [
            bytes(row[:length]).decode(errors="replace").split("\0") for row, length in zip(rows, lengths, strict=True)
        ]

    def _gather(self, table: torch.Tensor) -> torch.Tensor:
        """``table [1, m]`` of every member of the group stacked: ``[size, m]``."""
        group = self.group
        try:
            parts = all_gather(table.flatten(), group_members(group), group=group, op=self.op, timeout_s=self.timeout_s)
        except CommError as err:
            raise err.doing(err.what + _WAIT_HINT) from err
        return torch.cat([part.view(table.shape) for part in parts])


_SAME_CALL = (
    "every rank of the group must make the same call with the same shapes; look for configuration that differs "
    "between nodes, a rank-dependent code path, or a data shard of another shape"
)
_WAIT_HINT = (
    " while the ranks agreed on their call (a peer that is not at this agreement: dead, elsewhere, or repeating a "
    "call it agreed on before while this rank's call changed)"
)


def _cache(group: dist.ProcessGroup | None) -> OrderedDict[tuple, None]:
    """The fingerprints verified on ``group``, kept by the job; they go with the group object (a new world starts
    empty)."""
    return job().owned(dist.group.WORLD if group is None else group, "agreed calls", OrderedDict)


def _frozen(value: Value) -> object:
    """A hashable, typed stand-in for ``value`` (the local cache key; :func:`_text` is what ranks compare)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return ("list", *map(_frozen, value))
    if isinstance(value, torch.Tensor):
        return ("tensor", *value.tolist())
    return kind, value


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _text(value: Value) -> str:
    """The exact, canonical text of a field value (also what an error shows)."""
    if value is None or isinstance(value, bool | str):
        return repr(value)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))  # repr round-trips a float exactly
    if isinstance(value, torch.Tensor):
        return _text(value.tolist())
    if isinstance(value, Sequence):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    raise TypeError(f"ds_ring: agree cannot compare a {type(value).__name__}; pass ints, floats, strings or lists")


def _shown(text: str) -> str:
    """``text``, abbreviated when long (with its digest, so different values never look alike)."""
    if len(text) <= _MAX_SHOWN:
        return text
    return f"{text[:100]} … {text[-40:]} ({len(text)} characters, digest {_digest(text) & 0xFFFFFFFF:08x})"


def _message(op: str, fields: list[tuple[str, list[int], list[str]]], fix: str) -> str:
    """One line per field: ``name: rank 0 has A, ranks 1-3 have B``."""
    lines = []
    for name, ranks, values in fields:
        holders: dict[str, list[int]] = {}
        for rank, value in sorted(zip(ranks, values, strict=True)):
            holders.setdefault(value, []).append(rank)
        said = [f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {value}" for value, rs in holders.items()]
        lines.append(f"{name}: {', '.join(said)}")
    return f"ds_ring: the ranks disagree on {op} before moving any data: {'; '.join(lines)}. Fix: {fix}"


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 1`` or ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}-{b}" if b > a + 1 else ", ".join(map(str, range(a, b + 1))) for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
