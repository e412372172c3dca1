"""Per-request numpy forms of vToken's eviction policies: the independent reference the dense
oracle (:mod:`reference.oracle`) and the policy tests decide with.

vToken itself has one form of each policy, its batched score on the device
(:class:`vtoken.policies.base.EvictionPolicy`: ``side_specs``, ``observe_batched``,
``score_batched``). This module writes each built-in policy a second time, one request at a
time, in numpy and in the paper's terms, so the engine's batched selection can be checked
against something it does not share code with.

A policy sees one request through arrays indexed by **physical slot** ``0..num_live-1``.
Per-slot state (accumulated scores, history) lives in a :class:`SlotState` that moves with the
tokens when the repack moves them (``apply_moves``) or when the oracle compacts its cache
(``compact``). Decisions never depend on the slot order: protections are defined on logical
positions, and ties in the score go to the smaller logical position (evicted first), so vToken
(permuted slots), Naive-Evict and the oracle (logical order) decide alike on equal scores.

Statistics (:class:`AttentionStats`) are float64 ``[num_live]`` by slot, from the post-softmax
probabilities averaged over the token set's layers and query heads (``docs/granularity.md``):

* ``col_sum``: over the step's query rows, each key's summed probability (H2O);
* ``last_row``: the last query row of a step that samples a token (TOVA, Scissorhands);
* ``key_norm`` / ``key_sim``: key-only statistics (K-norm; KeyDiff, Expected Attention).

A slot the step does not cover holds ``NaN``; ``observe`` leaves such slots untouched.

:func:`reference` picks a policy's form: the one registered here for its class (or a parent
class it does not override), else the policy's own numpy ``observe``/``score`` if it has them
(a test-local policy), else :class:`Batched`, which runs the policy's batched form on one row
(a policy added as one file under ``vtoken/policies/`` with no reference written here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from vtoken.policies.base import AttentionNeed, EvictionPolicy
from vtoken.policies.expected_attention import ExpectedAttentionPolicy
from vtoken.policies.h2o import H2OPolicy
from vtoken.policies.keydiff import KeyDiffPolicy
from vtoken.policies.knorm import KNormPolicy, round_norm
from vtoken.policies.random import RandomPolicy
from vtoken.policies.scissorhands import ScissorhandsPolicy
from vtoken.policies.snapkv import SnapKVPolicy, pool_logical
from vtoken.policies.streaming import StreamingLLMPolicy
from vtoken.policies.tova import TOVAPolicy

__all__ = ["AttentionStats", "SlotState", "TokenView", "Reference", "Batched", "reference", "position_hash"]


@dataclass
class AttentionStats:
    """One step's statistics for one request (module docstring); each float64 ``[num_keys]`` or None.

    ``num_keys``: the keys the step attended over, when it differs from the arrays' length.
    """

    col_sum: Optional[np.ndarray] = None
    last_row: Optional[np.ndarray] = None
    num_keys: Optional[int] = None
    key_norm: Optional[np.ndarray] = None
    key_sim: Optional[np.ndarray] = None


class SlotState:
    """Per-slot arrays of one request's policy state; the last axis is the physical slot.

    Arrays grow on demand (capacity doubles); values of slots ``>= num_live`` are undefined;
    ``reset_slots`` zeroes a range before new tokens use it. ``extra`` holds per-request scalars.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], Any]], capacity: int = 64):
        self._specs = {k: (tuple(lead), np.dtype(dt)) for k, (lead, dt) in specs.items()}
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}
        self.extra: dict[str, Any] = {}
        self.ensure_capacity(capacity)

    def ensure_capacity(self, n: int) -> None:
        """Make room for slots ``0..n-1``."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity, 16)
        for k, (lead, dt) in self._specs.items():
            new = np.zeros(lead + (cap,), dtype=dt)
            if k in self.arrays:
                new[..., : self.capacity] = self.arrays[k]
            self.arrays[k] = new
        self.capacity = cap

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def reset_slots(self, start: int, stop: int) -> None:
        """Zero slots ``[start, stop)`` in every array (new tokens start with no history)."""
        self.ensure_capacity(stop)
        for a in self.arrays.values():
            a[..., start:stop] = 0

    def apply_moves(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy each array's ``src`` slots (int64 ``[m]``) to ``dst`` slots (gather, then scatter)."""
        if len(src) == 0:
            return
        for a in self.arrays.values():
            a[..., dst] = a[..., src]

    def compact(self, keep: np.ndarray) -> None:
        """Keep slots ``keep`` (int64 ``[k]``, ascending, or a permutation of ``0..k-1``) as ``0..k-1``."""
        k = len(keep)
        for a in self.arrays.values():
            a[..., :k] = a[..., keep]


@dataclass
class TokenView:
    """What a policy sees of one request when it selects victims.

    Attributes:
        logical_pos: int64 ``[num_live]``: the logical position of each slot's token.
        num_logical: tokens ever appended (prompt + generated whose KV is cached).
        prompt_len: prompt tokens.
        protected_prefix: the first logical positions never evicted (a prefix-cache hit); 0: none.
    """

    logical_pos: np.ndarray
    num_logical: int
    prompt_len: int
    protected_prefix: int = 0

    @property
    def num_live(self) -> int:
        return int(self.logical_pos.shape[0])


def _row(x: Optional[np.ndarray], name: str, what: str, num_live: int) -> Optional[np.ndarray]:
    if x is None:
        return None
    row = np.asarray(x, dtype=np.float64)
    if row.shape != (num_live,):
        raise ValueError(f"{name}: {what} has shape {row.shape}; expected ({num_live},)")
    return row


class Reference:
    """A policy's per-request form; every other attribute (``name``, ``needs``, ``window``, the
    protections) is the wrapped policy's."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy

    def __getattr__(self, attr: str):
        return getattr(self.policy, attr)

    def state_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {}

    def init_state(self) -> SlotState:
        return SlotState(self.state_specs())

    def observe(self, state: SlotState, num_live: int, stats: AttentionStats, view: TokenView) -> None:
        """Fold one step's statistics (``num_live``: live slots after the step; written slots zeroed)."""

    def score(self, state: SlotState, view: TokenView) -> np.ndarray:
        """Keep-score per slot, float64 ``[num_live]``; higher = keep."""
        raise NotImplementedError

    def protected_mask(self, view: TokenView) -> np.ndarray:
        """bool ``[num_live]``: sinks, the ``recent_tokens`` newest live tokens, the protected prefix."""
        pos, p = view.logical_pos, self.policy
        prot = pos < max(p.sink_tokens, view.protected_prefix)
        if p.recent_tokens > 0:
            n = view.num_live
            if p.recent_tokens >= n:
                prot[:] = True
            else:
                prot |= pos >= np.partition(pos, n - p.recent_tokens)[n - p.recent_tokens]
        return prot

    def select_victims(self, state: SlotState, view: TokenView, num_to_evict: int) -> np.ndarray:
        """Slots to evict, int64 ascending: the unprotected ones with the lowest score, ties to the
        smaller logical position; all unprotected ones when fewer remain."""
        if num_to_evict <= 0:
            return np.zeros(0, dtype=np.int64)
        scores = np.asarray(self.score(state, view), dtype=np.float64)
        assert scores.shape == (view.num_live,), (scores.shape, view.num_live)
        cand = np.flatnonzero(~self.protected_mask(view))
        order = np.lexsort((view.logical_pos[cand], scores[cand]))
        return np.sort(cand[order[:num_to_evict]]).astype(np.int64)


_REFS: dict[type, type[Reference]] = {}
_BATCHED_API = ("side_specs", "request_specs", "observe_batched", "score_batched")


def _for(cls: type[EvictionPolicy]) -> Callable[[type[Reference]], type[Reference]]:
    def register(ref_cls: type[Reference]) -> type[Reference]:
        _REFS[cls] = ref_cls
        return ref_cls
    return register


@_for(H2OPolicy)
class _H2O(Reference):
    """H2O (arXiv 2306.14048, Sec. 3-4): the accumulated column sums."""

    def state_specs(self):
        return {"acc": ((), np.float64)}

    def observe(self, state, num_live, stats, view):
        col = _row(stats.col_sum, "h2o", "col_sum", num_live)
        if col is not None:
            state.ensure_capacity(num_live)
            state["acc"][:num_live] += np.nan_to_num(col, nan=0.0)

    def score(self, state, view):
        return state["acc"][: view.num_live].copy()


@_for(TOVAPolicy)
class _TOVA(Reference):
    """TOVA (arXiv 2401.06104, Sec. 3): the last row's probabilities."""

    def state_specs(self):
        return {"last": ((), np.float64)}

    def observe(self, state, num_live, stats, view):
        row = _row(stats.last_row, "tova", "last_row", num_live)
        if row is not None:
            state.ensure_capacity(num_live)
            covered = ~np.isnan(row)
            state["last"][:num_live][covered] = row[covered]

    def score(self, state, view):
        return state["last"][: view.num_live].copy()


@_for(ScissorhandsPolicy)
class _Scissorhands(Reference):
    """Scissorhands (arXiv 2305.17118, Alg. 1): steps of the last ``window`` where a slot's last-row
    probability was below uniform (``1 / keys attended``); more = evicted first."""

    def state_specs(self):
        return {"hist": ((self.policy.window,), np.bool_)}

    def init_state(self):
        state = super().init_state()
        state.extra["ring"] = 0
        return state

    def observe(self, state, num_live, stats, view):
        row = _row(stats.last_row, "scissorhands", "last_row", num_live)
        if row is None or num_live <= 0:
            return
        state.ensure_capacity(num_live)
        w = self.policy.window
        r = int(state.extra["ring"]) % w
        state["hist"][r, :] = False
        state["hist"][r, :num_live] = row < 1.0 / (stats.num_keys or num_live)  # NaN compares False
        state.extra["ring"] = (r + 1) % w

    def counts(self, state, view):
        """int64 ``[num_live]``: steps in the window where each slot was below uniform."""
        return state["hist"][:, : view.num_live].sum(axis=0, dtype=np.int64)

    def score(self, state, view):
        return -self.counts(state, view).astype(np.float64)


_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def position_hash(seed: int, positions: np.ndarray) -> np.ndarray:
    """float64 in ``[0, 1)`` per logical position: SplitMix64 of (seed, position), top 53 bits
    (the numpy twin of :func:`vtoken.policies.random.position_hash_torch`, written separately)."""
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(np.array([int(seed) & _MASK64], dtype=np.uint64))[0]
        z = _mix64(key + (pos + np.uint64(1)) * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@_for(RandomPolicy)
class _Random(Reference):
    """Random: a seeded hash of the logical position."""

    def score(self, state, view):
        return position_hash(self.policy.seed, view.logical_pos)


@_for(StreamingLLMPolicy)
class _Streaming(Reference):
    """StreamingLLM (arXiv 2309.17453): the sinks and the recent window (its protections); the
    oldest go first."""

    def score(self, state, view):
        return view.logical_pos.astype(np.float64)


@_for(KNormPolicy)
class _KNorm(Reference):
    """K-norm (arXiv 2406.11430): keep the smallest key norms, rounded as the policy rounds."""

    def state_specs(self):
        return {"norm": ((), np.float64)}

    def observe(self, state, num_live, stats, view):
        row = _row(stats.key_norm, "knorm", "key_norm", num_live)
        if row is not None:
            state.ensure_capacity(num_live)
            written = ~np.isnan(row)
            state["norm"][:num_live][written] = round_norm(torch.from_numpy(row[written])).numpy()

    def score(self, state, view):
        return -state["norm"][: view.num_live]


class _KeyScore(Reference):
    """A score computed from the cached keys right before each eviction (``key_sim``)."""

    field, fill, sign = "sim", np.inf, -1.0

    def state_specs(self):
        return {self.field: ((), np.float64)}

    def observe(self, state, num_live, stats, view):
        row = _row(stats.key_sim, self.policy.name, "key_sim", num_live)
        if row is not None:
            state.ensure_capacity(num_live)
            state[self.field][:num_live] = np.nan_to_num(row, nan=self.fill)

    def score(self, state, view):
        return self.sign * state[self.field][: view.num_live]


@_for(KeyDiffPolicy)
class _KeyDiff(_KeyScore):
    """KeyDiff (arXiv 2504.15364): the keys least similar to their head's anchor stay."""


@_for(ExpectedAttentionPolicy)
class _ExpectedAttention(_KeyScore):
    """Expected Attention (arXiv 2510.00636): the expected attention of future queries."""

    field, fill, sign = "ea", -np.inf, 1.0


@_for(SnapKVPolicy)
class _SnapKV(Reference):
    """SnapKV (arXiv 2404.14469, Sec. 4): the observation window's column sums, pooled in logical
    order; a window cut over several steps is pooled once, with the step that ends it."""

    def state_specs(self):
        return {"score": ((), np.float64), "pend": ((), np.float64)}

    def observe(self, state, num_live, stats, view):
        col = _row(stats.col_sum, "snapkv", "col_sum", num_live)
        if col is None or num_live <= 0:
            return
        state.ensure_capacity(num_live)
        if stats.last_row is None:
            state["pend"][:num_live] += np.nan_to_num(col)
            return
        col = np.nan_to_num(col) + state["pend"][:num_live]
        state["pend"][:num_live] = 0.0
        pos = torch.from_numpy(np.array(view.logical_pos[:num_live], dtype=np.int64))[None]
        pooled = pool_logical(torch.from_numpy(col)[None], pos, torch.tensor([num_live]), self.policy.kernel)
        state["score"][:num_live] += pooled[0].numpy()

    def score(self, state, view):
        return state["score"][: view.num_live]


class _Own(Reference):
    """A test-local policy that carries its own numpy ``state_specs``/``observe``/``score``."""

    def state_specs(self):
        f = getattr(self.policy, "state_specs", None)
        return f() if f else {}

    def init_state(self):
        f = getattr(self.policy, "init_state", None)
        return f() if f else super().init_state()

    def observe(self, state, num_live, stats, view):
        f = getattr(self.policy, "observe", None)
        if f:
            f(state, num_live, stats, view)

    def score(self, state, view):
        return self.policy.score(state, view)

    def select_victims(self, state, view, num_to_evict):
        own = getattr(self.policy, "select_victims", None)
        return own(state, view, num_to_evict) if own else super().select_victims(state, view, num_to_evict)


class Batched(Reference):
    """The policy's own batched form run on one row: for a policy with no reference here (its
    decisions are then checked against the engine's for the same code, not independently)."""

    def state_specs(self):
        return {k: (lead, torch.empty(0, dtype=dt).numpy().dtype) for k, (lead, dt) in self.policy.side_specs().items()}

    def init_state(self):
        state = super().init_state()
        for k, dt in self.policy.request_specs().items():
            state.extra[k] = torch.zeros(1, dtype=dt)
        return state

    def _fields(self, state: SlotState, n: int) -> dict[str, torch.Tensor]:
        f = {k: torch.from_numpy(np.ascontiguousarray(np.moveaxis(a[..., :n], -1, 0)))[None].clone()
             for k, a in state.arrays.items()}
        f.update(state.extra)
        return f

    def _store(self, state: SlotState, f: dict[str, torch.Tensor], n: int) -> None:
        for k, a in state.arrays.items():
            a[..., :n] = np.moveaxis(f[k][0].numpy(), 0, -1)
        for k in state.extra:
            state.extra[k] = f[k]

    def observe(self, state, num_live, stats, view):
        n = num_live
        state.ensure_capacity(n)
        f = self._fields(state, n)
        if self.policy.observe_needs_pos:
            f["pos"] = torch.from_numpy(np.asarray(view.logical_pos[:n], dtype=np.int64))[None]
        t = {k: None if v is None else torch.from_numpy(_row(v, self.policy.name, k, n))[None]
             for k, v in (("col_sum", stats.col_sum), ("last_row", stats.last_row),
                          ("key_norm", stats.key_norm), ("key_sim", stats.key_sim))}
        extra = {k: t[k] for k in ("key_norm", "key_sim") if t[k] is not None}
        col = None if t["col_sum"] is None else torch.nan_to_num(t["col_sum"]) if self.policy.needs & (
            AttentionNeed.COL_SUM | AttentionNeed.WINDOW) else t["col_sum"]
        self.policy.observe_batched(f, torch.tensor([n]), col, t["last_row"], **extra)
        self._store(state, f, n)

    def score(self, state, view):
        n = view.num_live
        s = self.policy.score_batched(self._fields(state, n), torch.from_numpy(view.logical_pos)[None], torch.tensor([n]))
        return s[0, :n].to(torch.float64).numpy().copy()


def reference(policy: EvictionPolicy) -> Reference:
    """The per-request form of ``policy`` (module docstring); a :class:`Reference` is returned as is."""
    if isinstance(policy, Reference):
        return policy
    for cls in type(policy).__mro__:
        if cls in _REFS:
            return _REFS[cls](policy)
        if any(k in vars(cls) for k in _BATCHED_API):
            break  # the class changes the batched form: a parent's reference no longer describes it
    if callable(getattr(policy, "score", None)):
        return _Own(policy)
    return Batched(policy)
