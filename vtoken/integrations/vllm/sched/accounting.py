"""Block accounting: how many KV blocks a vToken request holds, and the KV manager that obeys it.

:class:`BlockAccounting` turns a request's logical token count into the slots to allocate
(live tokens under ``mode: vtoken``; Naive-Evict's retained blocks under ``mode: naive``).
:class:`VTokenFullAttentionManager` (a ``FullAttentionManager`` subclass, patches/ entry
``vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager``) asks it; it reads only
the request states, never the scheduler.

Prefix caching (docs/integration.md, "Prefix caching"): vLLM hashes a request's full blocks
as it allocates them (``cache_blocks``), as stock vLLM does, until the request first evicts.
From then on its blocks from its first evictable position on may be written (repack moves,
new tokens in freed slots), so :meth:`VTokenFullAttentionManager.cache_blocks` caches only the
blocks below it (``BlockAccounting.cache_cap``, set by the scheduler at the first eviction, when
it also copies the cached blocks the request keeps past it into private ones).

The allocation hooks run for every scheduled request in every step, so they read
:attr:`BlockAccounting.deltas` (the offset of each request that has evicted, kept in step by
the scheduler) with one dict lookup instead of walking the request's state, and call vLLM's
method directly with its own signature.
"""

from __future__ import annotations

import inspect
from typing import Mapping

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from vtoken.integrations.vllm.sched.state import RequestState, cdiv

__all__ = ["BlockAccounting", "VTokenFullAttentionManager"]


def _signature(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


_E = inspect.Parameter.empty
#: vLLM's allocation hooks have the signature the fast overrides below are written for
_FAST_HOOKS = (
    _signature(FullAttentionManager.get_num_blocks_to_allocate) == [
        ("self", _E), ("request_id", _E), ("num_tokens", _E), ("new_computed_blocks", _E),
        ("total_computed_tokens", _E), ("num_local_computed_tokens", _E), ("num_tokens_main_model", _E),
        ("apply_admission_cap", False), ("prefill_end", 0)]
    and _signature(FullAttentionManager.allocate_new_blocks) == [
        ("self", _E), ("request_id", _E), ("num_tokens", _E), ("num_tokens_main_model", _E)]
)


class BlockAccounting:
    """Blocks per request under vToken or Naive-Evict.

    Args:
        states: request id -> :class:`RequestState` (the scheduler's dict, read only).
        block_size: tokens per KV block.
    """

    def __init__(self, states: Mapping[str, RequestState], block_size: int):
        self.states = states
        self.block_size = block_size
        #: request id -> tokens of its prefix vLLM may still hash (prefix caching on, set at the
        #: request's first eviction: its never-evicted prefix, whole blocks); absent: no limit
        #: (stock caching: it has evicted nothing).
        self.cache_cap: dict[str, int] = {}
        #: request id -> :meth:`delta` as the KV manager's hot path reads it: the offset of a
        #: ``mode: vtoken`` request that has evicted (``num_logical - num_live > 0``),
        #: :data:`NAIVE` for a ``mode: naive`` request (its delta depends on the token count,
        #: so :meth:`delta` computes it); absent: 0 (no state, or nothing evicted yet). The
        #: scheduler keeps it in step with the tables (:meth:`set_offset`, :meth:`forget`);
        #: ``VTOKEN_CHECK=1`` checks it every step.
        self.deltas: dict[str, int] = {}
        #: request id -> tokens vLLM reserves at its admission at most (``prefill_eviction:
        #: chunks``: budget + slack + chunk + 1, ``sched/admission.py``); absent: the full prompt
        self.admission_cap: dict[str, int] = {}
        #: ids of the blocks vLLM hashed in the current ``schedule()``: their KV is computed in this
        #: step's forward, so a request that hits one in this step may not copy it before the
        #: forward (the scheduler trims such a hit: ``VTokenSchedulerMixin._get_local_prefix_cache_hit``)
        self.cached_now: set[int] = set()

    #: :attr:`deltas` value of a ``mode: naive`` request
    NAIVE = -1

    def set_offset(self, request_id: str, st: RequestState) -> None:
        """Bring ``request_id``'s :attr:`deltas` entry in step with ``st`` (a state made, or an
        eviction that changed its table's offset)."""
        e = self.expected_delta_entry(st)
        if e is None:
            self.deltas.pop(request_id, None)
        else:
            self.deltas[request_id] = e

    #: a state was made for a request (its table is fresh: offset 0)
    track = set_offset

    def forget(self, request_id: str) -> None:
        """``request_id``'s state was dropped."""
        self.deltas.pop(request_id, None)

    def expected_delta_entry(self, st: RequestState):
        """What :attr:`deltas` must hold for a request with state ``st`` (None: absent)."""
        if st.plan.mode == "naive":
            return self.NAIVE
        off = st.table.num_logical - st.table.num_live
        return off if (st.plan.mode == "vtoken" and off) else None

    def delta(self, request_id: str, num_tokens: int) -> int:
        """Tokens to subtract from a logical token count to get the slots to allocate."""
        st = self.states.get(request_id)
        if st is None:
            return 0
        table = st.table
        offset = table.num_logical - table.num_live
        if st.plan.mode == "vtoken":
            return offset
        phys = num_tokens - offset
        if st.plan.mode == "naive":
            bs = self.block_size
            extra_blocks = max(0, cdiv(num_tokens, bs) - cdiv(st.naive.num_logical, bs))
            need = (st.naive.num_retained_blocks + extra_blocks) * bs
            phys = max(phys, min(need, num_tokens))
        return num_tokens - phys

    def target_blocks(self, st: RequestState, upcoming: int = 0) -> int:
        """Blocks the request should hold for its live tokens plus ``upcoming`` tokens.

        Eviction keeps room for the one token a decoding request writes in this step
        (``upcoming=1``), so a budget that is a multiple of the block size does not free a
        block and allocate it back every step.
        """
        dense = cdiv(st.table.num_live + upcoming, self.block_size)
        if st.plan.mode == "naive":
            return max(dense, st.naive.num_retained_blocks)
        return dense


class VTokenFullAttentionManager(FullAttentionManager):
    """Full-attention KV manager whose allocation counts live (physical) tokens.

    Installed by ``__class__`` swap on the scheduler's manager (the spec registry refuses a
    second ``FullAttentionSpec`` manager). Token counts arrive logical;
    ``BlockAccounting.delta`` (tokens) is subtracted so blocks cover ``live + new`` tokens
    under vToken, or Naive-Evict's retained blocks under ``naive``.
    """

    _vt_accounting: BlockAccounting
    _vt_deltas: dict  # _vt_accounting.deltas

    def vt_attach(self, accounting: BlockAccounting) -> None:
        """Give this manager (after the ``__class__`` swap) the scheduler's accounting."""
        self._vt_accounting = accounting
        self._vt_deltas = accounting.deltas

    def cache_blocks(self, request, num_tokens, *args, **kwargs):
        """Stock caching, capped at ``BlockAccounting.cache_cap`` tokens for a request that has
        evicted (its blocks past the cap may be written, so no other request may hit them); the
        blocks it hashes go to ``BlockAccounting.cached_now``."""
        rid = request.request_id
        cap = self._vt_accounting.cache_cap.get(rid)
        if cap is not None and num_tokens > cap:
            num_tokens = cap
        before = self.num_cached_block.get(rid, 0)
        out = super().cache_blocks(request, num_tokens, *args, **kwargs)
        after = self.num_cached_block.get(rid, 0)
        if after > before:  # (hashed now: computed in this step's forward)
            self._vt_accounting.cached_now.update(b.block_id for b in self.req_to_blocks[rid][before:after])
        return out

    def vt_free_tail(self, request_id: str, keep: int) -> list:
        """Hand the request's blocks past its first ``keep`` back to vLLM's block pool (an
        eviction emptied them); besides it, vToken edits ``req_to_blocks`` only when it copies shared
        hit blocks into private ones (``VTokenSchedulerMixin._vt_copy_cached``).

        Returns:
            the freed ``KVCacheBlock`` s (tail first), empty when it holds ``<= keep`` blocks.
        """
        blocks = self.req_to_blocks[request_id]
        if len(blocks) <= keep:
            return []
        tail = blocks[keep:]
        del blocks[keep:]
        tail.reverse()  # the pool's free order: the tail end first
        self.block_pool.free_blocks(tail)
        return tail

    # The two allocation hooks run for every scheduled request in every step: one dict lookup
    # (``BlockAccounting.deltas``), then the stock method, called directly with vLLM's own
    # signature (no ``super()`` object, no ``*args``/``**kwargs`` packing: together about 0.6 us a
    # call). The signature is checked at import (_FAST_HOOKS); a vLLM that changed it gets the
    # generic forms below, which pass everything through.
    if _FAST_HOOKS:
        def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                       num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                       prefill_end=0):
            d = self._vt_deltas.get(request_id)
            if d is not None:
                if d < 0:  # BlockAccounting.NAIVE
                    d = self._vt_accounting.delta(request_id, num_tokens)
                num_tokens -= d
                total_computed_tokens = total_computed_tokens - d if total_computed_tokens > d else 0
                num_local_computed_tokens = num_local_computed_tokens - d if num_local_computed_tokens > d else 0
                num_tokens_main_model -= d
            if apply_admission_cap:  # admission reserves the full prompt: at most the request's bound (live tokens)
                cap = self._vt_accounting.admission_cap.get(request_id)
                if cap is not None and num_tokens > cap:
                    num_tokens = cap
                    num_tokens_main_model = min(num_tokens_main_model, cap)
            return FullAttentionManager.get_num_blocks_to_allocate(
                self, request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
                num_tokens_main_model, apply_admission_cap, prefill_end)

        def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
            d = self._vt_deltas.get(request_id)
            if d is not None:
                if d < 0:  # BlockAccounting.NAIVE
                    d = self._vt_accounting.delta(request_id, num_tokens)
                num_tokens -= d
                num_tokens_main_model -= d
            return FullAttentionManager.allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model)
    else:  # pragma: no cover - another vLLM's signature
        def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                       num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
            d = self._vt_accounting.delta(request_id, num_tokens)
            cap = self._vt_accounting.admission_cap.get(request_id) if kwargs.get("apply_admission_cap") else None
            if cap is not None and num_tokens - d > cap:
                num_tokens, num_tokens_main_model = cap + d, min(num_tokens_main_model, cap + d)
            if d:
                num_tokens -= d
                total_computed_tokens = max(total_computed_tokens - d, 0)
                num_local_computed_tokens = max(num_local_computed_tokens - d, 0)
                num_tokens_main_model -= d
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_local_computed_tokens,
                                                      num_tokens_main_model, *args, **kwargs)

        def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
            d = self._vt_accounting.delta(request_id, num_tokens)
            return super().allocate_new_blocks(request_id, num_tokens - d, num_tokens_main_model - d, *args, **kwargs)
