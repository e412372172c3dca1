"""vtoken.select: the batched victim selection and repack planning, against the per-request
reference (EvictionPolicy.select_victims / protected_mask and vtoken.repack.plan_repack)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.policies import TokenView, reference
from vtoken.policies.base import EvictionPolicy
from reference.repack import plan_repack
import vtoken.select
from vtoken.select import global_slots, plan_moves, protected_mask, select_victims

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class _Given(EvictionPolicy):
    """A policy whose keep-scores are handed in (the reference's selection rules only)."""

    name = "given"

    def score(self, state, view):
        return state


def _reference(scores, pos, k, sinks, recent, prefix):
    pol = reference(_Given(sink_tokens=sinks, recent_tokens=recent))
    view = TokenView(logical_pos=np.asarray(pos, dtype=np.int64), num_logical=int(max(pos, default=-1)) + 1,
                     prompt_len=0, protected_prefix=prefix)
    prot = pol.protected_mask(view) if len(pos) else np.zeros(0, dtype=bool)
    return pol.select_victims(np.asarray(scores, dtype=np.float64), view, k), prot


@st.composite
def batches(draw):
    r = draw(st.integers(1, 6))
    rows = []
    for _ in range(r):
        n = draw(st.integers(0, 24))
        logical = n + draw(st.integers(0, 10))  # some positions were evicted before
        if draw(st.booleans()):  # any live set
            pos = draw(st.permutations(list(range(logical))))[:n]
        else:  # a state the protocol reaches: the newest positions all live, older ones thinned
            keep_top = draw(st.integers(0, n))
            older = draw(st.permutations(list(range(logical - keep_top))))[: n - keep_top]
            pos = draw(st.permutations(older + list(range(logical - keep_top, logical))))
        # few distinct values: many ties; inf and NaN too
        scores = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -1.0, float("inf"), float("nan")]),
                               min_size=n, max_size=n))
        rows.append(dict(pos=pos, scores=scores, logical=logical, k=draw(st.integers(-1, n + 3)), sinks=draw(st.integers(0, 5)),
                         recent=draw(st.integers(0, n + 2)), prefix=draw(st.integers(0, 8))))
    pad = draw(st.integers(0, 3))
    return rows, max(len(x["pos"]) for x in rows) + pad


def _pack(rows, width, device):
    r = len(rows)
    pos = torch.full((r, width), 10**6, dtype=torch.int64)  # padding holds garbage
    sc = torch.full((r, width), -5.0, dtype=torch.float64)
    for i, x in enumerate(rows):
        pos[i, : len(x["pos"])] = torch.tensor(x["pos"], dtype=torch.int64)
        sc[i, : len(x["scores"])] = torch.tensor(x["scores"], dtype=torch.float64)
    vec = lambda key: torch.tensor([x[key] for x in rows], dtype=torch.int64, device=device)  # noqa: E731
    live = torch.tensor([len(x["pos"]) for x in rows], dtype=torch.int64, device=device)
    return sc.to(device), pos.to(device), live, vec("k"), vec("sinks"), vec("recent"), vec("prefix")


@pytest.fixture(params=["sort", "topk"])
def method(request, monkeypatch):
    """Both selection paths: the batched lexsort, and topk (taken unless a score is NaN)."""
    monkeypatch.setattr(vtoken.select, "_FEW_RATIO", 0 if request.param == "topk" else 10**9)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(batch=batches(), logical_known=st.booleans())
def test_equals_the_per_request_reference(device, method, batch, logical_known):
    rows, width = batch
    sc, pos, live, k, sinks, recent, prefix = _pack(rows, width, device)
    # num_logical: the fast recent window where the row's top positions are all live, a sort elsewhere
    nl = torch.tensor([x["logical"] for x in rows], device=device) if logical_known else None
    got = select_victims(sc, pos, live, k, sink_tokens=sinks, recent_tokens=recent, protected_prefix=prefix,
                         num_logical=nl)
    prot = protected_mask(pos, live, sink_tokens=sinks, recent_tokens=recent, protected_prefix=prefix,
                          num_logical=nl)
    plan = plan_moves(got, live)
    assert got.dtype == torch.bool and got.shape == (len(rows), width) and got.device.type == device
    for i, x in enumerate(rows):
        n = len(x["pos"])
        want, want_prot = _reference(x["scores"], x["pos"], x["k"], x["sinks"], x["recent"], x["prefix"])
        assert torch.nonzero(got[i]).flatten().tolist() == want.tolist(), (i, x)
        assert not got[i, n:].any() and not prot[i, n:].any()
        assert prot[i, :n].tolist() == want_prot.tolist()
        rp = plan_repack(want, n, 4)
        sel = plan.rows == i
        assert plan.src[sel].tolist() == rp.src.tolist() and plan.dst[sel].tolist() == rp.dst.tolist()
        assert int(plan.new_live[i]) == rp.new_num_live
    assert plan.rows.tolist() == sorted(plan.rows.tolist())


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(batch=batches(), unprotected=st.booleans())
def test_steady_decode_and_int_protections_equal_the_reference(device, batch, unprotected):
    """At most one victim per row (steady decode: the one-victim path of ``topk``), with the
    protections as Python ints (``unprotected``: all 0, the shortcut that protects nothing,
    K-norm's default) or one per row, against the per-request reference."""
    rows, width = batch
    for x in rows:
        x["k"] = min(x["k"], 1)
        if unprotected:
            x["sinks"] = x["recent"] = x["prefix"] = 0
    sc, pos, live, k, sinks, recent, prefix = _pack(rows, width, device)
    kw = dict(sink_tokens=0, recent_tokens=0, protected_prefix=0) if unprotected else dict(
        sink_tokens=sinks, recent_tokens=recent, protected_prefix=prefix)
    got = select_victims(sc, pos, live, k, **kw)
    prot = protected_mask(pos, live, **kw)
    for i, x in enumerate(rows):
        want, want_prot = _reference(x["scores"], x["pos"], x["k"], x["sinks"], x["recent"], x["prefix"])
        assert torch.nonzero(got[i]).flatten().tolist() == want.tolist(), (i, x)
        assert prot[i, : len(x["pos"])].tolist() == want_prot.tolist() and not prot[i, len(x["pos"]):].any()


def test_hand_case_ties_and_every_protection(method):
    # One request, 12 live slots in a permuted order (a repack happened before).
    pos = torch.tensor([[0, 1, 2, 11, 4, 5, 6, 7, 8, 9, 10, 3]])
    sc = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.5, 0.1, 0.1, 0.9, 0.1, 0.0, 0.0, 0.1]], dtype=torch.float64)
    # sinks 1 (pos 0), protected prefix 2 (pos 0, 1), recent 2 (pos 10, 11)
    prot = protected_mask(pos, 12, sink_tokens=1, recent_tokens=2, protected_prefix=2)
    assert torch.nonzero(prot[0]).flatten().tolist() == [0, 1, 3, 10]
    v = select_victims(sc, pos, 12, 4, sink_tokens=1, recent_tokens=2, protected_prefix=2)
    # candidates by (score, pos): pos 2 (0.0, slot 2), pos 9 (0.0, slot 9), then the 0.1s by
    # position: pos 3 (slot 11), pos 5 (slot 5), pos 6, pos 8
    assert torch.nonzero(v[0]).flatten().tolist() == [2, 5, 9, 11]
    plan = plan_moves(v, 12)
    # new live 8: holes below 8 are slots 2 and 5; live tail slots 8 and 10 fill them
    assert plan.new_live.tolist() == [8]
    assert plan.dst.tolist() == [2, 5] and plan.src.tolist() == [8, 10] and plan.rows.tolist() == [0, 0]


def test_ragged_batch_k_zero_to_all(method):
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 0, 0], [5, 4, 3, 2, 1, 0]])
    sc = torch.tensor([[6, 5, 4, 3, 2, 1], [1, 1, 1, 9, 9, 9], [1, 2, 3, 4, 5, 6]], dtype=torch.float32)
    v = select_victims(sc, pos, torch.tensor([6, 3, 6]), torch.tensor([0, 2, 99]))
    assert v.int().tolist() == [[0] * 6, [1, 1, 0, 0, 0, 0], [1] * 6]
    plan = plan_moves(v, torch.tensor([6, 3, 6]))
    assert plan.new_live.tolist() == [6, 1, 0]
    assert plan.rows.tolist() == [1] and plan.dst.tolist() == [0] and plan.src.tolist() == [2]


def test_global_slots_follow_the_block_table():
    bt = torch.tensor([[7, 3, 9], [2, 5, 0]])
    rows, slots = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 5, 4, 7])
    assert global_slots(bt, rows, slots, 4).tolist() == [28, 13, 20, 23]


@pytest.mark.parametrize("bad, msg", [
    (dict(num_live=torch.tensor([1.0])), "num_live has dtype torch.float32"),
    (dict(num_live=torch.tensor([1, 2])), r"num_live has shape \(2,\); expected \(1,\)"),
    (dict(num_live=9), "num_live has an entry above N = 4"),
    (dict(num_to_evict=True), "num_to_evict = True"),
])
def test_bad_arguments_name_the_field(bad, msg):
    args = dict(scores=torch.zeros(1, 4), logical_pos=torch.arange(4)[None], num_live=4, num_to_evict=1) | bad
    with pytest.raises(ValueError, match=msg):
        select_victims(**args)
