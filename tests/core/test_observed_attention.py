"""The policy added as one file (``vtoken/policies/observed_attention.py``, issue 44): found without
registration, H2O's score with no recent window, against hand-computed victims.

The engine matrices (``tests/integration/test_worker_eviction.py``, ``test_granularity.py``,
``test_prefill_eviction.py``) and ``tests/core/test_side_cache.py`` take every registered policy, so
they run this one against the dense oracle with no change."""

from __future__ import annotations

import numpy as np
import torch

from reference.policies import AttentionStats, TokenView, reference
from vtoken.config import parse_config
from vtoken.policies import AttentionNeed, available_policies, get_policy_class
from vtoken.policies.h2o import H2OPolicy
from vtoken.policies.observed_attention import ObservedAttentionPolicy
from vtoken.select import select_victims


def test_found_by_discovery_with_its_defaults():
    assert available_policies()["observed_attention"] == "vtoken.policies.observed_attention:ObservedAttentionPolicy"
    assert get_policy_class("observed_attention") is ObservedAttentionPolicy
    cfg = parse_config({"policy": "observed_attention", "budget": 64})
    assert cfg.protections() == (0, 0) and cfg.resolved_slack() == 0 and cfg.resolved_granularity() == "head"
    assert ObservedAttentionPolicy.needs == AttentionNeed.COL_SUM
    # H2O at the same budget keeps a recent window of half of it
    assert parse_config({"policy": "h2o", "budget": 64}).protections() == (0, 32)


def test_its_reference_is_h2os_numpy_form():
    """Not its own batched code: the oracle checks it against an independent form."""
    assert type(reference(ObservedAttentionPolicy())) is type(reference(H2OPolicy()))


def test_the_newest_token_is_a_victim_when_it_scores_lowest():
    """Accumulated column sums 2.5, 1.125, 1.0, 0.25, 0.125 over positions 0..4 (dyadic, exact):
    observed attention evicts positions 4 and 3; H2O with a 1-token recent window keeps 4."""
    pos = np.arange(5, dtype=np.int64)
    steps = [np.array([1.75, 0.75, 0.5]), np.array([0.5, 0.125, 0.25, 0.125]),
             np.array([0.25, 0.25, 0.25, 0.125, 0.125])]
    oa = reference(ObservedAttentionPolicy())
    h2o = reference(H2OPolicy(recent_tokens=1))
    states = [oa.init_state(), h2o.init_state()]
    for col in steps:
        n = len(col)
        view = TokenView(pos[:n], n, 3)
        for pol, st in zip((oa, h2o), states):
            st.reset_slots(n - 1, n) if n > 3 else None
            pol.observe(st, n, AttentionStats(col_sum=col), view)
    view = TokenView(pos, 5, 3)
    np.testing.assert_array_equal(oa.score(states[0], view), [2.5, 1.125, 1.0, 0.25, 0.125])
    np.testing.assert_array_equal(oa.select_victims(states[0], view, 2), [3, 4])
    np.testing.assert_array_equal(h2o.select_victims(states[1], view, 2), [2, 3])
    # the batched form and the device selection agree
    pol = ObservedAttentionPolicy()
    fields = {"acc": torch.zeros(1, 5, dtype=torch.float64)}
    for col in steps:
        c = torch.zeros(1, 5, dtype=torch.float64)
        c[0, : len(col)] = torch.from_numpy(col)
        pol.observe_batched(fields, torch.tensor([len(col)]), c, None)
    scores = pol.score_batched(fields, torch.from_numpy(pos)[None], torch.tensor([5]))
    victims = select_victims(scores, torch.from_numpy(pos)[None], torch.tensor([5]), torch.tensor([2]),
                             sink_tokens=0, recent_tokens=0, max_evict=2)
    assert torch.nonzero(victims[0]).flatten().tolist() == [3, 4]
