"""Random eviction: the seeded baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtoken.policies.base import AttentionNeed, EvictionPolicy

__all__ = ["RandomPolicy", "position_hash_torch"]

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64_int(z: int) -> int:
    """SplitMix64's finaliser on one uint64 (a Python int, wrapping at 64 bits)."""
    z ^= z >> 30
    z = (z * _M1) & _MASK64
    z ^= z >> 27
    z = (z * _M2) & _MASK64
    return z ^ (z >> 31)


def _signed(u: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch's wrapping int64 arithmetic)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_torch(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr(z, 30)
    z = z * _signed(_M1)
    z = z ^ _shr(z, 27)
    z = z * _signed(_M2)
    return z ^ _shr(z, 31)


def position_hash_torch(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """A uniform-looking float64 in ``[0, 1)`` per logical position, a pure function of
    ``(seed, position)``: a SplitMix64-style integer hash, top 53 bits, on any device. The global
    RNG is never touched.

    Args:
        seed: the policy seed (any int; its low 64 bits are used).
        positions: int64 tensor of logical positions, any shape.
    """
    key = _mix64_int(int(seed) & _MASK64)
    z = _mix64_torch(_signed(key) + (positions.to(torch.int64) + 1) * _signed(_GAMMA))
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


@dataclass
class RandomPolicy(EvictionPolicy):
    """Random eviction, the baseline of the vToken paper (as KV-Compress ``--random-evict``
    and kvpress ``RandomPress``).

    Idea: evict uniformly random unprotected tokens; a floor for the attention-based
    policies under the same budget and protections.

    Score: ``position_hash_torch(seed, logical_pos)``, a deterministic function of the seed
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
    paper: ClassVar[str] = 'baseline'
    summary: ClassVar[str] = 'seeded hash of the logical position'
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE

    def score_batched(self, fields, logical_pos, live):
        return position_hash_torch(self.seed, logical_pos)
