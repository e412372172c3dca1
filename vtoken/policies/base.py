"""The eviction-policy interface shared by the vLLM integration and the dense oracle.

A policy sees one request at a time, through arrays indexed by **physical slot**
``0..num_live-1`` (the request-relative slot; slot ``s`` lives in the request's
block ``s // block_size`` at offset ``s % block_size``). Per-slot state (accumulated
scores, history) lives in a :class:`SlotState` that moves with the tokens when the
repack moves them (``apply_moves``) or when the dense oracle compacts its cache
(``compact``).

Decisions never depend on the slot order: protections are defined on logical
positions, and ties in the score are broken by logical position (the older token,
i.e. the smaller logical position, is evicted first). So vToken (permuted slots),
Naive-Evict and the dense oracle (logical order) make identical decisions given
identical scores.

Attention statistics a policy may ask for (``needs``), each ``np.ndarray`` of
``float64`` ``[num_live]`` indexed by slot, computed from the post-softmax attention
probabilities averaged over all layers and all query heads (with several token sets per
request, ``docs/granularity.md``, over the layers and query heads of the set, each set
being one such request-like row):

* ``col_sum``: for the query rows of this step (the prompt chunk at prefill, one row
  at decode), the sum over rows of each key's probability (H2O's accumulated attention).
* ``last_row``: the probabilities of the last query row of a step that samples a token
  (the final prompt token at prefill, the decode token at decode) (TOVA, Scissorhands).

Both include the keys written in the same step (the step's own tokens).

A slot a step's statistic does not cover holds ``NaN`` (e.g. K-norm's row for the slots the
step did not write), and ``AttentionStats.num_keys`` gives the number of keys the step
attended over when it differs from the arrays' length. ``observe`` must leave ``NaN`` slots
untouched.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np
import torch

__all__ = ["AttentionNeed", "AttentionStats", "SlotState", "TokenView", "EvictionPolicy", "BatchedFields"]

#: one request row per batch row: field name -> tensor ``[R, N, *lead]`` (per-slot) or ``[R]``
#: (per-request, see ``EvictionPolicy.request_specs``)
BatchedFields = dict[str, torch.Tensor]


class AttentionNeed(enum.Flag):
    """What a policy needs from attention (see the module docstring)."""

    NONE = 0
    COL_SUM = enum.auto()
    LAST_ROW = enum.auto()
    #: the L2 norm of each key written in the step (key-only policies: no attention pass;
    #: ``decide_on: worker`` only)
    KEY_NORM = enum.auto()
    #: ``COL_SUM`` over the step's last ``policy.window`` query rows only (SnapKV's observation
    #: window; ``decide_on: worker`` only: the worker reads the window from the request's policy)
    WINDOW = enum.auto()
    #: the running moments of each request's pre-RoPE queries, per (layer, query head), added in
    #: every step's forward (Expected Attention; ``decide_on: worker`` only)
    QUERY_MOMENTS = enum.auto()


@dataclass
class AttentionStats:
    """One step's attention statistics for one request (see module docstring).

    Attributes:
        col_sum: float64 ``[num_keys]`` or None when not requested.
        last_row: float64 ``[num_keys]`` or None when the step sampled no token
            (a non-final prefill chunk) or when not requested.
        num_keys: keys the step attended over, when it differs from the arrays' length
            None: the arrays' length. Entries may then be ``NaN`` (slot not covered).
        key_norm: float64 ``[num_keys]``: the L2 norm of the key of each slot written in this
            step (post-RoPE; RoPE is a rotation, so the norm is the pre-RoPE one), averaged over
            the (layer, KV head) pairs of the token set; ``NaN`` for every other slot. None when
            not requested.
        key_sim: float64 ``[num_keys]``: for a policy with ``eviction_keys``, each live slot's
            statistic computed from the cached keys right before an eviction, averaged over the
            token set's (layer, KV head) pairs: KeyDiff's cosine similarity to its head's anchor
            (``vtoken.policies.keydiff.key_similarity``), Expected Attention's expected attention
            (``vtoken.policies.expected_attention.expected_attention``). None otherwise.
    """

    col_sum: Optional[np.ndarray] = None
    last_row: Optional[np.ndarray] = None
    num_keys: Optional[int] = None
    key_norm: Optional[np.ndarray] = None
    key_sim: Optional[np.ndarray] = None


class SlotState:
    """Per-slot arrays of one request's policy state; the last axis is the physical slot.

    Arrays grow on demand (capacity doubles). Values of slots ``>= num_live`` are
    undefined; ``reset_slots`` zeroes a range before new tokens use it.

    Invariant: every array has the same capacity on its last axis.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]], capacity: int = 64):
        self._specs = {k: (tuple(lead), np.dtype(dt)) for k, (lead, dt) in specs.items()}
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}
        self.extra: dict[str, Any] = {}  # scalar per-request policy state (e.g. ring index)
        self.ensure_capacity(capacity)

    def ensure_capacity(self, n: int) -> None:
        """Make room for slots ``0..n-1`` (amortised O(1) per slot)."""
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
        """Copy each array's ``src`` slots to ``dst`` slots (gather, then scatter).

        Args:
            src, dst: int64 ``[num_moves]`` request-relative slots, as planned by
                the repack planner (disjoint sets; ``tests/reference/repack.py``).
        """
        if len(src) == 0:
            return
        for a in self.arrays.values():
            a[..., dst] = a[..., src]

    def compact(self, keep: np.ndarray) -> None:
        """Keep slots ``keep`` (int64 ``[k]``, ascending) and pack them into ``0..k-1``.

        Used by the dense oracle, whose cache stays in logical order. ``keep`` may also be
        a permutation of ``0..k-1``.
        """
        k = len(keep)
        for a in self.arrays.values():
            a[..., :k] = a[..., keep]


@dataclass
class TokenView:
    """What a policy sees of one request when it selects victims.

    Attributes:
        logical_pos: int64 ``[num_live]``: logical position of the token in each slot.
        num_logical: tokens ever appended to this request (prompt + generated so far
            whose KV is cached).
        prompt_len: number of prompt tokens (for ratio budgets and prefill-only policies).
        protected_prefix: the first ``protected_prefix`` logical positions are never evicted
            (tokens; with vLLM prefix caching, the request's cached/shared prefix blocks:
            ``docs/integration.md``, "Prefix caching"); 0: none.
    """

    logical_pos: np.ndarray
    num_logical: int
    prompt_len: int
    protected_prefix: int = 0

    @property
    def num_live(self) -> int:
        return int(self.logical_pos.shape[0])


def check_int_field(policy: str, field_name: str, value: Any, minimum: int) -> None:
    """Raise ``ValueError`` naming the field, the value and what is allowed unless
    ``value`` is an integer (not a bool) ``>= minimum``. For policies' ``__post_init__``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{policy}: {field_name} = {value!r}; allowed: an integer >= {minimum}")


@dataclass
class EvictionPolicy(ABC):
    """Base class: subclasses score tokens, the base class selects victims.

    Subclasses set ``name`` and ``needs``, define their per-slot state in
    ``state_specs``, update it in ``observe`` and return a keep-score in ``score``
    (higher = keep). :meth:`select_victims` applies the protections (attention
    sinks, recent window) and the tie-break (lower score first, then smaller
    logical position) and is the same for every policy.

    Attributes:
        sink_tokens: number of first logical positions never evicted.
        recent_tokens: number of most recent live tokens never evicted.
        seed: seed for randomised policies.
    """

    name: ClassVar[str] = "base"
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE
    #: True: the policy scores from the cached keys right before each eviction
    #: (``AttentionStats.key_sim``, set on the worker under ``decide_on: worker``; KeyDiff,
    #: Expected Attention)
    eviction_keys: ClassVar[bool] = False
    #: True: :meth:`observe_batched` needs each slot's logical position (``fields["pos"]``,
    #: int64 ``[rows, N]``; SnapKV pools in logical order)
    observe_needs_pos: ClassVar[bool] = False
    #: True: the policy's state after a prompt depends on statistics of prompt tokens other
    #: than the last one (accumulated column sums, a history of rows, an observation window,
    #: norms of the keys a step writes). A prefix-cache hit skips those tokens' forward, so
    #: vToken keeps a hit's tokens for such a policy (``docs/integration.md``, "Prefix caching").
    #: False: its decisions depend only on the KV cache, the last prompt token's attention
    #: (always computed: a hit stops one token short) and later steps, so a hit is exact.
    prompt_statistics: ClassVar[bool] = False
    #: True: the policy's only statistic is ``AttentionStats.key_norm`` and
    #: :meth:`observe_batched` reads and writes nothing but the fields of the slots the step
    #: wrote (K-norm). On the worker such a step is folded straight into those slots
    #: (:meth:`vtoken.decider.DeviceDecider.observe_written`), with no pass over the live ones.
    observes_written_only: ClassVar[bool] = False

    sink_tokens: int = 0
    recent_tokens: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        check_int_field(self.name, "sink_tokens", self.sink_tokens, 0)
        check_int_field(self.name, "recent_tokens", self.recent_tokens, 0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"{self.name}: seed = {self.seed!r}; allowed: an integer")

    def keeps_hit(self, prompt_len: int, hit: int) -> bool:
        """Prefix caching: whether a request of ``prompt_len`` tokens whose first ``hit`` tokens
        came from the prefix cache must keep its hit (never evict it), because its state after
        the prompt would need statistics of the hit's tokens, which were never computed.

        Args:
            prompt_len: the request's prompt length, in tokens.
            hit: its prefix-cache hit, in tokens (``0 < hit < prompt_len``).

        Returns:
            :attr:`prompt_statistics` by default; a policy whose prompt statistics come from its
            last queries only (SnapKV) answers per request.
        """
        return self.prompt_statistics

    # ----- defaults (class-level; the config layer asks these) -----
    @classmethod
    def default_sink_tokens(cls, budget: int) -> int:
        """Attention sinks kept when the config leaves ``sink_tokens`` unset, in tokens."""
        return 0

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        """Recent window kept when the config leaves ``recent_tokens`` unset, in tokens."""
        return 0

    @classmethod
    def default_granularity(cls) -> str:
        """Token-set granularity when the config leaves ``granularity`` unset under
        ``decide_on: worker`` (:meth:`vtoken.config.VTokenConfig.resolved_granularity`):
        ``"request"``, ``"layer"``, ``"head"`` or ``"head_shared"``. Default: ``"request"``."""
        return "request"

    @classmethod
    def default_slack(cls, budget: int) -> int:
        """Pacing slack (tokens over budget before evicting) when the config leaves it unset."""
        return 0

    @classmethod
    def default_args(cls, budget: int) -> dict[str, Any]:
        """Policy-specific arguments (dataclass fields) that depend on the budget, used where
        ``policy_args`` leaves them unset (:meth:`vtoken.config.VTokenConfig.make_policy`).
        Default: none (each field's own default applies)."""
        return {}

    @classmethod
    def arg_names(cls) -> frozenset[str]:
        """The policy-specific argument names ``policy_args`` may set (its dataclass fields
        other than ``sink_tokens``, ``recent_tokens`` and ``seed``)."""
        import dataclasses

        return frozenset(f.name for f in dataclasses.fields(cls)) - {"sink_tokens", "recent_tokens", "seed"}

    # ----- per-request state -----
    def state_specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Per-slot arrays: name -> (leading shape, dtype). Default: none."""
        return {}

    def init_state(self) -> SlotState:
        """A fresh per-request state."""
        return SlotState(self.state_specs())

    def observe(self, state: SlotState, num_live: int, stats: AttentionStats, view: TokenView) -> None:
        """Fold one step's attention statistics into the state.

        Called after each forward step that wrote tokens for this request, with
        ``num_live`` = live tokens after the step (keys that the stats cover).
        Slots written in this step were zeroed with ``reset_slots`` beforehand.
        """

    @abstractmethod
    def score(self, state: SlotState, view: TokenView) -> np.ndarray:
        """Keep-score per slot, float64 ``[num_live]``; higher = more worth keeping."""

    # ----- batched, on the device (vtoken.decider) -----
    def side_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot fields of the paged side cache (:class:`vtoken.decider.SideCache`):
        name -> (leading shape, torch dtype); by default the numpy ``state_specs``."""
        return {k: (lead, torch.from_numpy(np.zeros(0, dtype=dt)).dtype) for k, (lead, dt) in self.state_specs().items()}

    def request_specs(self) -> dict[str, torch.dtype]:
        """Per-request scalar fields (the batched ``SlotState.extra``): name -> dtype. Default: none."""
        return {}

    def observe_batched(self, fields: BatchedFields, live: torch.Tensor, col_sum: Optional[torch.Tensor],
                        last_row: Optional[torch.Tensor], **stats: Optional[torch.Tensor]) -> None:
        """Fold one step's statistics for a batch of requests, in place, on the device.

        The batched :meth:`observe`: row ``r`` of every tensor is one request, equal to what
        :meth:`observe` does to that request's :class:`SlotState` alone.

        Args:
            fields: per-slot fields gathered from the side cache, ``[R, N, *lead]``, and the
                per-request fields ``[R]``; updated in place (the caller scatters them back).
            live: int64 ``[R]``: live slots per request after the step (the keys attended).
            col_sum, last_row: float ``[R, N]`` (padding past ``live`` is 0), or None when
                the step did not produce them (the batch shares one kind of step).
            stats: further statistics by name, given only to a policy that needs them:
                ``key_norm`` (float ``[R, N]``, ``NaN`` where not written this step).
        """

    def score_batched(self, fields: BatchedFields, logical_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Keep-scores of a batch of requests, float64 ``[R, N]`` (higher = keep): row ``r``
        equals :meth:`score` of that request alone on its live slots (padding: anything).

        Raises:
            NotImplementedError: the policy has no batched form (the per-request path only).
        """
        raise NotImplementedError(f"policy {self.name!r} has no batched (device) form")

    # ----- selection (shared) -----
    def protected_mask(self, view: TokenView) -> np.ndarray:
        """bool ``[num_live]``: slots holding sinks, recent tokens or the protected prefix
        (``view.protected_prefix``)."""
        pos = view.logical_pos
        prot = pos < max(self.sink_tokens, view.protected_prefix)
        if self.recent_tokens > 0:
            n = view.num_live
            if self.recent_tokens >= n:
                prot[:] = True
            else:
                # the recent_tokens largest logical positions among live tokens
                cutoff = np.partition(pos, n - self.recent_tokens)[n - self.recent_tokens]
                prot |= pos >= cutoff
        return prot

    def select_victims(self, state: SlotState, view: TokenView, num_to_evict: int) -> np.ndarray:
        """Slots to evict, int64 ``[num_to_evict]`` (ascending).

        Victims are the unprotected slots with the lowest ``score``; ties go to the
        smaller logical position. If fewer unprotected tokens exist than asked for,
        all unprotected tokens are evicted (the request then holds more than its
        budget; the config layer rejects ``sink_tokens + recent_tokens > budget``).
        """
        if num_to_evict <= 0:
            return np.zeros(0, dtype=np.int64)
        n = view.num_live
        scores = np.asarray(self.score(state, view), dtype=np.float64)
        assert scores.shape == (n,), (scores.shape, n)
        cand = np.flatnonzero(~self.protected_mask(view))
        if len(cand) == 0:
            return np.zeros(0, dtype=np.int64)
        order = np.lexsort((view.logical_pos[cand], scores[cand]))
        victims = cand[order[:num_to_evict]]
        return np.sort(victims).astype(np.int64)
