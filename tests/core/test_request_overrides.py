"""Per-request overrides follow the engine config's rules (issue 15, items 1 and 2).

One parser, one rule: each bad value of ``vtoken_budget`` / ``vtoken_policy`` is refused
exactly as the same value of ``budget`` / ``policy`` is at start-up, with the same message
after the field name; each good value parses to the same result on both paths. And a
request's effective config (overrides applied to the engine's) is validated as a whole:
an override that contradicts the engine config names the request field.
"""

from __future__ import annotations

import pytest

from vtoken.config import VTokenConfigError, parse_config, parse_request_overrides

# (engine field, request field, value)
BAD = [
    ("budget", "vtoken_budget", True),
    ("budget", "vtoken_budget", False),
    ("budget", "vtoken_budget", 0),
    ("budget", "vtoken_budget", -7),
    ("budget", "vtoken_budget", 1.5),
    ("budget", "vtoken_budget", "abc"),
    ("budget", "vtoken_budget", [40]),
    ("budget", "vtoken_budget", {"n": 40}),
    # issue 28: integer fields take JSON integers only, on both paths (no string or float coercion)
    ("budget", "vtoken_budget", "40"),
    ("budget", "vtoken_budget", 40.0),
    ("budget", "vtoken_budget", 1e30),
    ("policy", "vtoken_policy", "lru"),
    ("policy", "vtoken_policy", 3),
    ("policy", "vtoken_policy", True),
]
GOOD = [
    ("budget", "vtoken_budget", 40, 40),
    ("budget", "vtoken_budget", 2**63, 2**63),  # the front end bounds it by max_model_len (test_server.py)
    ("policy", "vtoken_policy", "tova", "tova"),
]


def _engine_msg(field, value) -> str:
    with pytest.raises(VTokenConfigError) as ei:
        parse_config({field: value})
    return str(ei.value)


def _request_msg(field, value) -> str:
    with pytest.raises(VTokenConfigError) as ei:
        parse_request_overrides({field: value})
    return str(ei.value)


@pytest.mark.parametrize("field, rfield, value", BAD, ids=[f"{r}={v!r}" for _, r, v in BAD])
def test_bad_value_same_refusal_on_both_paths(field, rfield, value):
    e, r = _engine_msg(field, value), _request_msg(rfield, value)
    head_e, head_r = f"vtoken.{field} = {value!r}: ", f"vllm_xargs.{rfield} = {value!r}: "
    assert e.startswith(head_e), e
    assert r.startswith(head_r), r
    assert e[len(head_e):] == r[len(head_r):]


def test_boolean_budget_refused_with_the_start_up_message():
    e = _engine_msg("budget", True)
    assert e.startswith("vtoken.budget = True: ") and "not a boolean" in e
    assert _request_msg("vtoken_budget", True) == e.replace("vtoken.budget = ", "vllm_xargs.vtoken_budget = ", 1)


@pytest.mark.parametrize("field, rfield, value, want", GOOD)
def test_good_value_same_result_on_both_paths(field, rfield, value, want):
    assert getattr(parse_config({field: value}), field) == want
    assert getattr(parse_request_overrides({rfield: value}), rfield) == want


@pytest.mark.parametrize("value, want", [(True, True), (False, False), (0, False), (1, True), ("false", False),
                                         ("TRUE", True)])
def test_enable_accepts_booleans_and_their_xargs_forms(value, want):
    assert parse_request_overrides({"vtoken_enable": value}).vtoken_enable is want


@pytest.mark.parametrize("value, msg", [
    ("40", "vllm_xargs.vtoken_budget = '40': Input should be a valid integer; allowed: a JSON integer (not a "
           "string, a float or a boolean)"),
    (None, "vllm_xargs.vtoken_budget = None: expected an integer >= 1; leave the key out to use the engine's budget"),
])
def test_budget_refusal_is_one_line_naming_the_field(value, msg):
    assert _request_msg("vtoken_budget", value) == msg


def test_null_policy_refused():
    assert _request_msg("vtoken_policy", None).startswith("vllm_xargs.vtoken_policy = None: expected a policy name")


@pytest.mark.parametrize("value", [2, "maybe", 0.5, None])
def test_enable_refuses_the_rest(value):
    assert _request_msg("vtoken_enable", value).startswith(f"vllm_xargs.vtoken_enable = {value!r}: ")


# ---------------------------------------------------------------------- effective config
ENGINE = {"policy": "h2o", "budget": 64, "sink_tokens": 4}


def _start_up(vt) -> str:
    with pytest.raises(VTokenConfigError) as ei:
        parse_config(vt)
    return str(ei.value)


@pytest.mark.parametrize("xargs, head, engine_equiv", [
    ({"vtoken_budget": 1}, "vllm_xargs.vtoken_budget = 1", dict(ENGINE, budget=1)),
    ({"vtoken_budget": 3}, "vllm_xargs.vtoken_budget = 3", dict(ENGINE, budget=3)),
    ({"vtoken_budget": 2, "vtoken_policy": "streaming"},
     "vllm_xargs.vtoken_budget = 2, vllm_xargs.vtoken_policy = 'streaming'",
     dict(ENGINE, budget=2, policy="streaming")),
])
def test_override_contradicting_the_engine_names_the_field(xargs, head, engine_equiv):
    """The message: the request's field(s), then the start-up error of the same effective config."""
    base = parse_config(ENGINE)
    ov = parse_request_overrides(xargs)  # each field alone is fine
    with pytest.raises(VTokenConfigError) as ei:
        ov.apply(base)
    engine_msg = _start_up(engine_equiv)
    assert "vtoken.sink_tokens" in engine_msg and "exceeds vtoken.budget" in engine_msg
    assert str(ei.value) == f"{head}: contradicts the engine's vtoken config: {engine_msg}"


@pytest.mark.parametrize("xargs, budget, policy", [
    ({"vtoken_budget": 4}, 4, "h2o"),  # exactly the protections: allowed
    ({"vtoken_budget": 40, "vtoken_policy": "tova"}, 40, "tova"),
    ({}, 64, "h2o"),
])
def test_consistent_override_applies(xargs, budget, policy):
    eff = parse_request_overrides(xargs).apply(parse_config(ENGINE))
    assert (eff.budget, eff.policy, eff.sink_tokens) == (budget, policy, 4)
