"""Expected Attention's statistic (``vtoken.policies.expected_attention``) against independent
references: explicit RoPE matrices, a full covariance masked to RoPE's pairs, and the exact
attention of a single known query."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vtoken.config import VTokenConfig
from vtoken.policies.expected_attention import (
    ExpectedAttentionPolicy, expected_attention, future_rotation, pair_terms, rope_pairs, unrotate)


def _rope_matrix(theta: np.ndarray, p: int, neox: bool) -> np.ndarray:
    """RoPE at position ``p`` as a ``D x D`` matrix, built from its definition."""
    d = 2 * len(theta)
    r = np.zeros((d, d))
    for i, t in enumerate(theta):
        a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
        c, s = math.cos(p * t), math.sin(p * t)
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


def _cos_sin(theta: np.ndarray, n_pos: int) -> torch.Tensor:
    ang = np.arange(n_pos)[:, None] * theta[None, :]
    return torch.from_numpy(np.concatenate([np.cos(ang), np.sin(ang)], axis=1))


@pytest.mark.parametrize("neox", [True, False])
def test_unrotate_inverts_rope(neox):
    rng = np.random.default_rng(0)
    d, h = 8, 3
    theta = 10000.0 ** (-np.arange(0, d, 2) / d)
    cs = _cos_sin(theta, 50)
    a, b = rope_pairs(d, neox)
    pos = np.array([0, 7, 49])
    raw = rng.normal(size=(3, h, d))
    post = np.stack([raw[m] @ _rope_matrix(theta, int(p), neox).T for m, p in enumerate(pos)])
    got = unrotate(torch.from_numpy(post), cs[pos, : d // 2], cs[pos, d // 2:], a, b)
    np.testing.assert_allclose(got.numpy(), raw, atol=1e-12)
    pt = pair_terms(torch.from_numpy(raw), a, b).numpy()
    assert pt.shape == (3, h, d // 2, 3)
    np.testing.assert_allclose(pt[..., 1], raw[..., a.numpy()] * raw[..., b.numpy()])


def test_future_rotation_is_the_mean_over_the_next_positions():
    d = 6
    theta = 10000.0 ** (-np.arange(0, d, 2) / d)
    cs = _cos_sin(theta, 40)
    cb, sb = future_rotation(cs, torch.tensor([3, 35, 40]), 8)
    np.testing.assert_allclose(cb[0].numpy(), np.cos(np.arange(3, 11)[:, None] * theta).mean(0), atol=1e-12)
    np.testing.assert_allclose(sb[1].numpy(), np.sin(np.arange(35, 40)[:, None] * theta).mean(0), atol=1e-12)
    assert cb[2].abs().sum() == 0 and sb[2].abs().sum() == 0  # no position left


@pytest.mark.parametrize("neox", [True, False])
def test_expected_attention_equals_the_full_matrix_reference(neox):
    """Random pre-RoPE queries and keys: the pairwise formula equals ``softmax(k R mu / sqrt(D) +
    k^T (R S R^T masked to pairs) k / 2D)`` with ``R`` the mean of explicit RoPE matrices."""
    rng = np.random.default_rng(1)
    d, hkv, g, n, nq, start, nf = 8, 2, 3, 11, 9, 20, 6
    hq = hkv * g
    theta = 10000.0 ** (-np.arange(0, d, 2) / d)
    cs = _cos_sin(theta, 64)
    a, b = rope_pairs(d, neox)
    queries = rng.normal(size=(nq, hq, d)) + rng.normal(size=(1, hq, d))  # pre-RoPE
    keys = rng.normal(size=(1, hkv, n, d))
    vals = rng.normal(size=(1, hkv, n, d))
    live = 9
    qt = torch.from_numpy(queries)
    cb, sb = future_rotation(cs, torch.tensor([start]), nf)
    got = expected_attention(torch.from_numpy(keys), torch.tensor([live]), qt.sum(0)[None],
                             pair_terms(qt, a, b).sum(0)[None], torch.tensor([nq]), cb, sb, a, b,
                             vnorm=torch.from_numpy(np.linalg.norm(vals, axis=-1)))[0].numpy()
    # reference
    r_bar = np.mean([_rope_matrix(theta, p, neox) for p in range(start, start + nf)], axis=0)
    an, bn = a.numpy(), b.numpy()
    mask = np.zeros((d, d))
    for i, j in zip(an, bn):
        mask[np.ix_([i, j], [i, j])] = 1.0
    want = np.zeros((hkv, n))
    for j in range(hq):
        mu = queries[:, j].mean(0)
        cov = (queries[:, j].T @ queries[:, j]) / nq - np.outer(mu, mu)
        mu2, cov2 = r_bar @ mu, (r_bar @ cov @ r_bar.T) * mask
        k = keys[0, j // g, :live]
        z = k @ mu2 / math.sqrt(d) + np.einsum("nd,de,ne->n", k, cov2, k) / (2 * d)
        e = np.exp(z - z.max())
        want[j // g, :live] += e / e.sum() / g
    want[:, :live] *= np.linalg.norm(vals[0, :, :live], axis=-1)
    np.testing.assert_allclose(got[:, :live], want[:, :live], rtol=2e-5, atol=1e-9)  # (float32 products)
    assert np.isnan(got[:, live:]).all()


def test_one_known_query_gives_its_attention():
    """All queries equal (no covariance), averaged rotation = identity (position 0 only): the score
    is the attention of that query itself."""
    rng = np.random.default_rng(2)
    d, n = 8, 7
    q = rng.normal(size=(1, 1, d))
    k = rng.normal(size=(1, 1, n, d))
    a, b = rope_pairs(d, True)
    qt = torch.from_numpy(np.repeat(q, 5, axis=0))
    cs = _cos_sin(10000.0 ** (-np.arange(0, d, 2) / d), 16)
    cb, sb = future_rotation(cs, torch.tensor([0]), 1)
    got = expected_attention(torch.from_numpy(k), torch.tensor([n]), qt.sum(0)[None], pair_terms(qt, a, b).sum(0)[None],
                             torch.tensor([5]), cb, sb, a, b)[0, 0].numpy()
    z = k[0, 0] @ q[0, 0] / math.sqrt(d)
    np.testing.assert_allclose(got, np.exp(z) / np.exp(z).sum(), rtol=2e-5)  # (float32 products)


def test_policy_keeps_the_highest_expected_attention_and_refuses_bad_args():
    cfg = VTokenConfig(policy="expected_attention", budget=8)
    pol = cfg.make_policy()
    assert isinstance(pol, ExpectedAttentionPolicy)
    assert pol.sink_tokens == 4 and pol.n_future == 512 and cfg.resolved_granularity() == "head"
    with pytest.raises(ValueError, match="n_future = 0"):
        VTokenConfig(policy="expected_attention", budget=8, policy_args={"n_future": 0})
    with pytest.raises(ValueError, match="decide_on = 'scheduler': the scheduler-side eviction path was removed"):
        VTokenConfig(policy="expected_attention", budget=8, decide_on="scheduler")
    with pytest.raises(ValueError, match="score_every = 2"):
        VTokenConfig(policy="expected_attention", budget=8, score_every=2)
