"""The eviction-policy interface: each policy is one batched score over a paged side cache.

A policy declares its per-slot state (``side_specs``: name -> leading shape and torch dtype), its
per-request scalars (``request_specs``), the statistics it needs (``needs``), and two batched
functions on the device: ``observe_batched`` folds one step's statistics into the state of a
batch of requests (row ``r`` is one request, or one token set), ``score_batched`` returns a
keep-score per slot. :mod:`vtoken.select` applies the protections every policy shares (attention
sinks, the recent window, a protected prefix) and the tie-break (lower score first, then the
smaller logical position), so decisions never depend on the slot order.

Statistics a policy may ask for (``needs``), float ``[R, N]`` by slot, from the post-softmax
attention probabilities averaged over the token set's layers and query heads
(``docs/granularity.md``): ``col_sum`` (for the step's query rows, each key's summed probability:
H2O), ``last_row`` (the last query row of a step that samples: TOVA, Scissorhands), and by name
``key_norm``, ``key_sim``, the ``window`` column sums and the query moments. A slot a step does
not cover holds ``NaN`` where the docstring of the need says so.

The per-request numpy form of every built-in policy, which the dense oracle decides with, is an
independent reference under ``tests/reference/policies.py``.
"""

from __future__ import annotations

import enum
from abc import ABC
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np
import torch

__all__ = ["AttentionNeed", "EvictionPolicy", "BatchedFields"]

#: one request row per batch row: field name -> tensor ``[R, N, *lead]`` (per-slot) or ``[R]``
#: (per-request, see ``EvictionPolicy.request_specs``)
BatchedFields = dict[str, torch.Tensor]


class AttentionNeed(enum.Flag):
    """What a policy needs from attention (see the module docstring)."""

    NONE = 0
    COL_SUM = enum.auto()
    LAST_ROW = enum.auto()
    #: the L2 norm of each key written in the step (key-only policies: no attention pass)
    KEY_NORM = enum.auto()
    #: ``COL_SUM`` over the step's last ``policy.window`` query rows only (SnapKV's observation
    #: window; the worker reads the window from the request's policy)
    WINDOW = enum.auto()
    #: the running moments of each request's pre-RoPE queries, per (layer, query head), added in
    #: every step's forward (Expected Attention)
    QUERY_MOMENTS = enum.auto()


def check_int_field(policy: str, field_name: str, value: Any, minimum: int) -> None:
    """Raise ``ValueError`` naming the field, the value and what is allowed unless
    ``value`` is an integer (not a bool) ``>= minimum``. For policies' ``__post_init__``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{policy}: {field_name} = {value!r}; allowed: an integer >= {minimum}")


@dataclass
class EvictionPolicy(ABC):
    """Base class: a policy is its batched score (module docstring).

    Subclasses set ``name`` and ``needs``, declare their per-slot state in ``side_specs``,
    update it in ``observe_batched`` and return keep-scores in ``score_batched`` (higher =
    keep). The selection (:func:`vtoken.select.select_victims`: protections, tie-break) is the
    same for every policy.

    Attributes:
        sink_tokens: number of first logical positions never evicted.
        recent_tokens: number of most recent live tokens never evicted.
        seed: seed for randomised policies.
    """

    name: ClassVar[str] = "base"
    #: the source, as the README's policy table prints it (e.g. ``"H2O, arXiv 2306.14048"``)
    paper: ClassVar[str] = ""
    #: what the score keeps, in a few words (the README's policy table)
    summary: ClassVar[str] = ""
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE
    #: True: the policy scores from the cached keys right before each eviction
    #: (``key_sim``, computed on the worker; KeyDiff,
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
    #: True: the policy's only statistic is ``key_norm`` and
    #: :meth:`observe_batched` reads and writes nothing but the fields of the slots the step
    #: wrote (K-norm). On the worker such a step is folded straight into those slots
    #: (:meth:`vtoken.side_cache.DeviceDecider.observe_written`), with no pass over the live ones.
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
        """Token-set granularity when the config leaves ``granularity`` unset
        (:meth:`vtoken.config.VTokenConfig.resolved_granularity`):
        ``"request"``, ``"layer"``, ``"head"`` or ``"head_shared"``. Default: ``"request"``."""
        return "request"

    @classmethod
    def default_slack(cls, budget: int) -> int:
        """Pacing slack (tokens over budget before evicting) when the config leaves it unset."""
        return 0

    @classmethod
    def known_weaknesses(cls, granularity: str, prefill_eviction: str) -> list[str]:
        """Measured weaknesses of this policy with these token sets and prefill eviction, one
        sentence each (``RequestPlan.known_weaknesses``; the plugin logs them at start-up).
        Default: none."""
        return []

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

    # ----- batched, on the device (vtoken.side_cache) -----
    def side_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot fields of the paged side cache (:class:`vtoken.side_cache.SideCache`):
        name -> (leading shape, torch dtype). Default: none."""
        return {}

    def request_specs(self) -> dict[str, torch.dtype]:
        """Per-request scalar fields (e.g. Scissorhands' ring index): name -> dtype. Default: none."""
        return {}

    def observe_batched(self, fields: BatchedFields, live: torch.Tensor, col_sum: Optional[torch.Tensor],
                        last_row: Optional[torch.Tensor], **stats: Optional[torch.Tensor]) -> None:
        """Fold one step's statistics for a batch of requests, in place, on the device.

        Row ``r`` of every tensor is one request (or token set), and what a row gets must not
        depend on the other rows (the same request decides alike in any batch).

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
        """Keep-scores of a batch of requests, float64 ``[R, N]`` (higher = keep), row ``r`` a
        function of that row alone; padding past ``live``: anything.

        Raises:
            NotImplementedError: the subclass wrote none (every policy must).
        """
        raise NotImplementedError(f"policy {self.name!r} has no batched (device) form")
