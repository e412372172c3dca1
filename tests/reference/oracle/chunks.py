"""The oracle's prefill: the prompt cut at its eviction points (``prefill_eviction: chunks``), each
chunk a scored forward over the live tokens before it and its own. A preemption needs no replay
(:mod:`reference.oracle`): the engine restores the request's K/V and policy state."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from vtoken.config import VTokenConfig, num_to_evict
from reference.oracle.forward import _EMPTY, Replay


def prefill_points(prompt_len: int, cfg: Optional[VTokenConfig]) -> list[int]:
    """The prompt's prefill chunks (token counts, summing to ``prompt_len``): cut at the multiples
    of ``cfg.prefill_eviction_every`` under ``prefill_eviction: chunks``, else one chunk."""
    if cfg is None or cfg.resolved_prefill_eviction() != "chunks":
        return [prompt_len]
    every = cfg.prefill_eviction_every
    return [min(every, prompt_len - s) for s in range(0, prompt_len, every)]


def prefill(r: Replay, prompt: list[int], chunks: list[int], cfg: Optional[VTokenConfig],
            schedule: Optional[dict[int, int]]) -> torch.Tensor:
    """The prompt's prefill, chunk by chunk (``chunks``: :func:`prefill_points`); with prefill eviction ``"chunks"``
    the request evicts down to its budget (or ``schedule[c]`` tokens) before each chunk ``c`` but the first,
    recording set 0's positions in ``r.prefill_evicted``. Returns the last chunk's next-token logits."""
    chunked_evict = bool(r.states) and len(chunks) > 1 and cfg.resolved_prefill_eviction() == "chunks"
    start = 0
    for ci, q in enumerate(chunks):
        n = len(r.pos[0])
        if ci and chunked_evict:
            k = num_to_evict(n, r.budget, r.slack) if schedule is None else min(int(schedule.get(ci, 0)), n)
            ev = r.evict(k, n) if k > 0 else [_EMPTY] * r.S
            r.prefill_evicted.append(ev[0])
        chunk_pos = np.arange(start, start + q, dtype=np.int64)
        r.append(chunk_pos)
        # every chunk's statistics in full, its last row included: the worker scores each
        # chunk's last query row whether or not the chunk samples
        logits = r.forward(prompt[start:start + q], chunk_pos, scored=True)
        start += q
    return logits
