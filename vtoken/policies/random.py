"""Random eviction: the seeded baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.base import AttentionNeed, EvictionPolicy, SlotState, TokenView

__all__ = ["RandomPolicy", "position_hash"]

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def position_hash(seed: int, positions: np.ndarray) -> np.ndarray:
    """A uniform-looking float64 in ``[0, 1)`` per logical position, a pure function of
    ``(seed, position)``: a SplitMix64-style integer hash, top 53 bits.

    The global RNG (``random``, ``np.random``) is never touched.
    """
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(np.array([int(seed) & _MASK64], dtype=np.uint64))[0]
        z = _mix64(key + (pos + np.uint64(1)) * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class RandomPolicy(EvictionPolicy):
    """Random eviction, the baseline of the vToken paper (as KV-Compress ``--random-evict``
    and kvpress ``RandomPress``).

    Idea: evict uniformly random unprotected tokens; a floor for the attention-based
    policies under the same budget and protections.

    Score: ``position_hash(seed, logical_pos)``, a deterministic function of the seed
    and the token's logical position only, so vToken (permuted slots), Naive-Evict
    and the dense oracle (logical order) evict the same tokens, and a run is
    reproducible. The global RNG is never touched.

    Defaults: ``seed = 0`` (``VTokenConfig.seed``), no protections
    (``sink_tokens = 0``, ``recent_tokens = 0``), ``slack = 0``.

    Needs: nothing from attention (``AttentionNeed.NONE``).

    Departures: none of substance (a token's score is fixed for its lifetime instead
    of redrawn at each eviction, which is what makes the choices reproducible
    across slot layouts).
    """

    name: ClassVar[str] = "random"
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE

    def score(self, state: SlotState, view: TokenView) -> np.ndarray:
        return position_hash(self.seed, view.logical_pos)
