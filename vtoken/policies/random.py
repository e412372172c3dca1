"""Random eviction: the seeded baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vtoken.policies.base import AttentionNeed, EvictionPolicy, SlotState, TokenView

__all__ = ["RandomPolicy", "position_hash", "position_hash_torch"]

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


def _signed(u: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch's wrapping int64 arithmetic)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_torch(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr(z, 30)
    z = z * _signed(int(_M1))
    z = z ^ _shr(z, 27)
    z = z * _signed(int(_M2))
    return z ^ _shr(z, 31)


def position_hash_torch(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """:func:`position_hash` in torch (any device): float64, bit for bit the same values.

    Args:
        seed: the policy seed (any int; its low 64 bits are used).
        positions: int64 tensor of logical positions, any shape.
    """
    key = int(_mix64(np.array([int(seed) & _MASK64], dtype=np.uint64))[0])
    z = _mix64_torch(_signed(key) + (positions.to(torch.int64) + 1) * _signed(int(_GAMMA)))
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


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

    def score_batched(self, fields, logical_pos, live):
        return position_hash_torch(self.seed, logical_pos)
