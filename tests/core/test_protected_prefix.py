"""The protected prefix (prefix caching, docs/integration.md): ``TokenView.protected_prefix``.

Victims never come from the first ``protected_prefix`` logical positions, for every policy, in
any slot order; and the choice among the other tokens is the one the policy makes when those
positions are simply not candidates (a hand-built reference: the lowest scores among the
unprotected, non-sink, non-recent tokens, ties to the older token).
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.policies import AttentionStats, TokenView, reference
from vtoken.policies import AttentionNeed, available_policies, get_policy_class


def _policy(name):
    return reference(get_policy_class(name)(sink_tokens=2, recent_tokens=3, seed=1))


@pytest.mark.parametrize("name", sorted(available_policies()))
@pytest.mark.parametrize("protected", [0, 8, 16, 40])
def test_victims_skip_the_protected_prefix(name, protected):
    rng = np.random.default_rng(protected + 7)
    n = 40
    pos = rng.permutation(n).astype(np.int64)  # any slot order
    pol = _policy(name)
    st = pol.init_state()
    st.reset_slots(0, n)
    view = TokenView(logical_pos=pos, num_logical=n, prompt_len=n, protected_prefix=protected)
    # dyadic scores with ties, a function of the logical position only
    vals = np.array([((p * 5) % 7 + 1) / 16.0 for p in pos])
    stats = AttentionStats(col_sum=vals if pol.needs & AttentionNeed.COL_SUM else None,
                           last_row=vals if pol.needs & AttentionNeed.LAST_ROW else None)
    pol.observe(st, n, stats, view)
    k = 6
    victims = pol.select_victims(st, view, k)
    got = sorted(pos[victims].tolist())
    # reference: candidates by logical position, excluding sinks (2), the 3 most recent and the prefix
    scores = pol.score(st, view)
    cand = [(scores[s], int(pos[s])) for s in range(n) if max(2, protected) <= pos[s] < n - 3]
    want = sorted(p for _, p in sorted(cand)[:k])
    assert got == want
    assert all(p >= protected for p in got)


def test_all_protected_evicts_nothing():
    pol = _policy("streaming")
    st = pol.init_state()
    st.reset_slots(0, 10)
    view = TokenView(logical_pos=np.arange(10), num_logical=10, prompt_len=10, protected_prefix=10)
    assert len(pol.select_victims(st, view, 4)) == 0


def test_oracle_refuses_a_negative_protected_prefix():
    from reference.oracle import oracle_generate

    class _M:
        class config:  # noqa: N801 - a stand-in for a HF config
            _attn_implementation = "eager"

    with pytest.raises(ValueError, match="protected_prefix = -1"):
        oracle_generate(_M(), [1, 2, 3], 2, None, protected_prefix=-1)
