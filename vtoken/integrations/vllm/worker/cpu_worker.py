"""vToken's CPU worker: builds the vToken adapter of whichever model runner vLLM picked.

``VTokenCPUWorker`` (a ``CPUWorker`` subclass, set as ``parallel_config.worker_cls`` by the
plugin) follows vLLM's choice (``VllmConfig.use_v2_model_runner``):

* the V1 runner: :class:`~vtoken.integrations.vllm.worker.runner_v1.VTokenCPUModelRunner`, built by
  rebinding the module global ``vllm.v1.worker.cpu_worker.CPUModelRunner`` around
  ``init_device``;
* Model Runner V2: :class:`~vtoken.integrations.vllm.worker.runner_v2.VTokenCPUModelRunnerV2`, built
  by rebinding ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` (which ``init_device``
  imports at call time) the same way.

Both adapters share :class:`~vtoken.integrations.vllm.worker.core.VTokenWorkerCore`
(moves, offsets, scores); see their modules for the runner seams.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.integrations.vllm.worker.runner_v1 import VTokenCPUModelRunner
from vtoken.integrations.vllm.worker.scoring import StepScores

__all__ = ["VTokenCPUWorker", "VTokenCPUModelRunner", "StepScores"]


class VTokenCPUWorker(CPUWorker):
    """``CPUWorker`` that builds vToken's adapter of the model runner vLLM chose."""

    def init_device(self) -> None:
        if getattr(self, "use_v2_model_runner", False):
            import vllm.v1.worker.cpu.model_runner as mod

            from vtoken.integrations.vllm.worker.runner_v2 import VTokenCPUModelRunnerV2 as ours
        else:
            import vllm.v1.worker.cpu_worker as mod

            ours = VTokenCPUModelRunner
        orig = mod.CPUModelRunner
        mod.CPUModelRunner = ours
        try:
            super().init_device()
        finally:
            mod.CPUModelRunner = orig
