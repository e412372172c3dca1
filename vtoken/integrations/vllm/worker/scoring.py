"""Attention statistics for the eviction policies, computed next to the stock attention kernel.

:class:`StepScores` is filled by the attention wrapper of
:class:`~vtoken.integrations.vllm.worker.step.WorkerStep`, layer by layer, from the
query the attention layer received and the keys it reads back from the KV cache through the
backend's :class:`~vtoken.integrations.vllm.worker.kv_layout.KVLayout`. The statistics are those of
:mod:`vtoken.policies.base` (post-softmax probabilities averaged over query heads and layers).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Iterable, Optional

import numpy as np
import torch

from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack, KVLayout
from vtoken.policies.base import AttentionNeed

__all__ = ["StepScores", "BatchedScores", "prefill_stats", "set_means", "set_means_batched", "TILE_ELEMS",
           "MAX_TILE_ROWS"]

#: Most logits one query tile of the prefill column-sum path holds (``Hq * rows * n``): 4M
#: elements (16 MiB in float32); the softmax adds one more (the sums need no float64 copy).
TILE_ELEMS = 1 << 22
#: Most key elements (float32) one read of every layer's keys holds in the deferred one-query
#: path (:meth:`StepScores._finish_singles`): 16M (64 MiB); rows are read in chunks under it.
STACK_READ_ELEMS = 1 << 24
#: Most query rows per tile: smaller tiles skip more of the causal triangle's masked keys.
MAX_TILE_ROWS = 128


@functools.lru_cache(maxsize=8)
def _above_diagonal(t: int, device: torch.device) -> torch.Tensor:
    """bool ``[t, t]`` on ``device``: True above the diagonal (a query tile's masked keys among its last ``t``)."""
    return torch.ones((t, t), dtype=torch.bool, device=device).triu_(1)


def prefill_stats(q: torch.Tensor, k: torch.Tensor, scale: float, want_last: bool,
                  tile_elems: int = TILE_ELEMS, dtype: torch.dtype = torch.float32, per_kv_head: bool = False,
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal attention probabilities of a prefill chunk, reduced to column sums (and last row).

    ``probs[i, j] = mean over query heads h of softmax_j(q[i, h] . k[h // G, j] * scale)``, with
    query row ``i`` at key index ``n - ql + i`` (the chunk's rows are the last ``ql`` of the
    ``n`` keys) and keys after it masked; ``G = Hq / Hkv`` (grouped-query attention). Computed
    over tiles of ``T = max(1, min(MAX_TILE_ROWS, tile_elems // (Hq * n)))`` query rows, each
    against the keys up to its last row only (the causal triangle's masked keys, whose
    probabilities are exactly 0, are skipped: about half the work), so the extra memory is
    a few ``[Hq, T, n]`` temporaries (float32 logits and probabilities: about ``2 * tile_elems``
    float32 elements while ``Hq * n <= tile_elems``, ``2 * Hq * n`` beyond),
    never the ``[Hq, ql, n]`` of the whole chunk: linear in the prompt length, not quadratic.
    Logits and softmax are computed in ``dtype`` (float32 in the worker), the column sums
    (over rows, then heads) and the head mean in float64. The tiling itself is exact: with
    ``dtype=float64`` any two tile sizes agree to 1e-12 (tests). In float32 they agree to float32 rounding (~1e-7
    relative), not bit for bit, because the CPU matmul's blocking, and so its rounding,
    depends on the number of query rows in the product; the former untiled path differs
    from any tiling by the same amount.

    Args:
        q: ``[ql, Hq, hd]`` post-RoPE queries of the chunk (any float dtype; computed in float32).
        k: float32 ``[Hkv, n, hd]`` keys of the request's slots ``0..n-1``, ``n >= ql``.
        scale: the attention softmax scale.
        want_last: also return the last query row's probabilities.
        tile_elems: logits elements per tile (tests use small values to force many tiles).
        dtype: dtype of the logits and softmax (float32 in the worker; float64 in tests).
        per_kv_head: the mean over each KV head's ``G`` query heads instead of over all
            ``Hq`` (per-head token sets, ``docs/granularity.md``).

    Returns:
        ``(col_sum, last_row)``: float64 ``[n]`` (sum over the ``ql`` rows) and float64 ``[n]``
        or None; ``[Hkv, n]`` each with ``per_kv_head``.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, or ``n < ql``.
    """
    ql, Hq, hd = q.shape
    Hkv, n, _ = k.shape
    if Hq % Hkv or n < ql:
        raise ValueError(f"prefill_stats: Hq={Hq} must be a multiple of Hkv={Hkv} and n={n} >= ql={ql}")
    kt = k.to(dtype).repeat_interleave(Hq // Hkv, dim=0).transpose(1, 2)  # [Hq, hd, n]
    qh = q.permute(1, 0, 2).to(dtype)  # [Hq, ql, hd]
    T = max(1, min(MAX_TILE_ROWS, tile_elems // (Hq * n)))
    G = Hq // Hkv
    col = torch.zeros((Hkv, n) if per_kv_head else n, dtype=torch.float64)
    last = None
    for t0 in range(0, ql, T):
        t1 = min(ql, t0 + T)
        # Causal: the tile's rows see keys 0..hi-1 only, so the keys past them are never
        # multiplied (their probabilities are exactly 0): about half the work of a prompt.
        hi = n - ql + t1
        logits = torch.bmm(qh[:, t0:t1], kt[:, :, :hi]).mul_(scale)  # [Hq, t, hi]
        # row i (position n - ql + t0 + i) sees keys up to its own: only the tile's last t keys,
        # a strict upper triangle, are masked
        logits[:, :, hi - (t1 - t0):].masked_fill_(_above_diagonal(t1 - t0, logits.device), float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [Hq, t, hi]
        del logits
        # Sums in float64 (a float32 reduction rounds differently with the tile's shape): over the
        # tile's rows with a float64 accumulator (no float64 copy of the tile: ~2.7x faster than
        # converting it first), then over heads; the head mean is the division by Hq.
        if per_kv_head:
            col[:, :hi] += probs.sum(dim=1, dtype=torch.float64).view(Hkv, G, hi).sum(dim=1) / G
        else:
            col[:hi] += probs.sum(dim=1, dtype=torch.float64).sum(dim=0) / Hq
        if want_last and t1 == ql:
            last = probs[:, -1].double()
            last = last.view(Hkv, G, hi).mean(dim=1) if per_kv_head else last.mean(dim=0)
    return col, last


def set_means(gran: str, t: torch.Tensor) -> torch.Tensor:
    """Per-(layer, KV head) statistics ``[L, Hkv, n]`` -> each token set's, ``[S, n]`` (same
    dtype; ``docs/granularity.md``): ``head``: every (layer, KV head), layer-major; ``layer``: the
    mean over KV heads; ``head_shared``: the mean over layers; ``request``: over both (``S = 1``).

    Raises:
        ValueError: an unknown granularity.
    """
    if gran == "head":
        return t.reshape(-1, t.shape[-1])
    if gran == "layer":
        return t.mean(dim=1)
    if gran == "head_shared":
        return t.mean(dim=0)
    if gran == "request":
        return t.mean(dim=(0, 1))[None]
    raise ValueError(f"vToken scoring: unknown granularity {gran!r}")


def set_means_batched(gran: str, t: torch.Tensor) -> torch.Tensor:
    """:func:`set_means` of every row at once: ``[R, L, Hkv, n]`` -> ``[R, S, n]`` for ``head``,
    ``layer`` and ``head_shared`` (one reduction over the same axis: the same values as row by
    row; ``request``'s mean over two axes is not, so it has no batched form here: its rows take
    ``StepScores``' mean over every layer and head instead).

    Raises:
        ValueError: another granularity.
    """
    if gran == "head":
        return t.reshape(t.shape[0], -1, t.shape[-1])
    if gran == "layer":
        return t.mean(dim=2)
    if gran == "head_shared":
        return t.mean(dim=1)
    raise ValueError(f"vToken scoring: no batched set means for granularity {gran!r}")


class BatchedScores(Mapping):
    """One step's statistics as :meth:`StepScores.batched` hands them to
    ``WorkerEviction.fold``: the one-query rows (every decode row) as padded tensors, the rest
    (prefill rows over several queries, key norms) as a :data:`ScoreMap` (``StepScores.result``'s
    format).

    Attributes:
        rids: the one-query rows' request ids (None for a row whose statistics are in ``rest``).
        n: int64 ``[R]`` each row's physical length (its statistics' length).
        need: int64 ``[R]`` each row's ``AttentionNeed`` value (``COL_SUM``, ``LAST_ROW``: the
            row's statistic is both, as in :meth:`StepScores.result`).
        acc: float64 ``[R, max_n]``: mean over layers and query heads (one token set), or None
            where no row needs it.
        per_head: float64 ``[R, L, Hkv, max_n]``: each layer's mean over each KV head's query
            heads (several token sets: :func:`set_means_batched`), or None where no row has sets.
        rest: req_id -> (col_sum, last_row[, key_norm]), float64 numpy (``StepScores.result``).
        legacy: ``positions -> ScoreMap``: the rows at those positions in ``result``'s format.

    Read as a mapping it is that ``ScoreMap`` (req_id -> ``(col_sum, last_row[, key_norm])``,
    float64 numpy), the one-query rows converted on the first read.
    """

    def __init__(self, rids: list, n: np.ndarray, need: np.ndarray, acc: Optional[torch.Tensor],
                 per_head: Optional[torch.Tensor], rest: dict, legacy):
        self.rids, self.n, self.need, self.acc, self.per_head, self.rest = rids, n, need, acc, per_head, rest
        self.legacy = legacy

    def __bool__(self) -> bool:
        return bool(self.rest) or any(r is not None for r in self.rids)

    # the read-only mapping of a ``ScoreMap`` (tests and hooks that read or rewrite a step's
    # statistics; ``WorkerEviction.fold`` takes the tensors): built once, on the first read
    @functools.cached_property
    def _map(self) -> dict:
        out = dict(self.legacy([i for i, r in enumerate(self.rids) if r is not None])) if self.legacy else {}
        out.update(self.rest)
        return out

    def __getitem__(self, rid: str):
        return self._map[rid]

    def __iter__(self):
        return iter(self._map)

    def __len__(self) -> int:
        return len(self.rest) + sum(r is not None for r in self.rids)


class StepScores:
    """Accumulates one step's attention statistics per request across layers.

    For each request row that asked for scores: post-softmax probabilities of the
    step's query rows against the request's physical slots ``0..seq_len-1``, averaged
    over query heads, summed over layers; divided by the number of layers at the end
    (so: the mean over layers and heads, as ``vtoken.policies.base`` defines).

    Rows that need one query row (decode steps, and prefill rows of policies that only
    want the last row) are scored together in one batched gather + einsum per layer
    (keys padded to the longest row and masked); prefill rows that need column sums over
    several query rows take a per-row causal path tiled over query rows
    (:func:`prefill_stats`: extra memory linear in the prompt length). The gather indices
    are built once per step, at the first layer.

    Rows of requests with several token sets (``grans``, ``docs/granularity.md``) also keep,
    per layer, the mean over each KV head's query heads, and :meth:`result` reduces them to
    their sets: ``[S, n]`` per statistic.

    Args:
        rows: ``(batch row, req_id, AttentionNeed value)`` of the rows to score; the batch
            row indexes the attention metadata (``query_start_loc``, ``seq_lens``, ``block_table``).
        tile_elems: see :func:`prefill_stats`; default: the module's :data:`TILE_ELEMS`.
        grans: req_id -> granularity (``layer``, ``head``, ``head_shared``) of the rows that
            keep several token sets; None or missing: ``request``.
        windows: req_id -> observation window of the rows that need ``AttentionNeed.WINDOW``.
        rope: for rows that need ``AttentionNeed.QUERY_MOMENTS`` (Expected Attention):
            ``((cos_sin [max_position, D], a, b), positions)``, the model's RoPE
            (``WorkerStep.find_rope``) and the step's logical positions ``[>= num_tokens]``.
            Each layer keeps the queries of such rows (tokens at positions below ``QUERY_SKIP``
            left out); :meth:`take_moments` un-rotates them at their positions and sums them and
            their per-pair second moments (:func:`vtoken.policies.expected_attention.pair_terms`)
            per row, every layer in one batch.
    """

    def __init__(self, rows: list[tuple[int, str, int]], tile_elems: Optional[int] = None,
                 grans: Optional[dict[str, str]] = None, windows: Optional[dict[str, int]] = None,
                 rope: Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 stack: Optional[CPULayerStack] = None):
        self.rows = rows
        #: every layer's KV cache as one tensor (``CPULayerStack`` with ``views``): the one-query
        #: rows' probabilities are then computed once after the forward, every layer in one batch
        #: (:meth:`_finish_singles`); each layer only keeps its queries
        self.stack = stack if stack is not None and stack.views is not None else None
        self.deferred = self.stack is not None
        self._single_q: dict[int, tuple[torch.Tensor, torch.Tensor, KVLayout, Any]] = {}
        #: rows that need query moments: (batch row, req_id)
        self.moment_rows = [(row, rid) for row, rid, need in rows if need & AttentionNeed.QUERY_MOMENTS.value]
        self._rope = rope
        self._moments: dict[int, torch.Tensor] = {}  # layer -> the moment rows' queries [M, Hq, D]
        self._mplan: Optional[dict[str, torch.Tensor]] = None
        self.grans = grans or {}
        #: req_id -> observation window of rows that need ``AttentionNeed.WINDOW`` (SnapKV): their
        #: column sums cover the step's last ``window`` query rows only
        self.windows = windows or {}
        #: per-set rows over several queries: req_id -> layer index -> (col [Hkv, n] or None, last
        #: [Hkv, n] or None)
        self._sets: dict[str, dict[int, list[Optional[torch.Tensor]]]] = {}
        #: the one-query rows' per-(layer, KV head) probabilities where any row has sets: chunks
        #: ``(plan rows, layer indices, float64 [r, L', Hkv, max_n])`` (:meth:`_per_head`)
        self._ph_chunks: list[tuple[slice, list[Optional[int]], torch.Tensor]] = []
        self.tile_elems = TILE_ELEMS if tile_elems is None else tile_elems
        self.col: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.num_layers = 0
        self.num_heads = 0  #: query heads this rank scored per layer (``impl.num_heads``: Hq / TP)
        self._plan: Optional[dict[str, Any]] = None
        self._single_acc: Optional[torch.Tensor] = None  # float64 [R, max_n]
        #: rows that need the norms of the keys they write (key-only policies)
        self.needs_keys = any(need & AttentionNeed.KEY_NORM.value for _, _, need in rows)
        self._key_norms: dict[int, torch.Tensor] = {}  # layer index -> float64 [num_tokens, Hkv]

    def _build(self, meta, kv_cache: torch.Tensor) -> dict[str, Any]:
        # (the batch's host lists once: one read each, not two per row)
        qsl = meta.query_start_loc
        qsl = qsl.tolist() if isinstance(qsl, torch.Tensor) else list(qsl)
        lens = meta.seq_lens
        lens = lens.tolist() if isinstance(lens, torch.Tensor) else list(lens)
        singles, multis, keyed = [], [], []
        attn = AttentionNeed.COL_SUM.value | AttentionNeed.LAST_ROW.value
        for row, rid, need in self.rows:
            qs, qe = int(qsl[row]), int(qsl[row + 1])
            n = int(lens[row])
            if qe <= qs or n <= 0:
                continue
            if need & AttentionNeed.KEY_NORM.value:
                keyed.append((rid, n, qs, qe))
            if not need & attn:
                continue
            if need & AttentionNeed.WINDOW.value and rid in self.windows:
                qs = max(qs, qe - self.windows[rid])  # the last `window` rows are the last of the keys too
            if qe - qs == 1 or not need & AttentionNeed.COL_SUM.value:
                singles.append((row, rid, need, n, qe - 1))
            else:
                multis.append((row, rid, need, n, qs, qe))
        plan: dict[str, Any] = dict(singles=singles, multis=multis, keyed=keyed)
        if singles:
            max_n = max(x[3] for x in singles)
            rows = [x[0] for x in singles]
            r0 = rows[0]
            # (every row of the batch in order, a decode step's: a slice, no gather)
            bt = meta.block_table[r0:r0 + len(rows)] if rows == list(range(r0, r0 + len(rows))) else \
                meta.block_table[torch.tensor(rows)]
            lens_l = [x[3] for x in singles]
            lens = torch.tensor(lens_l)
            plan.update(q_index=torch.tensor([x[4] for x in singles]), max_n=max_n,
                        # padding to mask (None: every row is max_n long)
                        pad=None if min(lens_l) == max_n else torch.arange(max_n)[None, :] >= lens[:, None],
                        block_rows=bt.to(torch.int64).clamp(0, kv_cache.shape[0] - 1),  # [R, max_blocks]
                        single_rids=[x[1] for x in singles], single_n=lens.numpy(),
                        single_need=np.array([x[2] for x in singles], dtype=np.int64),
                        # the mean over every layer and head only where a row keeps one token set
                        need_acc=any(x[1] not in self.grans for x in singles))
        return plan

    def _blocks(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-query rows' block id and in-block offset of each slot ``0..max_n-1`` (``[R,
        max_n]``, ``[max_n]``), for the layer-by-layer key reads; made once per step."""
        plan = self._plan
        if "blocks" not in plan:
            bs = kv_cache.shape[2]
            s = torch.arange(plan["max_n"])
            bt = plan["block_rows"]
            plan["blocks"] = bt[:, (s // bs).clamp(max=bt.shape[1] - 1)]  # (block_rows is clamped already)
            plan["offsets"] = s % bs
        return plan["blocks"], plan["offsets"]

    def accumulate(self, impl, query: torch.Tensor, kv_cache: torch.Tensor, meta, layout: KVLayout,
                   layer_index: Optional[int] = None, key: Optional[torch.Tensor] = None) -> None:
        """Fold one layer's probabilities in (called by the attention wrapper, every layer).

        Args:
            impl: the layer's attention impl (``num_heads``, ``head_size``, ``num_kv_heads``, ``scale``).
            query: ``[num_tokens, num_heads * head_size]`` (this rank's heads), post-RoPE.
            kv_cache: the layer's KV cache.
            meta: the backend's attention metadata (physical ``seq_lens`` and slots).
            layout: the backend's :class:`KVLayout` for this layer.
            layer_index: the layer's index (its token sets; needed when any row has ``grans`` or
                needs key norms).
            key: ``[num_tokens, num_kv_heads * head_size]``, the keys the layer writes in this
                step (post-RoPE), for rows that need ``AttentionNeed.KEY_NORM``.
        """
        if self._plan is None:
            self._plan = self._build(meta, kv_cache)
        plan = self._plan
        self.num_layers += 1
        Hq, hd, Hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
        if self.num_heads and Hq != self.num_heads:
            raise ValueError(f"vToken scoring: layer with {Hq} query heads after layers with {self.num_heads}; "
                             "the tensor-parallel mean needs one head count per rank")
        self.num_heads = Hq
        q_all = query.view(-1, Hq, hd)
        if self.moment_rows:
            self._add_moments(q_all, meta, layer_index)
        if self.needs_keys and key is not None:
            # one norm per written key and KV head, for every token of the batch at once
            # (cast to float64 first, then the norm: one op)
            self._key_norms[layer_index] = torch.linalg.vector_norm(key.reshape(key.shape[0], Hkv, hd), dim=-1,
                                                                    dtype=torch.float64)
        if plan["singles"]:
            q = q_all[plan["q_index"]]
            if self.deferred and layer_index is not None:
                # the keys are read after the forward, every layer at once (the cache's slots
                # 0..n-1 of this layer do not change before then)
                self._single_q[layer_index] = (q, kv_cache, layout, impl)
            else:
                k = layout.gather_keys_batched(kv_cache, *self._blocks(kv_cache))  # [R, Hkv, max_n, hd]
                self._fold_singles(q[:, None], k[:, None], impl.scale, [layer_index])
        for row, rid, need, n, qs, qe in plan["multis"]:
            k = layout.gather_keys(kv_cache, meta.block_table[row].to(torch.int64), n)  # [Hkv, n, hd]
            if rid in self.grans:
                c, r = prefill_stats(q_all[qs:qe], k, impl.scale, bool(need & AttentionNeed.LAST_ROW.value),
                                     self.tile_elems, per_kv_head=True)
                self._sets.setdefault(rid, {})[layer_index] = [c, r]
                continue
            c, r = prefill_stats(q_all[qs:qe], k, impl.scale, bool(need & AttentionNeed.LAST_ROW.value),
                                 self.tile_elems)
            self.col[rid] = c if rid not in self.col else self.col[rid] + c
            if r is not None:
                self.last[rid] = r if rid not in self.last else self.last[rid] + r

    def _fold_singles(self, q: torch.Tensor, k: torch.Tensor, scale: float, layers: list[Optional[int]],
                      rows: slice = slice(None)) -> None:
        """Fold the one-query rows' probabilities of one or more layers in.

        Args:
            q: ``[R, L, Hq, hd]`` the rows' queries (any float dtype; float32 here).
            k: float32 ``[R, L, Hkv, max_n, hd]``, their keys (``max_n`` the plan's).
            scale: the attention softmax scale (one for every layer).
            layers: the ``L`` layer indices (their token sets).
            rows: the plan's singles these ``R`` rows are.
        """
        plan = self._plan
        R, L, Hq, hd = q.shape
        Hkv = k.shape[2]
        # float64 from the products on: a float32 product and softmax round differently with the
        # batch's padded width (another GEMM edge, another reduction tail), so a request's
        # probabilities would depend on the other requests of its step; in float64 that rounding is
        # below anything a policy compares (Scissorhands' `< 1/t` test, ties)
        q = q.double().view(R, L, Hkv, Hq // Hkv, hd)
        logits = torch.einsum("rlkgd,rlknd->rlkgn", q, k.double()) * scale
        if plan["pad"] is not None:
            logits.masked_fill_(plan["pad"][rows][:, None, None, None, :], float("-inf"))
        p_all = torch.softmax(logits, dim=-1)  # [R, L, Hkv, G, max_n]
        if plan["need_acc"]:
            probs = p_all.mean(dim=(2, 3)).sum(dim=1)  # [R, max_n]: each layer's mean, summed
            if self._single_acc is None:
                self._single_acc = torch.zeros(len(plan["singles"]), plan["max_n"], dtype=torch.float64)
            self._single_acc[rows] += probs
        if self.grans:
            # [R, L, Hkv, max_n]: each KV head's query heads, per layer (the rows with sets take theirs)
            self._ph_chunks.append((rows, list(layers), p_all.mean(dim=3)))

    def _finish_singles(self) -> None:
        """The deferred one-query rows: every layer's keys in one read of the layer stack
        (rows in chunks of at most :data:`STACK_READ_ELEMS` key elements), one batched product and
        softmax. Where the scored layers are not the stack's ``0..L-1``, layer by layer."""
        if not self._single_q:
            return
        layers = sorted(self._single_q)
        qs = self._single_q
        self._single_q = {}
        plan = self._plan
        scale = qs[layers[0]][3].scale
        stack = self.stack
        L = stack.views[0].shape[0]
        if layers != list(range(L)) or any(qs[i][3].scale != scale for i in layers):
            for i in layers:
                q, kv, lay, impl = qs[i]
                k = lay.gather_keys_batched(kv, *self._blocks(kv))
                self._fold_singles(q[:, None], k[:, None], impl.scale, [i])
            return
        q_all = torch.stack([qs[i][0] for i in layers], dim=1)  # [R, L, Hq, hd]
        R, max_n = q_all.shape[0], plan["max_n"]
        H, hd = stack.num_kv_heads, q_all.shape[-1]
        per_row = L * H * (-(-max_n // stack.block_size) * stack.block_size) * hd
        step = max(1, STACK_READ_ELEMS // per_row)
        for r0 in range(0, R, step):
            rows = slice(r0, min(R, r0 + step))
            k = stack.read_rows(plan["block_rows"][rows], max_n, 0)  # [r, L * H, max_n, hd]
            self._fold_singles(q_all[rows], k.view(k.shape[0], L, H, max_n, hd), scale, layers, rows)

    def _add_moments(self, q_all: torch.Tensor, meta, layer_index: int) -> None:
        """Keep one layer's queries of the moment rows (one gather); :meth:`take_moments`
        un-rotates them and adds their moments for every layer at once."""
        from vtoken.policies.expected_attention import QUERY_SKIP

        if self._mplan is None:
            (cos_sin, a, b), positions = self._rope
            qsl = meta.query_start_loc.cpu()
            idx, seg = [], []
            for i, (row, _) in enumerate(self.moment_rows):
                qs, qe = int(qsl[row]), int(qsl[row + 1])
                idx.append(torch.arange(qs, qe))
                seg.append(torch.full((qe - qs,), i, dtype=torch.int64))
            idx_t = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
            seg_t = torch.cat(seg) if seg else torch.zeros(0, dtype=torch.int64)
            pos = positions[idx_t.to(positions.device)].to(torch.int64).cpu()
            keep = pos >= QUERY_SKIP
            idx_t, seg_t, pos = idx_t[keep], seg_t[keep], pos[keep]
            h = cos_sin.shape[1] // 2
            cs = cos_sin[pos.to(cos_sin.device)].to(torch.float64)
            dev = q_all.device
            self._mplan = dict(idx=idx_t.to(dev), seg=seg_t.to(dev), cos=cs[:, :h].to(dev), sin=cs[:, h:].to(dev),
                               count=torch.bincount(seg_t, minlength=len(self.moment_rows)),
                               a=a.to(dev), b=b.to(dev))
        self._moments[layer_index] = q_all[self._mplan["idx"]]  # [M, Hq, D], post-RoPE

    def take_moments(self) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's query moments: ``(req_ids, qsum [R, L, Hq, D], qpair [R, L, Hq, D/2, 3],
        count [R])``, float64 but ``count`` (int64: the queries counted, every layer the same);
        every layer's queries un-rotated and summed in one batch."""
        from vtoken.policies.expected_attention import pair_terms, unrotate

        rids = [rid for _, rid in self.moment_rows]
        layers = sorted(self._moments)
        if not layers:
            z = torch.zeros(len(rids), 0)
            return rids, z, z, torch.zeros(len(rids), dtype=torch.int64)
        mp = self._mplan
        q = torch.stack([self._moments[i] for i in layers], dim=1).to(torch.float64)  # [M, L, Hq, D]
        m, nl, hq, d = q.shape
        q = unrotate(q.view(m, nl * hq, d), mp["cos"], mp["sin"], mp["a"], mp["b"])  # pre-RoPE
        nr = len(rids)
        qsum = torch.zeros(nr, nl * hq, d, dtype=torch.float64, device=q.device).index_add_(0, mp["seg"], q)
        qpair = torch.zeros(nr, nl * hq, d // 2, 3, dtype=torch.float64, device=q.device).index_add_(
            0, mp["seg"], pair_terms(q, mp["a"], mp["b"]))
        return rids, qsum.view(nr, nl, hq, d), qpair.view(nr, nl, hq, d // 2, 3), mp["count"]

    def keyed_rids(self) -> list[str]:
        """The rows that took key norms this step (empty before the first layer)."""
        return [] if self._plan is None else [k[0] for k in self._plan["keyed"]]

    def take_key_norms(self, rids: set[str]) -> Optional[tuple[list[tuple[str, int, int, int]], torch.Tensor]]:
        """Hand the key norms of rows ``rids`` to the caller (``WorkerEviction.write_key_norms``)
        instead of :meth:`result`, which no longer reports them.

        Returns:
            ``(rows, norms)``: ``rows`` ``(req_id, n, qs, qe)`` (physical length, the row's tokens
            in the batch), ``norms`` float64 ``[L, num_tokens, Hkv]`` (layer order); None when no
            such row took norms.
        """
        if self._plan is None or not self._key_norms:
            return None
        took = [k for k in self._plan["keyed"] if k[0] in rids]
        if not took:
            return None
        self._plan["keyed"] = [k for k in self._plan["keyed"] if k[0] not in rids]
        return took, torch.stack([self._key_norms[i] for i in sorted(self._key_norms)])

    def _per_head(self) -> Optional[torch.Tensor]:
        """The one-query rows' per-(layer, KV head) probabilities, float64 ``[R, L, Hkv, max_n]``,
        layers in index order (None: no row has sets, or none was scored)."""
        chunks = self._ph_chunks
        if not chunks:
            return None
        R = len(self._plan["singles"])
        if len(chunks) == 1 and chunks[0][0].indices(R) == (0, R, 1) and chunks[0][1] == sorted(chunks[0][1]):
            return chunks[0][2]
        by_layer: dict[Any, torch.Tensor] = {}
        for rows, layers, ph in chunks:
            for j, li in enumerate(layers):
                t = by_layer.get(li)
                if t is None:
                    t = by_layer[li] = torch.zeros((R, *ph.shape[2:]), dtype=ph.dtype)
                t[rows] = ph[:, j]
        keys = sorted(by_layer, key=lambda x: -1 if x is None else x)
        self._ph_chunks = [(slice(None), keys, torch.stack([by_layer[li] for li in keys], dim=1))]
        return self._ph_chunks[0][2]

    def _single_entries(self, positions: Iterable[int], out: dict) -> dict:
        """:meth:`result`'s entries of the one-query rows at ``positions`` (plan order), into ``out``."""
        plan = self._plan
        L = max(self.num_layers, 1)
        acc = None if self._single_acc is None else (self._single_acc / L).numpy()
        ph = self._per_head() if self.grans else None
        for i in positions:
            _, rid, need, n, _ = plan["singles"][i]
            if rid in self.grans:
                if ph is None:
                    continue
                layers = [ph[i, j, :, :n] for j in range(ph.shape[1])]
                out[rid] = tuple(self._reduce_sets(self.grans[rid], layers) if need & flag.value else None
                                 for flag in (AttentionNeed.COL_SUM, AttentionNeed.LAST_ROW))
            elif acc is not None:
                row = acc[i, :n]
                out[rid] = (row if need & AttentionNeed.COL_SUM.value else None,
                            row.copy() if need & AttentionNeed.LAST_ROW.value else None)
        return out

    def _add_rest(self, out: dict) -> dict:
        """:meth:`result`'s entries of the rows over several queries, and the key norms (merged
        into the rows already in ``out``)."""
        L = max(self.num_layers, 1)
        for rid, c in self.col.items():
            r = self.last.get(rid)
            out[rid] = ((c / L).numpy(), None if r is None else (r / L).numpy())
        for rid, layers in self._sets.items():
            out[rid] = tuple(self._reduce_sets(self.grans[rid], [layers[i][j] for i in sorted(layers)])
                             for j in (0, 1))
        if self._plan is not None and self._key_norms:
            layers = [self._key_norms[i] for i in sorted(self._key_norms)]
            for rid, n, qs, qe in self._plan["keyed"]:
                # [L, Hkv, ql] -> the sets' means (request: over every layer and head)
                per = [x[qs:qe].T for x in layers]
                gran = self.grans.get(rid, "request")
                kn = (torch.stack(per).mean(dim=(0, 1)).numpy()[None] if gran == "request"
                      else self._reduce_sets(gran, per))
                row = np.full((kn.shape[0], n), np.nan)
                row[:, n - (qe - qs):] = kn
                col, last = out.get(rid, (None, None))[:2]
                out[rid] = (col, last, row[0] if gran == "request" else row)
        return out

    def result(self) -> dict[str, tuple[Optional[np.ndarray], ...]]:
        """req_id -> (col_sum, last_row), float64 numpy ``[num_live]`` (None where not asked);
        rows that need key norms get a third entry, ``key_norm`` (``NaN`` outside the slots the
        step wrote); rows with several token sets ``[S, num_live]`` each."""
        self._finish_singles()
        out: dict = {}
        if self._plan is not None and self._plan["singles"]:
            self._single_entries(range(len(self._plan["singles"])), out)
        return self._add_rest(out)

    def batched(self) -> BatchedScores:
        """The step's statistics for ``WorkerEviction.fold`` (:class:`BatchedScores`): the same
        values as :meth:`result`, the one-query rows as padded tensors (no per-row arrays)."""
        self._finish_singles()
        plan = self._plan
        if plan is None or not plan["singles"]:
            return BatchedScores([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), None, None,
                                 self._add_rest({}), None)
        rids = plan["single_rids"]
        out: dict = {}
        keyed = {k[0] for k in plan["keyed"]} if self._key_norms and plan["keyed"] else ()
        if keyed:  # one-query rows with key norms: in ``rest``, their norms merged (rare)
            at = [i for i, rid in enumerate(rids) if rid in keyed]
            self._single_entries(at, out)
            rids = [None if rid in keyed else rid for rid in rids]
        self._add_rest(out)
        L = max(self.num_layers, 1)
        acc = None if self._single_acc is None else self._single_acc / L
        return BatchedScores(rids, plan["single_n"], plan["single_need"], acc,
                             self._per_head() if self.grans else None, out,
                             lambda positions: self._single_entries(positions, {}))

    @staticmethod
    def _reduce_sets(gran: str, per_layer: list[Optional[torch.Tensor]]) -> Optional[np.ndarray]:
        """Per-layer ``[Hkv, n]`` means over each KV head's query heads -> the sets' statistics,
        float64 ``[S, n]`` (``docs/granularity.md``): ``head``: every (layer, KV head) in that
        order; ``layer``: the mean over KV heads (= over the layer's query heads);
        ``head_shared``: the mean over layers."""
        if any(x is None for x in per_layer):
            return None
        return set_means(gran, torch.stack(per_layer)).numpy()
