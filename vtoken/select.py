"""Batched victim selection and repack planning: torch ops for every evicting request at once.

The worker-side half of "the scheduler says how many, the worker says which" (issue 22,
``docs/eviction.md``): given each request's keep-scores, logical positions and the number
of tokens ``k`` to evict, :func:`select_victims` picks the victims of every request in one
batch, and :func:`plan_moves` plans the repack (holes below the new live count <- live tail
tokens) for all of them. Both are plain torch tensor code: the same call runs on CPU and CUDA
tensors, with no per-request or per-token Python loop, no host sync, and no data-dependent
shapes except the move lists.

Layout (padded, one row per request): ``[R, N]`` tensors where row ``r`` holds request ``r``'s
request-relative physical slots ``0..num_live[r]-1`` (slot ``s`` lives in the request's block
``s // block_size`` at offset ``s % block_size``, as in ``tests/reference/repack.py``); columns
``>= num_live[r]`` are padding and are ignored whatever they hold.

The rules are those of ``Reference.select_victims`` (``tests/reference/policies.py``), the
per-request reference the unit tests compare against:

* protected, never a victim: the first ``max(sink_tokens, protected_prefix)`` logical positions
  (attention sinks, StreamingLLM, Xiao et al. 2023, section 3; the shared prefix under prefix
  caching) and the ``recent_tokens`` largest live logical positions (the recent window);
* among the others, the lowest keep-score goes first; ties go to the smaller logical position
  (the older token); ``NaN`` sorts after every number, as in ``numpy.lexsort``;
* a request with fewer unprotected tokens than ``k`` loses all of them, no more.

This module never imports vllm.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

__all__ = ["protected_mask", "select_victims", "plan_moves", "MovePlan", "select_one", "plan_one", "OneEviction",
           "global_slots"]

IntOrTensor = Union[int, torch.Tensor]

#: :func:`select_victims` takes the ``topk`` path when ``max k * _FEW_RATIO <= N`` (tests change it)
_FEW_RATIO = 16


def _per_row(v: IntOrTensor, r: int, device: torch.device, name: str) -> torch.Tensor:
    """``v`` as int64 ``[R]`` on ``device`` (a Python int is broadcast)."""
    if isinstance(v, torch.Tensor):
        if v.shape != (r,):
            raise ValueError(f"{name} has shape {tuple(v.shape)}; expected ({r},) (one value per request)")
        if v.dtype.is_floating_point or v.dtype == torch.bool:
            raise ValueError(f"{name} has dtype {v.dtype}; expected an integer dtype")
        return v.to(device=device, dtype=torch.int64)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} = {v!r}; expected an int or an int64 tensor [R]")
    return torch.full((r,), v, dtype=torch.int64, device=device)


def _check_2d(logical_pos: torch.Tensor, num_live: IntOrTensor, check: bool = True) -> tuple[int, int, torch.Tensor]:
    """``(R, N, num_live as int64 [R])``; ``check``: also the value checks of CPU tensors (host
    reads), which a caller whose counts come from its own state skips (:class:`vtoken.side_cache.DeviceDecider`)."""
    if logical_pos.dim() != 2:
        raise ValueError(f"logical_pos has shape {tuple(logical_pos.shape)}; expected [R, N]")
    r, n = logical_pos.shape
    live = _per_row(num_live, r, logical_pos.device, "num_live")
    if not check:
        return r, n, live
    if r and (bool((live < 0).any()) if live.device.type == "cpu" else False):
        raise ValueError(f"num_live has a negative entry: {live.tolist()}")
    if r and live.device.type == "cpu" and int(live.max()) > n:
        raise ValueError(f"num_live has an entry above N = {n}: {live.tolist()}")
    return r, n, live


def protected_mask(
    logical_pos: torch.Tensor,
    num_live: IntOrTensor,
    *,
    sink_tokens: IntOrTensor = 0,
    recent_tokens: IntOrTensor = 0,
    protected_prefix: IntOrTensor = 0,
    num_logical: Optional[IntOrTensor] = None,
    check: bool = True,
    all_live: bool = False,
) -> torch.Tensor:
    """The slots no policy may evict, for every request at once.

    Args:
        logical_pos: int64 ``[R, N]``: the logical position held by each slot (distinct within
            a row's live slots); padding columns are ignored.
        num_live: live slots per request, int or int64 ``[R]`` (``0 <= num_live <= N``).
        sink_tokens, recent_tokens, protected_prefix: tokens, int or int64 ``[R]``, ``>= 0``.
        num_logical: tokens ever appended per request (int or int64 ``[R]``), optional. When
            given, a row whose positions ``num_logical - recent_tokens ..`` are all live (every
            state the protocol reaches: a token is protected from its append until it leaves
            the window) gets its recent window from that count, without a sort; other rows,
            or no ``num_logical``, sort their positions.
        check: check the values of ``num_live`` (CPU tensors: two host reads); False for a
            caller whose counts are its own (:class:`vtoken.side_cache.DeviceDecider`).
        all_live: every row has ``N`` live slots (the caller knows): no padding to mask.

    Returns:
        bool ``[R, N]``: True for a live slot that holds a sink, a position below
        ``protected_prefix`` or one of the ``recent_tokens`` largest live positions; False for
        every other slot, padding included. Equal, row by row, to
        ``Reference.protected_mask`` (``tests/reference/policies.py``).

    Raises:
        ValueError: a shape or dtype that does not match (CPU tensors also: a ``num_live``
            outside ``0..N``).
    """
    r, n, live = _check_2d(logical_pos, num_live, check)
    dev = logical_pos.device
    if all(type(v) is int and v == 0 for v in (sink_tokens, recent_tokens, protected_prefix)):
        return torch.zeros((r, n), dtype=torch.bool, device=dev)  # nothing protected (K-norm's default)
    # (a Python int stays one: it broadcasts without a [R] tensor of its own)
    sinks, recent, prefix = (v if type(v) is int else _per_row(v, r, dev, name) for v, name in (
        (sink_tokens, "sink_tokens"), (recent_tokens, "recent_tokens"), (protected_prefix, "protected_prefix")))
    pos = logical_pos.to(torch.int64)
    valid = None if all_live else torch.arange(n, device=dev)[None, :] < live[:, None]
    if type(sinks) is int and type(prefix) is int:
        first = max(sinks, prefix)
        prot = pos < first if first > 0 else torch.zeros((r, n), dtype=torch.bool, device=dev)
    else:
        prot = pos < torch.maximum(_per_row(sinks, r, dev, "sink_tokens"),
                                   _per_row(prefix, r, dev, "protected_prefix"))[:, None]
    if n and not (type(recent) is int and recent <= 0):
        # The recent window: positions >= the recent-th largest live position of the row.
        r_eff = live.clamp(max=recent) if type(recent) is int else torch.minimum(recent, live)
        cutoff = None
        if num_logical is not None:
            c = (_per_row(num_logical, r, dev, "num_logical") - r_eff)[:, None]
            inside = pos >= c if valid is None else (pos >= c) & valid
            if bool((inside.sum(dim=1) == r_eff).all()):  # one host sync
                cutoff = c
        if cutoff is None:
            desc = (pos if valid is None else torch.where(valid, pos, torch.full_like(pos, -1))).sort(
                dim=1, descending=True).values
            idx = (r_eff - 1).clamp(min=0)
            cutoff = desc.gather(1, idx[:, None])
        if type(recent) is int:
            prot |= pos >= cutoff
        else:
            prot |= (recent > 0)[:, None] & (pos >= cutoff)
    return prot if valid is None else prot & valid


def select_victims(
    scores: torch.Tensor,
    logical_pos: torch.Tensor,
    num_live: IntOrTensor,
    num_to_evict: IntOrTensor,
    *,
    sink_tokens: IntOrTensor = 0,
    recent_tokens: IntOrTensor = 0,
    protected_prefix: IntOrTensor = 0,
    num_logical: Optional[IntOrTensor] = None,
    max_evict: Optional[int] = None,
    check: bool = True,
) -> torch.Tensor:
    """Every request's ``num_to_evict`` victims, in one batch (module docstring for the rules).

    Args:
        scores: keep-scores ``[R, N]`` (higher = keep), any floating dtype; padding ignored.
        logical_pos: int64 ``[R, N]``, distinct within a row's live slots.
        num_live: live slots per request, int or int64 ``[R]``.
        num_to_evict: ``k`` per request, int or int64 ``[R]``; ``k <= 0`` evicts nothing.
        sink_tokens, recent_tokens, protected_prefix, num_logical: as for :func:`protected_mask`.
        max_evict: a bound the caller knows on the host, ``>= max(num_to_evict)`` (the decider's
            counts come from the scheduler's payload): spares the host read of the batch's
            largest count. The choice between the two paths below may then differ; their
            victims do not.
        check: as for :func:`protected_mask`.

    Few victims per row (``max k <= N / 16``, steady decode), no ``NaN`` score: two ``topk``
    passes (the k-th smallest score, then the smallest positions among the scores equal to
    it); otherwise the batched ``lexsort`` (three stable sorts). Both give the same victims.

    Returns:
        bool ``[R, N]`` on ``scores``' device: exactly ``min(k, unprotected live slots)`` True
        per row, on the slots that the per-request reference (``tests/reference/policies.py``)
        returns for that request alone.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    if scores.shape != logical_pos.shape:
        raise ValueError(f"scores has shape {tuple(scores.shape)}; logical_pos has {tuple(logical_pos.shape)}")
    if not scores.dtype.is_floating_point:
        raise ValueError(f"scores has dtype {scores.dtype}; expected a floating dtype")
    r, n, live = _check_2d(logical_pos, num_live, check)
    dev = logical_pos.device
    k = _per_row(num_to_evict, r, dev, "num_to_evict").clamp(min=0)
    prot = protected_mask(logical_pos, live, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                          protected_prefix=protected_prefix, num_logical=num_logical, check=False)
    cols = torch.arange(n, device=dev)[None, :]
    cand = (cols < live[:, None]) & ~prot
    k_eff = torch.minimum(k, cand.sum(dim=1))
    if max_evict is not None:  # (a bound: rows whose k_eff is 0 select nothing on either path)
        kmax = min(int(max_evict), n) if r else 0
    else:
        kmax = int(k_eff.max()) if r else 0  # host sync
    if kmax <= 0:
        return torch.zeros_like(cand)
    if kmax * _FEW_RATIO <= n and not bool(torch.isnan(scores).any()):
        return _select_few(scores, logical_pos.to(torch.int64), cand, k_eff, kmax)
    # Order (not a candidate, score, logical position) ascending, by three stable sorts from
    # the last key to the first (the batched numpy.lexsort).
    order = logical_pos.to(torch.int64).argsort(dim=1, stable=True)
    order = order.gather(1, scores.gather(1, order).argsort(dim=1, stable=True))
    order = order.gather(1, (~cand).gather(1, order).to(torch.int8).argsort(dim=1, stable=True))
    take = cols < k_eff[:, None]
    return torch.zeros_like(cand).scatter_(1, order, take)


def _select_few(scores: torch.Tensor, pos: torch.Tensor, cand: torch.Tensor, k_eff: torch.Tensor,
                kmax: int) -> torch.Tensor:
    """:func:`select_victims` for small ``k`` and no NaN: every candidate scoring below the
    row's k-th smallest candidate score, then the smallest positions among those equal to it."""
    s = torch.where(cand, scores, torch.full((), float("inf"), dtype=scores.dtype, device=scores.device))
    big = torch.full((), torch.iinfo(torch.int64).max, dtype=torch.int64, device=pos.device)
    if kmax == 1:  # steady decode: each row's lowest score, the smallest position among its ties
        tie = cand & (s == s.min(dim=1, keepdim=True).values)
        p = torch.where(tie, pos, big)
        return tie & (p == p.min(dim=1, keepdim=True).values) & (k_eff > 0)[:, None]
    kth = s.topk(kmax, dim=1, largest=False).values.gather(1, (k_eff - 1).clamp(min=0)[:, None])
    below = cand & (s < kth)
    tie = cand & (s == kth)
    need = k_eff - below.sum(dim=1)  # >= 1 where k_eff >= 1: the k-th itself is a tie
    mmax = int(need.max())  # host sync
    if mmax <= 0:  # (kmax was a bound and no row selects anything)
        return torch.zeros_like(cand)
    p = torch.where(tie, pos, big)
    pth = p.topk(mmax, dim=1, largest=False).values.gather(1, (need - 1).clamp(min=0)[:, None])
    return (below | (tie & (p <= pth))) & (k_eff > 0)[:, None]


class MovePlan(NamedTuple):
    """The repack of every request in a batch (:func:`plan_moves`).

    Attributes:
        rows: int64 ``[M]``: the request (row) of each move.
        src: int64 ``[M]``: request-relative slot a live tail token moves from
            (``>= new_live[row]``).
        dst: int64 ``[M]``: request-relative slot it moves to, a hole (``< new_live[row]``).
            Within a row, holes ascending pair with live tail slots ascending, as in
            ``plan_repack`` (``tests/reference/repack.py``); moves are ordered by row.
        new_live: int64 ``[R]``: live slots per request after the eviction.
    """

    rows: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    new_live: torch.Tensor


def plan_moves(victims: torch.Tensor, num_live: IntOrTensor) -> MovePlan:
    """Plan the repack after :func:`select_victims`: fill each hole below the new live count
    with a live token from the tail, for every request at once.

    Args:
        victims: bool ``[R, N]``: the evicted slots (only live slots may be True).
        num_live: live slots per request before the eviction, int or int64 ``[R]``.

    Returns:
        :class:`MovePlan`. Row by row, ``(src, dst)`` equal ``plan_repack`` (``tests/reference/repack.py``)'s
        for that request's victims. The live tail tokens of a row are exactly as many as its
        holes below the new count, so the two ``nonzero`` lists pair up in order.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    if victims.dtype != torch.bool or victims.dim() != 2:
        raise ValueError(f"victims has shape {tuple(victims.shape)} and dtype {victims.dtype}; expected bool [R, N]")
    r, n = victims.shape
    live = _per_row(num_live, r, victims.device, "num_live")
    cols = torch.arange(n, device=victims.device)[None, :]
    valid = cols < live[:, None]
    victims = victims & valid
    new_live = live - victims.sum(dim=1)
    below = cols < new_live[:, None]
    rows, dst = (victims & below).nonzero(as_tuple=True)
    _, src = (valid & ~victims & ~below).nonzero(as_tuple=True)
    return MovePlan(rows, src, dst, new_live)


class OneEviction(NamedTuple):
    """:func:`select_one`'s victims and :func:`plan_one`'s repack: at most one victim per row.

    Attributes:
        has: bool ``[R]``: the row evicts a token.
        col: int64 ``[R]``: its victim's slot (meaningless where not ``has``).
        plan: the :class:`MovePlan` (:func:`plan_moves`'s for the same victims).
        ev_rows, ev_cols: int64 ``[V]``: the victims as ``victims.nonzero(as_tuple=True)`` lists them.
    """

    has: torch.Tensor
    col: torch.Tensor
    plan: MovePlan
    ev_rows: torch.Tensor
    ev_cols: torch.Tensor


def select_one(
    scores: torch.Tensor,
    logical_pos: torch.Tensor,
    num_live: torch.Tensor,
    num_to_evict: torch.Tensor,
    *,
    sink_tokens: IntOrTensor = 0,
    recent_tokens: IntOrTensor = 0,
    protected_prefix: IntOrTensor = 0,
    num_logical: Optional[IntOrTensor] = None,
    check: bool = True,
    all_live: bool = False,
) -> Optional[OneEviction]:
    """:func:`select_victims` and :func:`plan_moves` for rows that evict at most one token each
    (``num_to_evict <= 1``: a steady decode step), as the victim's column per row instead of an
    ``[R, N]`` mask: the row's lowest candidate score, the smallest logical position among its
    ties (``_select_few``'s ``k = 1`` rule), and at most one move (the last live slot into the
    victim's, unless the victim is the last). Same victims and moves as the general pair, in the
    same order, with fewer operations and one ``nonzero`` fewer.

    Args:
        num_live, num_to_evict: int64 ``[R]`` (every ``num_to_evict <= 1``; the caller knows).
        all_live: as for :func:`protected_mask`.
        Others: as :func:`select_victims`.

    Returns:
        :class:`OneEviction`, or None when a score is ``NaN`` (the general pair then decides).
    """
    r, n, live = _check_2d(logical_pos, num_live, check)
    dev = logical_pos.device
    if bool(torch.isnan(scores).any()):  # host sync (as select_victims' choice of its path)
        return None
    pos = logical_pos.to(torch.int64)
    prot = protected_mask(pos, live, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                          protected_prefix=protected_prefix, num_logical=num_logical, check=False, all_live=all_live)
    cand = ~prot if all_live else (torch.arange(n, device=dev)[None, :] < live[:, None]) & ~prot
    s = torch.where(cand, scores, torch.full((), float("inf"), dtype=scores.dtype, device=dev))
    tie = cand & (s == s.min(dim=1, keepdim=True).values)
    col = torch.where(tie, pos, torch.full((), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)).argmin(dim=1)
    has = (num_to_evict > 0) & cand.any(dim=1)
    return plan_one(has, col, live)


def plan_one(has: torch.Tensor, col: torch.Tensor, num_live: torch.Tensor) -> OneEviction:
    """:func:`plan_moves` for at most one victim per row (``has``, at slot ``col``): the row's
    last live slot fills the hole unless it is the victim. Moves ordered by row."""
    new_live = num_live - has.to(num_live.dtype)
    rows = (has & (col < new_live)).nonzero().squeeze(1)
    ev_rows = has.nonzero().squeeze(1)
    return OneEviction(has, col, MovePlan(rows, new_live[rows], col[rows], new_live), ev_rows, col[ev_rows])


def global_slots(block_table: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Request-relative slots -> global slot ids ``block_id * block_size + offset``.

    Args:
        block_table: int ``[R, max_blocks]``: row ``r`` lists request ``r``'s block ids.
        rows, slots: int64 ``[M]``: the request and its request-relative slot.
        block_size: tokens per block (``>= 1``).

    Returns:
        int64 ``[M]``: the slot ids the KV-cache move kernels take (:mod:`vtoken.kernels.move`).
    """
    if block_size < 1:
        raise ValueError(f"block_size = {block_size}; allowed: an integer >= 1")
    return block_table[rows, slots // block_size].to(torch.int64) * block_size + slots % block_size
