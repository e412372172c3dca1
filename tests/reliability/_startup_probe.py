"""Start-up and front-end checks of issue 15 in one process, no engine started.

``python _startup_probe.py CASES.json OUT.json``. Each case is ``{"id", "engine": {EngineArgs
kwargs}, "then": [checks]}``: it runs ``EngineArgs(**engine).create_engine_config()`` with the
vToken plugin registered and records ``ok``, the exception (class, module, message) and the
WARNING records of the ``vllm.vtoken`` logger emitted meanwhile; after a successful config it
runs each check of ``then`` in the same process (the front end that built the config):

* ``{"sampling_params": {extra_args}}``: ``SamplingParams(max_tokens=4, extra_args=...)``;
  records ``ok`` or the ``ValueError`` message;
* ``{"streaming_input": {extra_args}}``: ``AsyncLLM._validate_streaming_input_sampling_params``
  on such params (what vLLM calls for a streaming-input request); records ``ok`` or the error;
* ``{"streaming_add_request": {extra_args}}``: ``AsyncLLM.add_request`` with an async generator
  of ``StreamingInput`` (vLLM's streaming-input API) on an ``AsyncLLM`` without an engine
  (``_NoEngine``: just the attributes ``add_request`` reads before it routes the request);
  records ``ok`` or the error.
* ``{"offline_beam_search": true}``: ``LLM.beam_search`` (``BeamSearchOfflineMixin.beam_search``)
  called on a bare object with one prompt; vToken refuses it before the method reads anything,
  stock vLLM fails on the bare object (AttributeError); records ``ok`` or the error.

A case with ``"compare_stock": true`` first builds the same engine args without the ``vtoken``
key (stock) and records what vToken changed compared with it: ``changed_fields`` (``EngineArgs``
attributes whose value after ``create_engine_config`` differs, ``additional_config`` aside) and
``changed_env`` (environment variables whose value differs), and the resolved
``cache_config.enable_prefix_caching`` of both (``prefix_caching``, ``stock_prefix_caching``).
"""

from __future__ import annotations

import json
import logging
import os
import sys


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


def _streaming_add_request(extra_args: dict) -> None:
    import asyncio
    from types import SimpleNamespace

    from vllm.engine.protocol import StreamingInput
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    class _NoEngine(AsyncLLM):
        errored = False

        def __init__(self):  # no engine: add_request must refuse before it needs one
            self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_sharing_fast_prefill=False))
            self.observability_config = SimpleNamespace(otlp_traces_endpoint=None)

    async def chunks():
        yield StreamingInput(prompt="hello")

    sp = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
    asyncio.run(_NoEngine().add_request("stream-1", chunks(), sp))


def _err(e: BaseException) -> dict:
    return dict(ok=False, type=type(e).__name__, module=type(e).__module__, msg=str(e))


def main() -> int:
    cases = json.loads(open(sys.argv[1]).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # no engine here, nothing to bridge
    import vtoken.integrations.vllm.plugin as plugin

    plugin.register()
    import vllm.entrypoints.llm  # noqa: F401 - loaded before the config is built, as in an LLM user's process
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.sampling_params import BeamSearchParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    cap = _Capture()
    out = {}
    for c in cases:
        stock = None
        if c.get("compare_stock"):
            kw = dict(c["engine"])
            kw.pop("additional_config", None)
            sargs = EngineArgs(**kw)
            scfg = sargs.create_engine_config()
            stock = ({k: repr(v) for k, v in vars(sargs).items()}, dict(os.environ),
                     scfg.cache_config.enable_prefix_caching)
        cap.records.clear()
        # (re)attach: vLLM's logging set-up clears the handlers of vllm.* child loggers
        lg = logging.getLogger("vllm.vtoken")
        if cap not in lg.handlers:
            lg.addHandler(cap)
        args = None
        try:
            args = EngineArgs(**c["engine"])
            vcfg = args.create_engine_config()
            r = dict(ok=True)
        except Exception as e:  # noqa: BLE001 - every failure is recorded and judged by the test
            r = _err(e)
        r["warnings"] = list(cap.records)
        if stock is not None and args is not None:
            after = {k: repr(v) for k, v in vars(args).items()}
            r["changed_fields"] = sorted(k for k in after if k != "additional_config" and after[k] != stock[0].get(k))
            r["changed_env"] = sorted(k for k in set(os.environ) | set(stock[1])
                                      if os.environ.get(k) != stock[1].get(k))
            r["prefix_caching"] = vcfg.cache_config.enable_prefix_caching
            r["stock_prefix_caching"] = stock[2]
        checks = []
        for chk in c.get("then", []) if r["ok"] else []:
            try:
                if "sampling_params" in chk:
                    SamplingParams(max_tokens=4, extra_args=chk["sampling_params"])
                elif "offline_beam_search" in chk:
                    BeamSearchOfflineMixin.beam_search(object(), [{"prompt": "hello"}],
                                                       BeamSearchParams(beam_width=3, max_tokens=4))
                elif "streaming_add_request" in chk:
                    _streaming_add_request(chk["streaming_add_request"])
                else:
                    sp = SamplingParams(max_tokens=4, extra_args=chk["streaming_input"])
                    AsyncLLM._validate_streaming_input_sampling_params(sp)
                checks.append(dict(ok=True))
            except Exception as e:  # noqa: BLE001
                checks.append(_err(e))
        r["then"] = checks
        out[c["id"]] = r
    open(sys.argv[2], "w").write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
