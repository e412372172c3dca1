"""vLLM execution paths the engine tests run on, and the environment that selects each.

* ``v1-sync``: the legacy V1 model runner, sync scheduling (vLLM's choice on this CPU).
* ``mrv2-sync``: Model Runner V2 (vLLM's default on GPUs), sync scheduling.
* ``mrv2-async``: Model Runner V2 with async scheduling (``AsyncScheduler``, batch queue 2):
  vLLM's default path on GPUs.

The MRV2 and async paths need the test-only shims in ``tests/shims/sitecustomize.py``
(Triton interpreter with a stand-in CPU backend; async scheduling put back after the CPU
platform turns it off); they reach vLLM's spawned processes through ``PYTHONPATH``.
Each engine run reports the path it actually took (``harness`` output ``paths``), and the
tests assert it (:data:`EXPECTED`).
"""

from __future__ import annotations

import os
from pathlib import Path

SHIMS = Path(__file__).resolve().parent / "shims"

_ENV = {
    "v1-sync": {},
    "mrv2-sync": {"VTOKEN_TEST_MRV2": "1"},
    "mrv2-async": {"VTOKEN_TEST_MRV2": "1", "VTOKEN_TEST_ASYNC": "1"},
}
PATHS = list(_ENV)

#: what the harness must report for each path (scheduler class, runner class, async, batch queue)
EXPECTED = {
    "v1-sync": dict(scheduler="vtoken.integrations.vllm.sched.scheduler.VTokenScheduler",
                    runner="vtoken.integrations.vllm.worker.runner_v1.VTokenCPUModelRunner",
                    use_v2_model_runner=False, async_scheduling=False, batch_queue=1),
    "mrv2-sync": dict(scheduler="vtoken.integrations.vllm.sched.scheduler.VTokenScheduler",
                      runner="vtoken.integrations.vllm.worker.runner_v2.VTokenCPUModelRunnerV2",
                      use_v2_model_runner=True, async_scheduling=False, batch_queue=1),
    "mrv2-async": dict(scheduler="vtoken.integrations.vllm.sched.scheduler.VTokenAsyncScheduler",
                       runner="vtoken.integrations.vllm.worker.runner_v2.VTokenCPUModelRunnerV2",
                       use_v2_model_runner=True, async_scheduling=True, batch_queue=2),
}


def path_env(name: str) -> dict[str, str]:
    """Environment variables that select execution path ``name`` in a child process."""
    env = dict(_ENV[name])
    if env:
        pp = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = str(SHIMS) + (os.pathsep + pp if pp else "")
    return env
