"""The worker's eviction step: it picks the victims (``docs/eviction.md``).

The scheduler sends, per step, how many tokens each request evicts (``StepPayload.evict``)
and, when it makes a request's state, the request's policy and protections
(``StepPayload.states``). :class:`WorkerEviction`, owned by the runner-neutral
:class:`~vtoken.integrations.vllm.worker.step.WorkerStep`, keeps what the choice
needs on the worker, next to the KV cache:

* one :class:`~vtoken.side_cache.DeviceDecider` per policy (requests grouped by policy class and
  policy arguments; protections are per request), whose side cache holds each token's logical
  position and policy state, paged like the KV cache;
* its own copy of each tracked request's block ids, kept from the ``SchedulerOutput`` every
  runner receives (new requests' ``block_ids``, cached requests' ``new_block_ids``, the
  payload's truncations), so it works the same under the V1 runner and Model Runner V2.

Per step, before any KV write (:meth:`begin`): forget finished and preempted requests, start
the new ones, evict (select, plan, move the side cache) and return the global slot moves the
caller applies to every layer's K/V, truncate, take this step's block ids, append this step's
tokens. After the forward (:meth:`fold`): the step's attention statistics (already summed over
the TP group) are folded into the side cache; no statistic goes back to the scheduler, only
Naive-Evict's changed freed-block counts (:meth:`take_naive_freed`). Every TP rank
runs the same deterministic selection on the same statistics, so all ranks hold the same tables.

A preempted request whose state the scheduler keeps (``StepPayload.suspend``, ``mode: vtoken``)
has its side-cache state saved (:meth:`_suspend`; the caller saves its K/V) and restored into the
blocks vLLM gives it at the resume (:meth:`_resume`); any other preempted request is dropped and
restarts from its prompt. A failure while deciding or folding for one request (a policy
exception, non-finite statistics) is confined to it (:meth:`_fault`): its state is dropped and
the scheduler ends it with an error.

**Prefix caching.** The side caches are indexed by KV slot, so requests that hold the same cached
blocks (a hit) would share those slots' policy state. A request's hit is therefore read-only for
it (``DeviceDecider.share_prefix``): it writes the hit slots' logical positions (the values every
holder writes) but never their policy state, and the scheduler protects the hit from its eviction
(``protected_prefix``), so that state is never read for it either. The request that computed the
blocks owns their state and keeps writing it until its first eviction copies them into private
blocks (``copy_slots``). Tokens then equal the dense oracle with ``protected_prefix`` = the hit.
That is the rule for a policy that needs statistics of the prompt tokens the hit skips
(``EvictionPolicy.keeps_hit``: H2O, K-norm; SnapKV when fewer than its window of prompt tokens
follow the hit). Any other hit is copied
into private blocks in the step that starts the request (``WorkerSpec.shared_tokens`` = 0;
the copies are ``StepPayload.unshare`` and the new block ids are already in the step's
``SchedulerOutput``): the appended hit slots get fresh state as the request's own tokens, the
forward's statistics cover them, and its tokens equal the dense oracle's for it alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from vtoken.config import VTokenConfig
from vtoken.side_cache import DeviceDecider, side_bytes_per_token
from vtoken.integrations.vllm.protocol import ScoreMap, StepPayload, WorkerSpec
from vtoken.policies.base import AttentionNeed
from vtoken.integrations.vllm.worker.scoring import BatchedScores, set_means, set_means_batched

__all__ = ["WorkerEviction", "reserve_side_cache"]

logger = logging.getLogger("vllm.vtoken")


def num_sets(granularity: str, num_layers: int, num_kv_heads: int) -> int:
    """Token sets per request for ``granularity`` (``docs/granularity.md``)."""
    return {"request": 1, "layer": num_layers, "head": num_layers * num_kv_heads,
            "head_shared": num_kv_heads}[granularity]


def reserve_side_cache(vtoken_cfg: Optional[dict], kv_bytes_per_token: int, num_layers: int, num_kv_heads: int,
                       available: int, blocks_override: Optional[int] = None) -> int:
    """The KV cache's share of ``available`` bytes once the side cache of the engine's policy is
    counted against it (``docs/eviction.md``, "Memory").

    The side cache shadows every KV slot (``WorkerEviction``), so with ``s`` side-cache bytes
    and ``kv`` K/V bytes per token, ``available`` holds ``available / (kv + s)`` tokens of both:
    the KV cache gets ``available * kv // (kv + s)`` bytes. Reserved for the engine's own policy
    and granularity; a request that overrides them (``vtoken_policy``, ``vtoken_granularity``)
    adds its group's side cache on top, logged when it is made.

    Args:
        vtoken_cfg: ``additional_config["vtoken"]`` as the plugin normalised it (None: vToken off).
        kv_bytes_per_token: K/V bytes per token on this worker, all layers (vLLM's KV-cache specs).
        num_layers, num_kv_heads: this worker's attention layers and KV heads per layer.
        available: the bytes vLLM would give the KV cache.
        blocks_override: ``--num-gpu-blocks-override``: the pool size is fixed, so the side cache
            comes on top of it (logged), and ``available`` is returned unchanged.

    Returns:
        bytes for the KV cache (``available`` when nothing is reserved).
    """
    if not vtoken_cfg or kv_bytes_per_token <= 0:
        return available
    cfg = VTokenConfig(**vtoken_cfg)
    plan = cfg.plan()
    gran = plan.granularity
    side = side_bytes_per_token(plan.policy, num_sets(gran, num_layers, num_kv_heads))
    share = 100.0 * side / kv_bytes_per_token
    if blocks_override:
        logger.info("vToken: side cache of policy %s (granularity %s): %d bytes per token (%.2f%% of the KV "
                    "cache's %d); --num-gpu-blocks-override fixes the pool at %d blocks, so it comes on top",
                    cfg.policy, gran, side, share, kv_bytes_per_token, blocks_override)
        return available
    kv = available * kv_bytes_per_token // (kv_bytes_per_token + side)
    logger.info("vToken: side cache of policy %s (granularity %s): %d bytes per token (%.2f%% of the KV cache's %d); "
                "of the %d bytes for the KV cache, %d hold K/V and %d the side cache", cfg.policy, gran, side, share,
                kv_bytes_per_token, available, kv, available - kv)
    return kv


class _Names(Sequence):
    """The request ids ``keys[pos]`` (all of ``keys`` where ``pos`` is None), built only when
    read (a fault, a log line, a test's hook), with their ``counts`` (int64, same order): a
    step's rows of one group without a per-request Python list."""

    __slots__ = ("keys", "pos", "counts")

    def __init__(self, keys: list[str], pos: Optional[np.ndarray], counts: np.ndarray):
        self.keys, self.pos, self.counts = keys, pos, counts

    def __len__(self) -> int:
        return len(self.keys) if self.pos is None else len(self.pos)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.list()[i]
        return self.keys[i] if self.pos is None else self.keys[int(self.pos[i])]

    def __iter__(self):
        return iter(self.keys) if self.pos is None else (self.keys[i] for i in self.pos.tolist())

    def list(self) -> list[str]:
        return list(self.keys) if self.pos is None else [self.keys[i] for i in self.pos.tolist()]


class _Group:
    """The requests of one policy and granularity: a decider, request rows, and the block ids of
    each row."""

    def __init__(self, policy, granularity: str, sets: int, num_slots: int, block_size: int, device, gid: int = 0):
        self.policy = policy
        self.granularity = granularity
        self.gid = gid  #: index in ``WorkerEviction._glist`` (the high half of a request's code)
        self.dec = DeviceDecider(policy, num_slots, block_size, max_requests=16, device=device, num_sets=sets)
        self.free: list[int] = list(range(15, -1, -1))
        self.bt = np.zeros((16, 16), dtype=np.int64)  # row -> block ids (a prefix of nblocks[row])
        self.nblocks = np.zeros(16, dtype=np.int64)
        self.freed = np.zeros(16, dtype=np.int64)  # row -> Naive-Evict's freed blocks last reported
        #: host copies of the decider's per-row counts (live, logical, shared prefix), kept by the
        #: calls that change them, so that a step's widths and shapes need no host read; the
        #: live count is checked against the decider's in the one host read each eviction makes
        #: (``DeviceDecider.evict``'s ``expect_live``) and taken from it if they ever differ
        self.live_h = np.zeros(16, dtype=np.int64)
        self.logical_h = np.zeros(16, dtype=np.int64)
        self.shared_h = np.zeros(16, dtype=np.int64)
        #: per row, the request's protections (``WorkerSpec``): sinks, recent window, protected prefix
        self.prot_h = np.zeros((16, 3), dtype=np.int64)
        #: Expected Attention: per row the query moments (:meth:`add_moments`): float64
        #: ``qsum [rows, L, Hq, D]``, ``qpair [rows, L, Hq, D/2, 3]`` and int64 ``count [rows]``,
        #: made on the first fold (this rank's query heads)
        self.moments: Optional[list[torch.Tensor]] = None

    def add(self) -> int:
        if not self.free:
            n = self.bt.shape[0]
            self.dec.ensure_rows(2 * n)
            self.bt = np.concatenate([self.bt, np.zeros_like(self.bt)])
            self.nblocks = np.concatenate([self.nblocks, np.zeros_like(self.nblocks)])
            self.freed = np.concatenate([self.freed, np.zeros_like(self.freed)])
            self.live_h, self.logical_h, self.shared_h, self.prot_h = (
                np.concatenate([a, np.zeros_like(a)]) for a in (self.live_h, self.logical_h, self.shared_h, self.prot_h))
            if self.moments is not None:
                self.moments = [torch.cat([t, torch.zeros_like(t)]) for t in self.moments]
            self.free = list(range(2 * n - 1, n - 1, -1))
        row = self.free.pop()
        self.nblocks[row] = 0
        self.freed[row] = 0
        self.live_h[row] = self.logical_h[row] = self.shared_h[row] = 0
        self.prot_h[row] = 0
        if self.moments is not None:
            for t in self.moments:
                t[row] = 0
        self.dec.reset(torch.tensor([row], device=self.dec.live.device))
        return row

    def add_moments(self, rows: torch.Tensor, qsum: torch.Tensor, qpair: torch.Tensor, count: torch.Tensor) -> None:
        """Add a step's query moments (``StepScores.take_moments``) to rows ``rows`` (int64 ``[R]``)."""
        if self.moments is None:
            n = self.bt.shape[0]
            dev = self.dec.live.device
            self.moments = [torch.zeros(n, *qsum.shape[1:], dtype=torch.float64, device=dev),
                            torch.zeros(n, *qpair.shape[1:], dtype=torch.float64, device=dev),
                            torch.zeros(n, dtype=torch.int64, device=dev)]
            per_row = sum(t[0].numel() * t.element_size() for t in self.moments)
            logger.info("vToken: %s keeps query moments per request row: %d bytes (%.2f MiB; %d rows now, more "
                        "as requests arrive; outside the KV cache's memory)", self.policy.name, per_row,
                        per_row / 2**20, n)
        for t, x in zip(self.moments, (qsum, qpair, count)):
            t.index_add_(0, rows, x.to(t.device, t.dtype))

    def set_blocks(self, row: int, ids: list[int], append: bool) -> None:
        start = int(self.nblocks[row]) if append else 0
        end = start + len(ids)
        self._ensure_width(end)
        self.bt[row, start:end] = ids
        self.nblocks[row] = end

    def _ensure_width(self, width: int) -> None:
        if width > self.bt.shape[1]:
            grown = np.zeros((self.bt.shape[0], max(width, 2 * self.bt.shape[1])), dtype=np.int64)
            grown[:, : self.bt.shape[1]] = self.bt
            self.bt = grown

    def put_blocks(self, row: int, entries: list[tuple[int, int]]) -> None:
        """Block ``new`` at index ``i`` of ``row`` for each ``(i, new)`` (prefix caching's private
        copies); the table grows to hold an index past its width (a new group's table starts
        narrower than a long prompt's row)."""
        if entries:
            self._ensure_width(max(i for i, _ in entries) + 1)
            for i, new in entries:
                self.bt[row, i] = new

    def table(self, rows) -> torch.Tensor:
        """The block ids of ``rows`` (a list or int64 array), ``[R, table width]`` on the
        decider's device."""
        return torch.from_numpy(self.bt[rows]).to(self.dec.live.device)


class WorkerEviction:
    """The worker's side of the eviction: which tokens (module docstring).

    Args:
        num_blocks, block_size: the KV cache's pool (the side caches shadow every slot).
        device: the KV cache's device.
        kv_bytes: bytes of this worker's KV cache (all layers), for the side-cache log line.
        num_layers, num_kv_heads: this worker's attention layers and KV heads per layer (its own,
            under tensor parallelism): the token sets of ``layer``, ``head`` and ``head_shared``.

    Memory: each (policy, granularity) group's side cache holds ``bytes_per_token`` per KV slot
    (8 for the logical position, plus the policy's state: 8 for H2O or TOVA, ``window`` for
    Scissorhands; times the token sets per request),
    allocated on the first request of that policy and logged with its share of the KV cache. The
    engine's own policy's is counted against the KV cache's memory at start-up
    (:func:`reserve_side_cache`); a request's other policy or granularity comes on top.
    Expected Attention also keeps its query moments per request row (``_Group.moments``, logged
    when made), outside that reservation.
    """

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str, kv_bytes: int = 0,
                 num_layers: int = 1, num_kv_heads: int = 1):
        self.kv_bytes = int(kv_bytes)
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.block_size = int(block_size)
        self.num_slots = int(num_blocks) * self.block_size
        self.device = device
        self.groups: dict[str, _Group] = {}
        self.where: dict[str, tuple[_Group, int, WorkerSpec]] = {}  # req_id -> (group, row, spec)
        #: for a policy with ``eviction_keys`` (KeyDiff, Expected Attention): ``(policy,
        #: block_table [R, nblk], live [R], granularity, moments=, start=) -> float64
        #: [R, S, max live]``, the policy's statistic from the KV cache
        #: (``WorkerStep.eviction_key_stats``), read right before the group evicts
        self.key_reader: Optional[Callable[..., torch.Tensor]] = None
        #: the groups that evicted since :meth:`take_naive_freed` last ran (a step that schedules
        #: no token never samples, so its entries wait for the next): (group, rows, request
        #: ids, rows as a tensor), whose Naive-Evict counts :meth:`take_naive_freed` reads
        self._naive: list[tuple[_Group, np.ndarray, np.ndarray, list[str]]] = []
        #: req_id -> ``gid << 32 | row`` of every tracked request (``where`` as one integer, so that
        #: a step's requests map to their groups and rows in one vectorised pass, :meth:`_split`)
        self._code: dict[str, int] = {}
        self._glist: list[_Group] = []  # gid -> group
        #: faults confined to one request since the last output (:meth:`_fault`): req_id -> message
        self.faults: dict[str, str] = {}
        #: ``VTOKEN_CHECK=1``: every step's moves are checked before they are applied
        #: (:mod:`vtoken.integrations.vllm.worker.checks`); what the checks saw, for tests
        self._check = os.environ.get("VTOKEN_CHECK", "0") not in ("", "0")
        self.check_stats = {"moves_checked": 0, "freed_reused_same_step": 0}
        self._moved: list[tuple] = []  # (check_group_moves' arguments) per evicting group
        #: preempted requests whose state is kept: req_id -> (blocks saved, side-cache fields of
        #: those blocks' slots, name -> ``[S, blocks * B, *lead]``); their K/V is saved by the caller
        self.suspended: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        #: this step's ``(req_id, block ids)`` to save (:meth:`_suspend`) and to restore (:meth:`_resume`)
        self.suspending: list[tuple[str, torch.Tensor]] = []
        self.resuming: list[tuple[str, torch.Tensor]] = []

    @staticmethod
    def _key(spec: WorkerSpec) -> str:
        plan = spec.plan
        return f"{plan.granularity}:{dataclasses.replace(plan.policy, sink_tokens=0, recent_tokens=0)!r}"

    def granularity(self, rid: str) -> str:
        """The token-set granularity of a tracked request (``request`` for an unknown one)."""
        got = self.where.get(rid)
        return "request" if got is None else got[0].granularity

    def window(self, rid: str) -> Optional[int]:
        """The observation window of a tracked request's policy (SnapKV), or None."""
        got = self.where.get(rid)
        return None if got is None else getattr(got[2].plan.policy, "window", None)

    def bytes_per_token(self) -> int:
        """Side-cache bytes per KV slot over every policy group so far."""
        return sum(g.dec.side.bytes_per_token for g in self.groups.values())

    def _suspend(self, rids: list[str]) -> list[tuple[str, torch.Tensor]]:
        """Preempted requests whose state the scheduler keeps (``StepPayload.suspend``), after this
        step's eviction: save each one's side-cache state of the blocks holding its live slots
        (``cdiv(live, B)``, every set) and forget its blocks. Returns ``(req_id, block ids)``
        (int64 ``[cdiv(live, B)]``) whose K/V the caller saves (:meth:`WorkerStep.begin_step`),
        before any write of the step. One host read of the live count per preemption."""
        out = []
        for rid in rids:
            got = self.where.get(rid)
            if got is None:
                continue
            g, row, _ = got
            bs = self.block_size
            nb = -(-int(g.dec.live[row]) // bs)
            ids = torch.from_numpy(g.bt[row, :nb].copy()).to(g.dec.live.device)
            slots = (ids[:, None] * bs + torch.arange(bs, device=ids.device)).reshape(-1)
            self.suspended[rid] = (nb, {k: t.index_select(1, slots) for k, t in g.dec.side.fields.items()})
            g.nblocks[row] = 0
            out.append((rid, ids))
        return out

    def _resume(self, rid: str) -> tuple[str, torch.Tensor]:
        """A suspended request vLLM resumed in this step (its new block ids already taken): its
        saved side-cache state goes into its first blocks. Returns ``(req_id, block ids)`` whose
        K/V the caller restores before the forward. The blocks are its own now (a resume makes
        no prefix-cache lookup), so none of its slots is read-only any more."""
        nb, side = self.suspended.pop(rid)
        g, row, _ = self.where[rid]
        if int(g.nblocks[row]) < nb:
            raise RuntimeError(f"vToken: request {rid} resumed with {int(g.nblocks[row])} blocks; its live tokens "
                               f"need {nb}")
        bs = self.block_size
        ids = torch.from_numpy(g.bt[row, :nb].copy()).to(g.dec.live.device)
        slots = (ids[:, None] * bs + torch.arange(bs, device=ids.device)).reshape(-1)
        for k, v in side.items():
            g.dec.side.fields[k].index_copy_(1, slots, v)
        g.dec.shared[row] = 0
        g.shared_h[row] = 0
        return rid, ids

    def _drop(self, rid: str) -> None:
        self.suspended.pop(rid, None)
        self._code.pop(rid, None)
        got = self.where.pop(rid, None)
        if got is not None:
            got[0].free.append(got[1])

    def begin(self, scheduler_output: Any, payload: Optional[StepPayload]) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Everything before the step's forward (module docstring).

        Returns:
            per group that moved tokens: ``(granularity, src, dst, sets)``, int64 ``[M]`` global
            slot ids of the K/V moves and the token set of each (``docs/granularity.md``: which
            layers and KV heads a set's moves apply to).
        """
        if payload is None:
            payload = StepPayload()
        for rid in scheduler_output.finished_req_ids:
            self._drop(rid)
        keep = set(payload.suspend)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid not in keep:
                self._drop(rid)
        for rid, spec in payload.states.items():
            self._drop(rid)
            plan = spec.plan
            key = self._key(spec)
            g = self.groups.get(key)
            if g is None:
                sets = num_sets(plan.granularity, self.num_layers, self.num_kv_heads)
                g = self.groups[key] = _Group(plan.policy, plan.granularity, sets, self.num_slots, self.block_size,
                                              self.device, gid=len(self._glist))
                self._glist.append(g)
                b = g.dec.side.bytes_per_token
                args = {f.name: getattr(plan.policy, f.name) for f in dataclasses.fields(plan.policy)
                        if f.name not in ("sink_tokens", "recent_tokens")}
                logger.info("vToken: worker-side decisions for policy %s %s, granularity %s (%d token sets per "
                            "request; sinks and recent window per request): side cache %d bytes per token, %.1f MiB "
                            "(%.2f%% of the KV cache)", plan.policy.name, args, plan.granularity, sets,
                            b, b * self.num_slots / 2**20,
                            100.0 * b * self.num_slots / self.kv_bytes if self.kv_bytes else float("nan"))
            row = g.add()
            self.where[rid] = (g, row, spec)
            self._code[rid] = (g.gid << 32) | row
            g.prot_h[row] = (plan.sink_tokens, plan.recent_tokens, spec.protected_prefix)
            shared = spec.cached_tokens if spec.shared_tokens is None else spec.shared_tokens
            if shared:  # a prefix-cache hit: blocks others hold and write (module docstring)
                g.dec.share_prefix(torch.tensor([row], device=g.dec.live.device), shared)
                g.shared_h[row] = shared
        for rid, entries in payload.unshare.items():  # (copied by the caller before this)
            got = self.where.get(rid)
            if got is not None:
                got[0].put_blocks(got[1], [(i, new) for i, _, new in entries])
        moves = self._evict(payload.evict) if payload.evict else []
        self.suspending = self._suspend(payload.suspend) if payload.suspend else []
        for rid, keep in payload.truncate.items():
            got = self.where.get(rid)
            if got is not None:
                got[0].nblocks[got[1]] = min(keep, int(got[0].nblocks[got[1]]))
        self._take_block_ids(scheduler_output)
        if self._check and self._moved:
            self._check_step(scheduler_output, payload)
        self.resuming = []
        if self.suspended:  # (Model Runner V2 gets a resumed request as a new one, V1 as a cached one)
            resumed = [nr.req_id for nr in scheduler_output.scheduled_new_reqs]
            resumed += scheduler_output.scheduled_cached_reqs.resumed_req_ids
            self.resuming = [self._resume(rid) for rid in resumed if rid in self.suspended]
        counts = dict(scheduler_output.num_scheduled_tokens)
        for rid, spec in payload.states.items():  # a prefix-cache hit: its cached tokens first
            if spec.cached_tokens:
                counts[rid] = counts.get(rid, 0) + spec.cached_tokens
        self._append(counts)
        return moves

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every group's side-cache state (every token set) of global slots ``src`` to ``dst``
        (int64 ``[M]``; prefix caching's block copies, ``WorkerStep.copy_blocks``)."""
        for g in self.groups.values():
            g.dec.side.move(src.to(g.dec.live.device), dst.to(g.dec.live.device))

    def _by_group(self, rids) -> dict[int, tuple[_Group, list[int], list[str]]]:
        out: dict[int, tuple[_Group, list[int], list[str]]] = {}
        for rid in rids:
            got = self.where.get(rid)
            if got is None:
                continue
            g, row, _ = got
            e = out.setdefault(id(g), (g, [], []))
            e[1].append(row)
            e[2].append(rid)
        return out

    def _codes(self, rids: Iterable[str], n: int) -> np.ndarray:
        """int64 ``[n]``: each request's ``gid << 32 | row`` (-1: not tracked), in one C-level pass."""
        return np.fromiter(map(self._code.get, rids, itertools.repeat(-1)), dtype=np.int64, count=n)

    def _split(self, codes: np.ndarray) -> list[tuple[_Group, Optional[np.ndarray], np.ndarray]]:
        """The tracked entries of ``codes`` (:meth:`_codes`) by group, in input order within each:
        ``(group, positions in codes or None for all of them, rows)``. Loops over groups only."""
        if not len(codes):
            return []
        if len(self._glist) == 1:  # one group: a request's code is its row
            if codes.min() >= 0:
                return [(self._glist[0], None, codes)]
            pos = np.flatnonzero(codes >= 0)
            return [(self._glist[0], pos, codes[pos])] if len(pos) else []
        gids = codes >> 32  # (-1 stays -1)
        rows = codes & 0xFFFFFFFF
        lo, hi = int(gids.min()), int(gids.max())
        if lo == hi:
            return [] if lo < 0 else [(self._glist[lo], None, rows)]
        out = []
        for gid in np.unique(gids).tolist():
            if gid >= 0:
                pos = np.flatnonzero(gids == gid)
                out.append((self._glist[gid], pos, rows[pos]))
        return out

    @staticmethod
    def _pick(keys: list[str], pos: Optional[np.ndarray]) -> list[str]:
        return list(keys) if pos is None else [keys[i] for i in pos.tolist()]

    def _evict(self, evict: dict[str, int]) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every evicting group at once (:meth:`_evict_rows`). A group whose batched call raises is
        retried one request at a time, and each request that still raises is a fault confined to
        it (:meth:`_fault`): the others evict as planned. (Selection raises before it changes any
        state, so a retry starts from the same state.)"""
        out = []
        keys = list(evict)
        ks = np.fromiter(evict.values(), dtype=np.int64, count=len(keys))
        for g, pos, rows in self._split(self._codes(keys, len(keys))):
            names = _Names(keys, pos, ks if pos is None else ks[pos])
            try:
                out.append(self._evict_rows(g, rows, names, evict))
            except Exception as e:  # noqa: BLE001 - confined below, per request
                rids = names.list()
                if len(rows) == 1:
                    self._fault(rids[0], e)
                    continue
                for i, rid in enumerate(rids):
                    try:
                        out.append(self._evict_rows(g, rows[i:i + 1], _Names([rid], None, names.counts[i:i + 1]),
                                                    evict))
                    except Exception as e1:  # noqa: BLE001 - confined to this request
                        self._fault(rid, e1)
        return out

    def _fault(self, rid: str, exc: BaseException) -> None:
        """A failure while deciding or folding for request ``rid`` alone: its state is dropped
        here and the fault goes to the scheduler with the step's output (:attr:`faults`), which
        ends the request with an error; every other request goes on. Deterministic, so under
        tensor parallelism every rank drops the same request."""
        self.faults[rid] = f"{type(exc).__name__}: {exc}"
        self._drop(rid)

    def take_faults(self) -> Optional[dict[str, str]]:
        """The faults since the last call (req_id -> message), or None."""
        if not self.faults:
            return None
        out, self.faults = self.faults, {}
        return out

    def _evict_rows(self, g: "_Group", rows, rids: Sequence[str], evict: dict[str, int]
                    ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One group's eviction: request rows ``rows`` (int64 array or list) of requests ``rids``
        (a :class:`_Names`, whose counts are theirs in ``evict``, or any sequence of ids)."""
        rows = np.asarray(rows, dtype=np.int64)
        k = rids.counts if isinstance(rids, _Names) else np.array([evict[r] for r in rids], dtype=np.int64)
        dev = g.dec.live.device
        rows_t = torch.from_numpy(rows).to(dev)
        table = g.table(rows)
        if g.policy.eviction_keys:
            if self.key_reader is None:
                raise RuntimeError(f"vToken: policy {g.policy.name!r} reads the cached keys at eviction, "
                                   "but this worker has no key reader")
            extra = {}
            if g.policy.needs & AttentionNeed.QUERY_MOMENTS:
                if g.moments is None:  # no forward yet (cannot happen: a request evicts after one)
                    raise RuntimeError(f"vToken: policy {g.policy.name!r} evicts before any query was seen")
                extra = dict(moments=tuple(t[rows_t] for t in g.moments), start=g.dec.logical[rows_t])
            g.dec.observe(rows_t, table, None, None,
                          key_sim=self.key_reader(g.policy, table, g.dec.live[rows_t], g.granularity, **extra))

        prot = g.prot_h[rows]
        same = (prot == prot[0]).all(axis=0).tolist()

        def per_request(i: int):  # one int when every request has the same (no [R] tensor ops)
            return int(prot[0, i]) if same[i] else torch.from_numpy(prot[:, i].copy()).to(dev)

        live = g.live_h[rows]
        width = int(live.max())
        expect = np.maximum(live - np.maximum(k, 0), 0)
        ev = g.dec.evict(rows_t, table, torch.from_numpy(k).to(dev),
                         sink_tokens=per_request(0), recent_tokens=per_request(1), protected_prefix=per_request(2),
                         width=width, max_evict=max(int(k.max()), 0), expect_live=torch.from_numpy(expect).to(dev),
                         dead_width=-(-int(g.logical_h[rows].max()) // g.dec.block_size),
                         full=bool((live == width).all()))
        if self._check:  # (checked in begin, outside _evict's fault confinement)
            self._moved.append((rids.list() if isinstance(rids, _Names) else list(rids), rows, g.bt[rows].copy(),
                                g.dec.block_size, live, g.shared_h[rows].copy(), ev))
        if ev.live_as_expected:
            g.live_h[rows] = expect
        else:  # (cannot happen while the scheduler's counts are the worker's: one host read)
            g.live_h[rows] = ev.new_live.cpu().numpy()
        self._naive.append((g, rows, (g.gid << 32) | rows, rids.list() if isinstance(rids, _Names) else list(rids)))
        return g.granularity, ev.src, ev.dst, ev.sets

    def _check_step(self, scheduler_output: Any, payload: StepPayload) -> None:
        """``VTOKEN_CHECK=1``: the step's moves against every request's blocks after the step's
        truncation and block assignment (:func:`~vtoken.integrations.vllm.worker.checks.check_step_blocks`)."""
        from vtoken.integrations.vllm.worker.checks import check_group_moves, check_step_blocks, new_blocks_of_step
        held = {rid: set(g.bt[row, : int(g.nblocks[row])].tolist()) for rid, (g, row, _) in self.where.items()}
        moved = [m for args in self._moved for m in check_group_moves(*args)]
        self._moved = []
        copies = {new: rid for rid, entries in payload.unshare.items() for _, _, new in entries}
        self.check_stats["freed_reused_same_step"] += check_step_blocks(
            moved, held, new_blocks_of_step(scheduler_output), frozenset(payload.suspend), copies)
        self.check_stats["moves_checked"] += len(moved)

    def take_naive_freed(self, tp_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                         tp_world: int = 1) -> Optional[dict[str, int]]:
        """Naive-Evict's freed blocks (``DeviceDecider.naive_freed_blocks``) of every request
        whose count changed in this step's eviction, or None: the one figure the worker returns
        to the scheduler (``ModelRunnerOutput.vtoken_naive_freed``), which gives the
        ``vtoken:naive_retained_blocks`` gauge and, under ``mode: naive``, the blocks it keeps.
        Called after the forward (one host read of ``[R]`` integers per evicting group).

        Args:
            tp_sum, tp_world: under tensor parallelism with ``head`` or ``head_shared`` sets each
                rank holds the sets of its own KV heads, so a block is freed once it is dead on
                every rank. Each rank's 0/1 "dead in all my sets" flags (int32
                ``[R, cdiv(max logical, B)]``, :meth:`DeviceDecider.dead_blocks`) are summed over
                the TP group with ``tp_sum`` and compared with ``tp_world``. Every rank calls it
                in the same order, since the evicting groups and rows come from the same payloads
                (a group whose rows were all dropped since still takes part, with zero rows).
                Other granularities hold the same sets on every rank.
        """
        if not self._naive:
            return None
        out: dict[str, int] = {}
        pending, self._naive = self._naive, []
        for g, rows, codes, rids in pending:
            # (a request dropped or restarted since keeps no claim on its old row)
            same = self._codes(rids, len(rids)) == codes
            if not same.all():
                if not same.any() and tp_world == 1:
                    continue
                keep = np.flatnonzero(same)
                rows, rids = rows[keep], [rids[i] for i in keep.tolist()]
            dec = g.dec
            rows_t = torch.from_numpy(rows).to(dec.live.device)
            if tp_world > 1 and g.granularity in ("head", "head_shared"):
                # per block: 1 where this rank's sets evicted it whole; freed where every rank did
                # (int32 [R, cdiv(max logical, B)]; a rank's width may differ, so from logical)
                width = -(-int(dec.logical[rows_t].max()) // dec.block_size) if len(rows) else 0
                have = min(width, dec.dead.shape[1])
                whole = torch.zeros((len(rows), width), dtype=torch.int32)
                whole[:, :have] = dec.dead_blocks(rows_t)[:, :have].cpu().to(torch.int32)
                whole = tp_sum(whole)
                got = (whole == tp_world).sum(1).numpy()
            else:
                got = dec.naive_freed_blocks(rows_t).cpu().numpy()
            changed = np.flatnonzero(got != g.freed[rows])
            if len(changed):
                g.freed[rows[changed]] = got[changed]
                out.update((rids[i], int(got[i])) for i in changed.tolist())
        return out or None

    def _take_block_ids(self, so: Any) -> None:
        for nr in so.scheduled_new_reqs:
            got = self.where.get(nr.req_id)
            if got is not None:
                got[0].set_blocks(got[1], list(nr.block_ids[0]), append=False)
        cr = so.scheduled_cached_reqs
        resumed = cr.resumed_req_ids
        # (only the requests with new blocks: None where a request got none)
        for rid, ids in itertools.compress(zip(cr.req_ids, cr.new_block_ids), cr.new_block_ids):
            got = self.where.get(rid)
            if got is None:
                continue
            got[0].set_blocks(got[1], list(ids[0]), append=rid not in resumed)

    def _append(self, num_scheduled: dict[str, int]) -> None:
        keys = list(num_scheduled)
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=len(keys))
        for g, pos, rows in self._split(self._codes(keys, len(keys))):
            c = counts if pos is None else counts[pos]
            n_max = int(c.max())
            dev = g.dec.live.device
            g.dec.append(torch.from_numpy(rows).to(dev), g.table(rows), torch.from_numpy(c).to(dev), n_max=n_max,
                         uniform=bool((c == n_max).all()), no_shared=not g.shared_h[rows].any())
            g.live_h[rows] += c
            g.logical_h[rows] += c

    def fold_moments(self, rids: list[str], qsum: torch.Tensor, qpair: torch.Tensor, count: torch.Tensor) -> None:
        """Add a step's query moments (``StepScores.take_moments``, rows in ``rids`` order) to
        their requests' rows (Expected Attention); requests no longer tracked are skipped."""
        if not rids or qsum.numel() == 0:
            return
        index = {rid: i for i, rid in enumerate(rids)}
        for g, rows, grids in self._by_group(rids).values():
            sel = torch.tensor([index[r] for r in grids])
            g.add_moments(torch.tensor(rows, device=g.dec.live.device), qsum[sel], qpair[sel], count[sel])

    def written_only(self, rids: Iterable[str], tp: bool) -> set[str]:
        """The requests among ``rids`` whose step statistics :meth:`write_key_norms` folds (their
        policy ``observes_written_only``); under tensor parallelism (``tp``) only those with
        ``head`` or ``head_shared`` sets, which are each rank's own (``layer`` and ``request``
        sets sum their ranks' norms first, through ``StepScores.result``)."""
        out = set()
        for rid in rids:
            got = self.where.get(rid)
            if got is not None and got[0].policy.observes_written_only and (
                    not tp or got[0].granularity in ("head", "head_shared")):
                out.add(rid)
        return out

    def write_key_norms(self, rows: list[tuple[str, int, int, int]], norms: torch.Tensor) -> None:
        """Fold a step's key norms into the slots it wrote (``DeviceDecider.observe_written``),
        every request of a group at once.

        Args:
            rows: ``(req_id, n, qs, qe)``: the request's physical length after the step and its
                tokens' range in the batch (its last ``qe - qs`` slots were written).
            norms: float64 ``[L, num_tokens, Hkv]``: every layer's key norms, batch order
                (``StepScores.take_key_norms``). A set takes the mean of its (layer, KV head)
                pairs (``docs/granularity.md``), in the order ``StepScores.result`` reduces them.
        """
        info = {r[0]: r for r in rows}
        for g, grows, rids in self._by_group(info).values():
            dev = g.dec.live.device
            n, qs, qe = (torch.tensor([info[r][i] for r in rids], dtype=torch.int64) for i in (1, 2, 3))
            ql = qe - qs
            seg = torch.repeat_interleave(torch.arange(len(rids)), ql)  # [T]: each token's request
            j = torch.arange(int(ql.sum())) - (torch.cumsum(ql, 0) - ql)[seg]
            rel = (n - ql)[seg] + j  # request-relative slot
            bs = g.dec.block_size
            table = g.table(grows)
            slots = table[seg.to(dev), (rel // bs).to(dev)] * bs + (rel % bs).to(dev)
            t = norms[:, (qs[seg] + j).to(norms.device), :].permute(0, 2, 1).contiguous()  # [L, Hkv, T]
            g.dec.observe_written(slots, set_means(g.granularity, t).to(dev))

    def fold(self, scores: "Optional[ScoreMap | BatchedScores]") -> None:
        """Fold the step's statistics into the side caches: a ``ScoreMap`` (req_id -> (col_sum,
        last_row), float64 ``[live]``, or ``[S, live]`` with several token sets) or
        :class:`~vtoken.integrations.vllm.worker.scoring.BatchedScores` (``StepScores.batched``:
        the one-query rows as padded tensors, one ``observe`` per group; the rest as a
        ``ScoreMap``); rows with and without a last row (a non-final prefill chunk) apart."""
        if isinstance(scores, BatchedScores):
            rest = dict(scores.rest)
            if len(scores.rids):
                self._fold_batched(scores, rest)
            scores = rest
        if not scores:
            return
        for g, rows, rids in self._by_group(scores).values():
            use_col = bool(g.policy.needs & AttentionNeed.COL_SUM)
            use_last = bool(g.policy.needs & AttentionNeed.LAST_ROW)
            use_kn = bool(g.policy.needs & AttentionNeed.KEY_NORM)
            parts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
            for row, rid in zip(rows, rids):
                parts[use_last and scores[rid][1] is not None].append((row, rid))
            for with_last, part in parts.items():
                if not part or not (use_col or with_last or use_kn):
                    continue
                width = max(next(a for a in scores[rid] if a is not None).shape[-1] for _, rid in part)
                lead = (g.dec.num_sets,) if g.dec.num_sets > 1 else ()
                col = np.zeros((len(part), *lead, width)) if use_col else None
                last = np.zeros((len(part), *lead, width)) if with_last else None
                kn = np.full((len(part), *lead, width), np.nan) if use_kn else None
                for i, (_, rid) in enumerate(part):
                    c, lr = scores[rid][:2]
                    if col is not None:
                        col[i, ..., : c.shape[-1]] = c
                    if last is not None:
                        last[i, ..., : lr.shape[-1]] = lr
                    if kn is not None and len(scores[rid]) > 2 and scores[rid][2] is not None:
                        kn[i, ..., : scores[rid][2].shape[-1]] = scores[rid][2]
                # non-finite statistics are a fault confined to their request (never folded in)
                bad = np.zeros(len(part), dtype=bool)
                for a in (col, last):
                    if a is not None:
                        bad |= ~np.isfinite(a.reshape(len(part), -1)).all(1)
                if bad.any():
                    for i in np.flatnonzero(bad).tolist():
                        self._fault(part[i][1], FloatingPointError(
                            "non-finite attention statistics (NaN or infinity) from this step's forward"))
                    ok = ~bad
                    part = [p for p, k in zip(part, ok.tolist()) if k]
                    col, last, kn = (None if a is None else a[ok] for a in (col, last, kn))
                    if not part:
                        continue
                dev = g.dec.live.device
                prow = [row for row, _ in part]
                g.dec.observe(torch.tensor(prow, device=dev), g.table(prow),
                              None if col is None else torch.from_numpy(col).to(dev),
                              None if last is None else torch.from_numpy(last).to(dev),
                              None if kn is None else torch.from_numpy(kn).to(dev),
                              no_shared=not g.shared_h[prow].any())

    def _fold_batched(self, sc: BatchedScores, rest: dict) -> None:
        """:meth:`fold`'s one-query rows, every group in one ``observe`` per part (rows with and
        without a last row), from the padded tensors: the same values :meth:`fold` packs from a
        ``ScoreMap``. A group whose policy needs key norms takes the ``ScoreMap`` path (``rest``)."""
        R = len(sc.rids)
        col_flag, last_flag = AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value
        for g, pos, rows in self._split(self._codes(sc.rids, R)):
            gran = g.granularity
            src = sc.acc if gran == "request" else sc.per_head
            if g.policy.needs & AttentionNeed.KEY_NORM or src is None:
                rest.update(sc.legacy(range(R) if pos is None else pos.tolist()))
                continue
            use_col = bool(g.policy.needs & AttentionNeed.COL_SUM)
            use_last = bool(g.policy.needs & AttentionNeed.LAST_ROW)
            need = sc.need if pos is None else sc.need[pos]
            if use_col and not ((need & col_flag) != 0).all():  # (as the ScoreMap path: each row has its column sums)
                rest.update(sc.legacy(range(R) if pos is None else pos.tolist()))
                continue
            with_last_rows = (need & last_flag) != 0 if use_last else np.zeros(len(rows), dtype=bool)
            for with_last in (True, False):
                sel = np.flatnonzero(with_last_rows == with_last)
                if not len(sel) or not (use_col or with_last):
                    continue
                at = sel if pos is None else pos[sel]  # positions in the batch's one-query rows
                if len(at) == R and pos is None:
                    at = None  # (every row, in order: no gather)
                prow = rows[sel]
                n = sc.n if at is None else sc.n[at]
                width = int(n.max())
                dev = g.dec.live.device
                x = src if at is None else src[torch.from_numpy(at).to(src.device)]
                stat = (x if gran == "request" else set_means_batched(gran, x))[..., :width].to(dev)
                # non-finite statistics are a fault confined to their request (never folded in);
                # padding is 0 (or non-finite only where the row is). Probabilities: their sum is
                # finite exactly when every one is (one host read; the rows only where it is not)
                if not math.isfinite(float(stat.sum())):
                    bad_np = (~torch.isfinite(stat).reshape(stat.shape[0], -1).all(1)).cpu().numpy()
                    names = self._pick(sc.rids, at)
                    for i in np.flatnonzero(bad_np).tolist():
                        self._fault(names[i], FloatingPointError(
                            "non-finite attention statistics (NaN or infinity) from this step's forward"))
                    ok = np.flatnonzero(~bad_np)
                    if not len(ok):
                        continue
                    stat, prow, n = stat[torch.from_numpy(ok).to(dev)], prow[ok], n[ok]
                g.dec.observe(torch.from_numpy(prow).to(dev), g.table(prow), stat if use_col else None,
                              stat if with_last else None, None, no_shared=not g.shared_h[prow].any(),
                              full=bool((g.live_h[prow] == stat.shape[-1]).all()))
