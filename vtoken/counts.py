"""The scheduler's counts: what it needs to say "how many" without seeing a token.

The scheduler (``docs/eviction.md``) never sees a token's
score or logical position. Per request and step it works from integers only:

* :func:`num_to_evict` (``vtoken.config``) or pressure pacing (``vtoken.pacing``) asks for
  ``k`` tokens;
* :func:`evictable` caps ``k`` at the live tokens no protection covers, which is exactly the
  number the worker's selection (:func:`vtoken.select.select_victims`, the rules of
  ``Reference.select_victims`` in ``tests/reference/policies.py``) then evicts;
* :class:`CountTable` keeps the live and logical counts the block accounting needs
  (``cdiv(live, B)`` blocks); the worker keeps the token table itself, in its side cache
  (:class:`vtoken.side_cache.SideCache`).

This module never imports vllm.
"""

from __future__ import annotations



def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (``-(-a // b)``)."""
    return -(-a // b)


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


__all__ = ["CountTable", "evictable"]


def evictable(num_live: int, num_logical: int, sink_tokens: int, recent_tokens: int, protected_prefix: int) -> int:
    """Live tokens that no protection covers (the most a policy can evict now).

    Protected: the logical positions below ``max(sink_tokens, protected_prefix)`` and the
    ``recent_tokens`` largest live positions (:func:`vtoken.select.protected_mask`). Positions
    below the first bound are never evicted, so all ``P = min(bound, num_logical)`` of them are
    live; they are the smallest live positions, so the recent window overlaps them only when
    fewer than ``recent_tokens`` other tokens are live.

    >>> evictable(10, 30, 2, 3, 0), evictable(10, 30, 0, 0, 4), evictable(4, 4, 2, 5, 0)
    (5, 6, 0)
    """
    p = min(max(sink_tokens, protected_prefix), num_logical, num_live)
    return max(0, num_live - p - min(recent_tokens, num_live - p))


class CountTable:
    """A request's token table in counts only: the scheduler's view.

    The counts equal ``tests/reference/token_table.py`` ``TokenTable``'s for the same appends and
    evictions; which slots hold which positions is the worker's business.

    Attributes:
        block_size: B, tokens per block.
        num_live: live tokens (the request's physical length in slots).
        num_logical: tokens ever appended (the next token's logical position).
    """

    def __init__(self, block_size: int):
        self.block_size = _check_block_size(block_size)
        self.num_live = 0
        self.num_logical = 0

    @property
    def offset(self) -> int:
        """``num_logical - num_live``: tokens evicted so far."""
        return self.num_logical - self.num_live

    def num_blocks(self) -> int:
        """Blocks the live tokens fill: ``cdiv(num_live, block_size)``."""
        return cdiv(self.num_live, self.block_size)

    def append(self, n: int) -> None:
        """Append ``n >= 0`` tokens.

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"append: n = {n}; allowed: >= 0")
        self.num_live += n
        self.num_logical += n

    def evict(self, k: int) -> None:
        """Evict ``k`` live tokens (``0 <= k <= num_live``).

        Raises:
            ValueError: ``k`` out of range.
        """
        if not 0 <= k <= self.num_live:
            raise ValueError(f"evict: k = {k}; allowed: 0..{self.num_live} (the live tokens)")
        self.num_live -= k

    def reset(self) -> None:
        self.num_live = self.num_logical = 0

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` unless ``0 <= num_live <= num_logical``."""
        assert 0 <= self.num_live <= self.num_logical, f"counts: live {self.num_live}, logical {self.num_logical}"

    def __repr__(self) -> str:
        return f"CountTable(block_size={self.block_size}, num_live={self.num_live}, num_logical={self.num_logical})"
