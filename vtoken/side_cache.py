"""The side cache and the batched decisions on it: the engine-independent half of the worker's eviction step
(per-slot logical positions, i.e. the token table, and policy state, paged like the KV cache).

"The scheduler says how many, the worker says which" (``docs/eviction.md``). The
scheduler computes, from integers only, how many tokens ``k`` each request evicts in a step;
this module, on the worker, before the step's forward and any KV write:

1. picks every request's ``k`` victims in one batch (:func:`vtoken.select.select_victims`);
2. plans the repack of all of them (:func:`vtoken.select.plan_moves`);
3. moves the per-token policy state with the tokens, and returns the global slot moves for
   the KV-cache move kernel (:mod:`vtoken.kernels.move`), which applies the same moves to K/V.

Per-token policy state lives in a **side cache** (:class:`SideCache`): one tensor per field,
indexed like the KV cache by global slot id ``block_id * block_size + offset``, so that the
token table (the slot -> logical position map, field ``pos``) and the accumulated scores move
with the K/V by the same ``(src, dst)`` lists, and nothing is sized to a request's model length.
Per-request scalars (a ring index) live in ``[max_requests]`` tensors indexed by the
request's row, which the caller assigns (as vLLM's ``InputBatch`` assigns rows).

Everything is torch tensor code on one device (CPU here, CUDA on a GPU): no per-request or
per-token Python, no host sync inside a step (the move lists have data-dependent length).
Each row's decisions equal the per-request references' (``tests/reference/``: token table,
policies, ``plan_repack``): ``tests/core/test_side_cache.py`` replays random traces through both.

Precision: accumulators keep the dtype a policy declares (float64 for H2O and TOVA). GPUs run
float64 adds at a fraction of float32 speed, but a side-cache update is one elementwise add
per live token per step, far below the attention's cost; float64 keeps the engine's decisions
equal to the dense oracle's (float32 accumulation reorders near-ties). Revisit if a profile
shows otherwise.

This module never imports vllm.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from vtoken.policies.base import EvictionPolicy
from vtoken.select import global_slots, plan_moves, select_one, select_victims

__all__ = ["SideCache", "DeviceDecider", "Eviction", "side_bytes_per_token"]


def side_bytes_per_token(policy: EvictionPolicy, num_sets: int = 1) -> int:
    """Bytes of side-cache state per KV slot that :class:`SideCache` holds for ``policy``: the
    logical position (int64) plus the policy's fields (:meth:`EvictionPolicy.side_specs`), times
    ``num_sets``; what :attr:`SideCache.bytes_per_token` reports once it exists."""
    per_set = 8 + sum(math.prod(lead) * torch.empty((), dtype=dt).element_size()
                      for lead, dt in policy.side_specs().values())
    return per_set * int(num_sets)


class SideCache:
    """Per-token policy state paged like the KV cache (module docstring).

    Args:
        num_slots: ``num_blocks * block_size`` of the KV cache it shadows.
        specs: per-slot fields, name -> (leading shape, torch dtype), e.g. H2O's
            ``{"acc": ((), torch.float64)}`` (:meth:`EvictionPolicy.side_specs`). The field
            ``pos`` (int64, the token's logical position) is always added.
        device: where the tensors live (the KV cache's device).
        num_sets: token sets per request (``docs/granularity.md``): 1 for ``request``,
            ``L`` for ``layer``, ``L * Hkv`` for ``head``, ``Hkv`` for ``head_shared``. Each
            set has its own copy of every field: a slot of set ``s`` holds that set's token.

    Attributes:
        fields: name -> tensor ``[num_sets, num_slots, *lead]`` (set-major: a gather of ``R``
            requests' slots is ``[S, R, N, *lead]``, whose ``(set, request)`` rows the batched
            policy code takes as they are, without a copy).
    """

    def __init__(self, num_slots: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device | str = "cpu", num_sets: int = 1):
        if "pos" in specs:
            raise ValueError("side-cache field name 'pos' is reserved (the logical position)")
        if isinstance(num_sets, bool) or not isinstance(num_sets, int) or num_sets < 1:
            raise ValueError(f"num_sets = {num_sets!r}; allowed: an integer >= 1")
        self.num_sets = num_sets
        specs = {"pos": ((), torch.int64), **specs}
        self.fields = {k: torch.zeros((num_sets, num_slots, *lead), dtype=dt, device=device)
                       for k, (lead, dt) in specs.items()}

    @property
    def bytes_per_token(self) -> int:
        """Bytes of side-cache state per KV slot, every set included (to count against the KV pool)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.fields.values()) if self.num_slots else 0

    @property
    def num_slots(self) -> int:
        return int(self.fields["pos"].shape[1])

    def gather(self, slots: torch.Tensor, names: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
        """Fields at global ``slots`` (int64 ``[R, N]``): name -> ``[num_sets, R, N, *lead]``
        (copies); ``names``: only these (default: every field)."""
        flat = slots.reshape(-1)
        return {k: (t := self.fields[k]).index_select(1, flat).view(t.shape[0], *slots.shape, *t.shape[2:])
                for k in (self.fields if names is None else names)}

    def scatter(self, slots: torch.Tensor, mask: Optional[torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """Write ``values[name][:, mask]`` (``[num_sets, R, N, *lead]``) back to ``slots[mask]``
        (bool ``mask`` ``[R, N]``; None: every slot, which must then be distinct), in every set."""
        if mask is None:
            at = slots.reshape(-1)
            for k, v in values.items():
                self.fields[k].index_copy_(1, at, v.reshape(v.shape[0], at.shape[0], *v.shape[3:]))
            return
        at = slots[mask]
        for k, v in values.items():
            self.fields[k].index_copy_(1, at, v[:, mask])

    def move(self, src: torch.Tensor, dst: torch.Tensor, sets: Optional[torch.Tensor] = None) -> None:
        """Copy every field's ``src`` slots to ``dst`` slots (gather first, then scatter), as the
        KV move kernels do (int64 ``[M]`` global slot ids, disjoint within a set); ``sets``:
        int64 ``[M]``, the set each move belongs to (None: every set moves alike)."""
        if src.numel():
            for t in self.fields.values():
                if sets is None:
                    t[:, dst] = t[:, src]
                else:
                    t[sets, dst] = t[sets, src]


class Eviction(NamedTuple):
    """What one :meth:`DeviceDecider.evict` did (rows are the batch's order).

    Attributes:
        src, dst: int64 ``[M]`` global slot ids of the KV moves (for :mod:`vtoken.kernels.move`).
        rows, src_slot, dst_slot: int64 ``[M]``: the batch row and request-relative slots.
        new_live: int64 ``[R]`` live tokens per request afterwards.
        evicted_pos: int64 ``[V]`` logical positions evicted, ``evicted_rows`` int64 ``[V]`` their
            batch rows (Naive-Evict's dead-block accounting; prefix caching's first evicted
            position is their per-row minimum); with several sets, every set's victims.
        sets: int64 ``[M]``: the token set of each move (all 0 with one set); a move of set
            ``s`` applies to the (layer, KV head) pairs that set covers (``docs/granularity.md``).
        live_as_expected: with :meth:`DeviceDecider.evict`'s ``expect_live``: whether every
            request kept exactly that many tokens (else None).
    """

    src: torch.Tensor
    dst: torch.Tensor
    rows: torch.Tensor
    src_slot: torch.Tensor
    dst_slot: torch.Tensor
    new_live: torch.Tensor
    evicted_pos: torch.Tensor
    evicted_rows: torch.Tensor
    sets: torch.Tensor
    live_as_expected: Optional[bool] = None


class DeviceDecider:
    """One policy's batched decisions over a side cache (module docstring).

    Args:
        policy: the eviction policy (its batched methods; protections come per call).
        num_slots: KV-cache slots (``num_blocks * block_size``).
        block_size: tokens per block.
        max_requests: request rows (``max_num_seqs``).
        device: the KV cache's device.
        num_sets: token sets per request (``docs/granularity.md``). Every set of a request
            keeps the same live count (the request's ``live``); each has its own slot ->
            logical position map and policy state, and evicts the same ``k`` with the same
            protections. The policy's batched methods see one row per (set, request), set-major.

    Every method takes ``rows`` (int64 ``[R]``, distinct request rows) and ``block_table``
    (int ``[R, max_blocks]``: row ``i`` lists the blocks of request ``rows[i]``, before any
    truncation of this step).
    """

    def __init__(self, policy: EvictionPolicy, num_slots: int, block_size: int, max_requests: int,
                 device: torch.device | str = "cpu", num_sets: int = 1):
        self.policy = policy
        self.block_size = int(block_size)
        self.side = SideCache(num_slots, policy.side_specs(), device, num_sets)
        self.num_sets = self.side.num_sets
        self.live = torch.zeros(max_requests, dtype=torch.int64, device=device)
        self.logical = torch.zeros(max_requests, dtype=torch.int64, device=device)
        #: per request row: its first ``shared`` slots are read-only (prefix-cache blocks other
        #: requests hold too, :meth:`share_prefix`): their policy state is never written
        self.shared = torch.zeros(max_requests, dtype=torch.int64, device=device)
        self.req_fields = {k: torch.zeros((self.num_sets, max_requests), dtype=dt, device=device)
                           for k, dt in policy.request_specs().items()}
        #: Naive-Evict's accounting (:meth:`naive_freed_blocks`): per request row and logical
        #: block ``p // B``, the (set, token) evictions so far; int32 ``[max_requests, C]``, ``C``
        #: grown (doubling) to the widest logical block index any request evicted: 4 bytes per
        #: row and logical block of the longest request, not counted in the side cache's bytes
        self.dead = torch.zeros((max_requests, 0), dtype=torch.int32, device=device)
        self._cols_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def ensure_rows(self, n: int) -> None:
        """Make room for request rows ``0..n-1`` (new rows start empty)."""
        have = self.live.shape[0]
        if n <= have:
            return
        grow = lambda t, d=0: torch.cat([t, torch.zeros((*t.shape[:d], n - have, *t.shape[d + 1:]), dtype=t.dtype,  # noqa: E731
                                                        device=t.device)], dim=d)
        self.live, self.logical, self.shared = grow(self.live), grow(self.logical), grow(self.shared)
        self.req_fields = {k: grow(t, 1) for k, t in self.req_fields.items()}
        self.dead = grow(self.dead)

    # (set, request) rows: [S, R, N, *lead] <-> [S*R, N, *lead] (row s*R + r), views, no copy
    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    def _unflat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.num_sets, t.shape[0] // self.num_sets, *t.shape[1:])

    def _rep(self, v: torch.Tensor | int) -> torch.Tensor | int:
        """A per-request value ``[R]`` for every (set, request) row ``[S*R]`` (ints pass)."""
        if isinstance(v, torch.Tensor) and self.num_sets > 1:
            return torch.cat([v] * self.num_sets)  # (= v.repeat(num_sets); a cheaper op for small [R])
        return v

    def _slots(self, rows: torch.Tensor, block_table: torch.Tensor, n: int,
               live: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slots ``[R, n]`` of each row's request-relative slots ``0..n-1`` (padding slots
        point at slot 0 of the row's first block) and the live mask (``live``: ``self.live[rows]``
        when the caller has it)."""
        bs = self.block_size
        cols, col_blk, col_off = self._cols(n)
        if live is None:
            live = self.live[rows]
        mask = cols[None, :] < live[:, None]
        slots = block_table.gather(1, torch.where(mask, col_blk, 0)).to(torch.int64) * bs + torch.where(mask, col_off, 0)
        return slots, mask

    def _slots_full(self, block_table: torch.Tensor, n: int) -> torch.Tensor:
        """Global slots ``[R, n]`` of slots ``0..n-1`` of each row, every one of them live."""
        _, col_blk, col_off = self._cols(n)
        return block_table[:, col_blk].to(torch.int64) * self.block_size + col_off

    def _cols(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``arange(n)``, ``// B`` and ``% B`` of it on the decider's device (made once per ``n``)."""
        got = self._cols_cache.get(n)
        if got is None:
            cols = torch.arange(n, device=self.live.device)
            got = self._cols_cache[n] = (cols, cols // self.block_size, cols % self.block_size)
            if len(self._cols_cache) > 64:
                self._cols_cache.pop(next(iter(self._cols_cache)))
        return got

    def reset(self, rows: torch.Tensor) -> None:
        """New requests (or a request whose state is dropped) at ``rows``: nothing live."""
        self.live[rows] = 0
        self.logical[rows] = 0
        self.shared[rows] = 0
        for t in self.req_fields.values():
            t[:, rows] = 0
        self.dead[rows] = 0

    def dead_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """Which logical blocks ``b`` (positions ``b*B .. b*B + B-1``) of request ``rows`` (int64
        ``[R]``) every set has evicted whole (a partly filled last block never is: it has fewer
        than ``B * num_sets`` evictions).

        Returns:
            bool ``[R, C]`` (``C``: the table's width, at least the widest evicted block + 1), on
            the decider's device.
        """
        return self.dead[rows] == self.block_size * self.num_sets

    def naive_freed_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """Naive-Evict's freed blocks of request ``rows`` (int64 ``[R]``): the count of
        :meth:`dead_blocks`. On the append-only layout Naive-Evict frees exactly these, so it
        holds ``cdiv(logical, B) - freed`` blocks, the count :class:`vtoken.repack.NaiveEvictCounter`
        keeps from the same positions (several sets: a block is freed once it is dead in all of
        them, the union of what they keep).

        Returns:
            int64 ``[R]``, on the decider's device.
        """
        return self.dead_blocks(rows).sum(1, dtype=torch.int64)

    def share_prefix(self, rows: torch.Tensor, n: torch.Tensor | int) -> None:
        """Mark the first ``n`` slots of request ``rows`` (int64 ``[R]``; ``n`` int or ``[R]``,
        whole blocks) as shared: a prefix-cache hit, blocks other requests hold and write too.
        From now on this request writes their logical positions (the same values every holder
        writes: slot ``p`` holds position ``p`` in a cached block) but never their policy state,
        in :meth:`append` and :meth:`observe`; the request must protect them from eviction
        (``protected_prefix >= n``), so their state is never read for it either. Cleared by
        :meth:`reset`."""
        self.shared[rows] = n

    def append(self, rows: torch.Tensor, block_table: torch.Tensor, counts: torch.Tensor, *,
               n_max: Optional[int] = None, uniform: bool = False, no_shared: bool = False) -> None:
        """Append ``counts[i]`` new tokens to request ``rows[i]``: logical positions
        ``logical..logical+count-1`` go to slots ``live..live+count-1`` in every set, with
        zeroed state (except in shared slots, :meth:`share_prefix`).

        Args:
            counts: int64 ``[R]``, ``>= 0``; the block table must cover the new slots.
            n_max: ``max(counts)`` where the caller knows it on the host (else one host read).
            uniform: every count equals ``n_max`` (a decode step's 1 each): no padding to mask.
            no_shared: no row has a shared prefix (:meth:`share_prefix`; the caller knows).
        """
        r = rows.shape[0]
        if r == 0:
            return
        if n_max is None:
            n_max = int(counts.max())  # a host read: the batch's widest chunk
        if n_max == 0:
            return
        bs = self.block_size
        if uniform and n_max == 1:  # a decode step: one token per row, at slot ``live``
            rel = self.live[rows]
            at = block_table.gather(1, (rel // bs)[:, None])[:, 0].to(torch.int64) * bs + rel % bs
            own = at if no_shared else at[rel >= self.shared[rows]]
            for k, t in self.side.fields.items():
                if k != "pos":
                    t[:, own] = 0
            self.side.fields["pos"][:, at] = self.logical[rows][None, :]
            counts = counts if counts.dtype == torch.int64 else counts.to(torch.int64)
            self.live.index_add_(0, rows, counts)  # (distinct rows)
            self.logical.index_add_(0, rows, counts)
            return
        j = self._cols(n_max)[0]
        rel = self.live[rows][:, None] + j[None, :]
        logical = self.logical[rows][:, None] + j[None, :]
        if uniform:  # no padding: every (row, j) is a new token, in row-major order
            slots = block_table.gather(1, rel // bs).to(torch.int64) * bs + rel % bs
            at = slots.reshape(-1)
            own = at if no_shared else slots[rel >= self.shared[rows][:, None]]
            new_pos = logical.reshape(-1)
        else:
            mask = j[None, :] < counts[:, None]
            rel_safe = torch.where(mask, rel, 0)
            slots = block_table.gather(1, rel_safe // bs).to(torch.int64) * bs + rel_safe % bs
            at = slots[mask]
            own = at if no_shared else slots[mask & (rel >= self.shared[rows][:, None])]
            new_pos = logical[mask]
        for k, t in self.side.fields.items():
            if k != "pos":
                t[:, own] = 0
        self.side.fields["pos"][:, at] = new_pos[None, :]
        if counts.dtype != torch.int64:
            counts = counts.to(torch.int64)
        self.live.index_add_(0, rows, counts)  # (distinct rows)
        self.logical.index_add_(0, rows, counts)

    def observe(self, rows: torch.Tensor, block_table: torch.Tensor, col_sum: Optional[torch.Tensor],
                last_row: Optional[torch.Tensor], key_norm: Optional[torch.Tensor] = None,
                key_sim: Optional[torch.Tensor] = None, *, no_shared: bool = False, full: bool = False) -> None:
        """Fold one step's statistics into the side cache: :meth:`EvictionPolicy.observe_batched`
        on every (request, set) row.

        Args:
            col_sum, last_row: float ``[R, N]`` (one set) or ``[R, S, N]``, in each set's slot
                order, ``N >= max live``; or None. Padding past a request's live count is ignored.
            key_norm: as ``col_sum``, the norms of the keys written in the step (``NaN``
                elsewhere), for a policy that needs ``AttentionNeed.KEY_NORM``; or None.
            key_sim: as ``col_sum``, each live slot's similarity to its head's anchor, for a
                policy with ``eviction_keys`` (KeyDiff), set right before an eviction; or None.
            no_shared: no row has a shared prefix (:meth:`share_prefix`; the caller knows).
            full: every row has exactly ``N`` live tokens (the caller knows): nothing to mask.
        """
        if rows.shape[0] == 0 or (col_sum is None and last_row is None and key_norm is None and key_sim is None):
            return
        r, sets = rows.shape[0], self.num_sets
        shaped = []
        for x in (col_sum, last_row, key_norm, key_sim):
            if x is not None:
                if x.dim() == 2:
                    x = x[:, None, :]
                if x.shape[:2] != (r, sets):
                    raise ValueError(f"statistics have shape {tuple(x.shape)}; expected [{r}, {sets}, N] "
                                     f"(requests, token sets, slots)")
            shaped.append(x)
        col_sum, last_row, key_norm, key_sim = shaped
        n = next(x for x in shaped if x is not None).shape[2]
        live_r = self.live[rows]
        if full:  # every slot 0..n-1 of every row is live
            slots = self._slots_full(block_table, n)
            mask = mask_f = None
        else:
            slots, mask = self._slots(rows, block_table, n, live_r)
            mask_f = mask.repeat(sets, 1) if sets > 1 else mask
        want_pos = self.policy.observe_needs_pos  # (SnapKV pools in logical order)
        fields = {k: self._flat(v) for k, v in self.side.gather(
            slots, [k for k in self.side.fields if k != "pos" or want_pos]).items()}
        req = {k: t[:, rows].reshape(sets * r) for k, t in self.req_fields.items()}
        live = self._rep(live_r)

        def pad(x, fill: float):  # [R, S, N] -> rows s*R + r (a new tensor), padding set to ``fill``
            if x is None:
                return None
            y = x.transpose(0, 1).reshape(sets * r, n)
            if mask_f is None:
                return y.clone() if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else y
            return torch.where(mask_f, y, torch.full((), fill, dtype=y.dtype, device=y.device))

        extra = {}
        if key_norm is not None:  # NaN (not written this step) stays NaN; padding becomes NaN too
            extra["key_norm"] = pad(key_norm, float("nan"))
        if key_sim is not None:  # padding becomes NaN
            extra["key_sim"] = pad(key_sim, float("nan"))
        self.policy.observe_batched({**fields, **req}, live, pad(col_sum, 0.0), pad(last_row, 0.0), **extra)
        if mask is None:
            own = None if no_shared else self._cols(n)[0][None, :] >= self.shared[rows][:, None]
        else:
            own = mask if no_shared else mask & (self._cols(n)[0][None, :] >= self.shared[rows][:, None])
        self.side.scatter(slots, own, {k: self._unflat(v) for k, v in fields.items() if k != "pos"})
        for k, t in self.req_fields.items():
            t[:, rows] = req[k].reshape(sets, r)

    def observe_written(self, slots: torch.Tensor, key_norm: torch.Tensor) -> None:
        """Fold the norms of the keys a step wrote into those slots only, for a policy with
        ``observes_written_only`` (K-norm): :meth:`EvictionPolicy.observe_batched` on the written
        slots' fields, every set at once; the same state :meth:`observe` leaves, without its read
        and write of every live slot.

        Args:
            slots: int64 ``[T]`` global slots the step wrote (none of them shared: a prefix-cache
                hit is never computed, so never written).
            key_norm: float ``[S, T]``: each set's statistic of the key at ``slots[t]``.

        Raises:
            ValueError: the policy does not declare ``observes_written_only``, or ``key_norm`` is
                not ``[num_sets, T]``.
        """
        if not self.policy.observes_written_only:
            raise ValueError(f"policy {self.policy.name!r} reads more than the written slots; use observe()")
        if key_norm.shape != (self.num_sets, slots.shape[0]):
            raise ValueError(f"key_norm has shape {tuple(key_norm.shape)}; expected "
                             f"[{self.num_sets}, {slots.shape[0]}] (token sets, written slots)")
        if slots.numel() == 0:
            return
        fields = {k: t[:, slots] for k, t in self.side.fields.items() if k != "pos"}  # [S, T] copies
        self.policy.observe_batched(fields, None, None, None, key_norm=key_norm)
        for k, v in fields.items():
            self.side.fields[k][:, slots] = v

    def evict(self, rows: torch.Tensor, block_table: torch.Tensor, k: torch.Tensor, *,
              sink_tokens: torch.Tensor | int = 0, recent_tokens: torch.Tensor | int = 0,
              protected_prefix: torch.Tensor | int = 0, width: Optional[int] = None,
              max_evict: Optional[int] = None, expect_live: Optional[torch.Tensor] = None,
              dead_width: Optional[int] = None, full: bool = False) -> Eviction:
        """Evict ``k[i]`` tokens of request ``rows[i]`` from each of its sets (module docstring,
        steps 1-3).

        Args:
            k: int64 ``[R]`` tokens to evict (``<= 0``: none).
            sink_tokens, recent_tokens, protected_prefix: per-request protections (int or ``[R]``).
            width: ``N``, at least the batch's largest live count; None reads it (a host sync).

        Host knowledge a caller may pass to spare host reads (each is checked or only a bound):

        Args:
            max_evict: ``>= max(k)`` (:func:`vtoken.select.select_victims`).
            expect_live: int64 ``[R]``, the live counts the caller expects afterwards; compared
                in the one host read that also checks the sets' counts, the answer in
                :attr:`Eviction.live_as_expected`.
            dead_width: ``>=`` the largest evicted position's block index + 1 (e.g. ``cdiv(max
                logical, B)``): the Naive-Evict table grows without reading the positions.
            full: every row has exactly ``width`` live tokens: no padding to mask.

        Returns:
            :class:`Eviction`. The side cache (``pos`` and the policy's fields) and the live
            counts are updated; the caller applies ``(src, dst)`` to the KV cache (set by set,
            ``Eviction.sets``) before any KV write of the step, then truncates the block
            tables to ``cdiv(new_live, B)``.

        Raises:
            RuntimeError: the sets of a request would keep different counts (a protection
                that is not on logical positions; cannot happen with this module's rules).
        """
        live = self.live[rows]
        r, sets = rows.shape[0], self.num_sets
        n = int(live.max()) if width is None and r else (width or 0)
        slots = self._slots_full(block_table, n) if full and width is not None else self._slots(rows, block_table, n, live)[0]
        fields = {name: self._flat(v) for name, v in self.side.gather(slots).items()}
        pos = fields.pop("pos")
        req = {name: t[:, rows].reshape(sets * r) for name, t in self.req_fields.items()}
        live_f = self._rep(live)
        scores = self.policy.score_batched({**fields, **req}, pos, live_f)
        prot = dict(sink_tokens=self._rep(sink_tokens), recent_tokens=self._rep(recent_tokens),
                    protected_prefix=self._rep(protected_prefix), num_logical=self._rep(self.logical[rows]))
        one = None
        if max_evict is not None and max_evict <= 1 and r:  # (a decode step: one victim per set at most)
            one = select_one(scores, pos, live_f, self._rep(k), **prot, check=False, all_live=full and width is not None)
        if one is not None:
            plan, ev_rows, ev_cols = one.plan, one.ev_rows, one.ev_cols
        else:
            victims = select_victims(scores, pos, live_f, self._rep(k), **prot, max_evict=max_evict, check=False)
            plan = plan_moves(victims, live_f)
            ev_rows, ev_cols = victims.nonzero(as_tuple=True)
        new_live = plan.new_live.view(sets, r)
        as_expected = None
        if r and expect_live is not None:  # one host read: the sets' counts and the caller's
            as_expected = bool((new_live == expect_live[None, :]).all())
            if not as_expected and sets > 1 and not bool((new_live == new_live[:1]).all()):
                raise RuntimeError(f"vToken: token sets of a request would keep different counts: {new_live.tolist()}")
        elif sets > 1 and r and not bool((new_live == new_live[:1]).all()):  # one host sync
            raise RuntimeError(f"vToken: token sets of a request would keep different counts: {new_live.tolist()}")
        req_rows = plan.rows % r if sets > 1 else plan.rows
        set_ids = plan.rows // r if sets > 1 else torch.zeros_like(plan.rows)
        src = slots[req_rows, plan.src]
        dst = slots[req_rows, plan.dst]
        self.side.move(src, dst, set_ids if sets > 1 else None)
        self.live[rows] = new_live[0]
        ev_req = ev_rows % r if sets > 1 else ev_rows
        ev_pos = pos[ev_rows, ev_cols]
        if ev_pos.numel():  # (its length is known on the host already: a data-dependent shape)
            blk = ev_pos // self.block_size
            need = int(dead_width) if dead_width is not None else int(blk.max()) + 1
            if need > self.dead.shape[1]:
                grown = torch.zeros((self.dead.shape[0], max(need, 2 * self.dead.shape[1])), dtype=torch.int32,
                                    device=self.dead.device)
                grown[:, : self.dead.shape[1]] = self.dead
                self.dead = grown
            self.dead.index_put_((rows[ev_req], blk), torch.ones_like(blk, dtype=torch.int32), accumulate=True)
        return Eviction(src, dst, req_rows, plan.src, plan.dst, new_live[0], ev_pos, ev_req, set_ids, as_expected)

    def logical_pos(self, row: int, block_table_row: torch.Tensor, set_index: int = 0) -> torch.Tensor:
        """int64 ``[live]``: request ``row``'s slot -> logical position in set ``set_index``
        (tests, snapshots)."""
        n = int(self.live[row])
        rel = torch.arange(n, device=block_table_row.device)
        return self.side.fields["pos"][set_index,
                                       global_slots(block_table_row[None, :], torch.zeros_like(rel), rel, self.block_size)]
