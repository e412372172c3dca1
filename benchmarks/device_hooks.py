"""Harness hooks for ``device_check.py``: what the CUDA worker did, read in the engine's process.

``RouteStatsHooks`` (spec ``"hooks": "benchmarks/device_hooks.py:RouteStatsHooks"``) adds, at the end
of a run with the in-process EngineCore and the uniproc executor:

* ``route``: the CUDA-graph dispatch decisions on steps that needed scores
  (``cudagraphs.RouteStats``: ``scored``, ``rerouted`` (vLLM would have replayed a FULL graph),
  ``modes``; FULL must never appear);
* ``runner``: the model runner's class, ``cudagraph_mode`` as vLLM resolved it, and the KV layout;
* ``moves_launched``: Triton move launches (one per step with moves).
"""

from __future__ import annotations

from typing import Any

from drivers.harness import RunHooks


class RouteStatsHooks(RunHooks):
    def attach(self, engine, sched) -> None:
        self.engine = engine

    def finish(self, out: dict[str, Any]) -> None:
        try:
            core = self.engine.engine_core.engine_core
            runner = core.model_executor.driver_worker.worker.model_runner
        except AttributeError as exc:  # multiprocess executor: not reachable from here
            out["route"] = dict(error=f"runner not reachable: {exc}")
            return
        route = getattr(runner, "_vt_route", None)
        out["route"] = None if route is None else dict(scored=route.scored, rerouted=route.rerouted,
                                                       modes=dict(route.modes))
        vt = getattr(runner, "_vt", None)
        cc = self.engine.vllm_config.compilation_config
        out["runner"] = dict(cls=f"{type(runner).__module__}.{type(runner).__qualname__}",
                             cudagraph_mode=str(cc.cudagraph_mode),
                             kv_layout=getattr(getattr(vt, "layout", None), "layout", None))
        out["moves_launched"] = getattr(vt, "moves_launched", None)
