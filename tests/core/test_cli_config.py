"""``vtoken config``: every option and every installed policy's ``policy_args`` with its default."""

from __future__ import annotations

import dataclasses

from vtoken.cli import main, policy_args_schema
from vtoken.config import VTokenConfig
from vtoken.policies import available_policies, get_policy_class


def test_policy_args_are_each_policy_dataclass_fields():
    schema = policy_args_schema()
    assert set(schema) == set(available_policies())
    assert schema["snapkv"] == {"window": "32", "kernel": "7"}
    assert schema["scissorhands"] == {"window": "128"}
    assert schema["h2o"] == {}
    # each listed argument is accepted as policy_args, with that default
    for name, args in schema.items():
        for arg, default in args.items():
            pol = VTokenConfig(policy=name, budget=256, policy_args={arg: int(default)}).make_policy()
            assert getattr(pol, arg) == int(default)
            assert repr(getattr(get_policy_class(name)(), arg)) == default
    assert all(f.name in ("sink_tokens", "recent_tokens", "seed")
               for f in dataclasses.fields(get_policy_class("h2o")))


def test_text_output_lists_prefill_eviction_and_snapkv_args(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "prefill_eviction" in out and '"after" | "chunks"' in out
    assert "snapkv        window=32, kernel=7" in out
