"""vToken's CPU worker: builds the vToken adapter of whichever model runner vLLM picked.

``VTokenCPUWorker`` (a ``CPUWorker`` subclass, set as ``parallel_config.worker_cls`` by the
plugin) follows vLLM's choice (``VllmConfig.use_v2_model_runner``):

* the V1 runner: :class:`~vtoken.integrations.vllm.worker.runner_v1.VTokenCPUModelRunner`, built by
  rebinding the module global ``vllm.v1.worker.cpu_worker.CPUModelRunner`` around
  ``init_device``;
* Model Runner V2: :class:`~vtoken.integrations.vllm.worker.runner_v2.VTokenCPUModelRunnerV2`, built
  by rebinding ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` (which ``init_device``
  imports at call time) the same way.

Both adapters share :class:`~vtoken.integrations.vllm.worker.step.WorkerStep`
(moves, offsets, scores); see their modules for the runner seams.
``determine_available_memory`` counts the side cache against the KV cache's memory.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.integrations.vllm.worker.eviction import reserve_side_cache
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

    def determine_available_memory(self) -> int:
        """vLLM's KV-cache bytes, less the side cache of the engine's policy, which
        shadows every KV slot (:func:`~vtoken.integrations.vllm.worker.eviction.reserve_side_cache`:
        both are sized together and the split is logged)."""
        available = super().determine_available_memory()
        specs = list(self.get_kv_cache_spec().values())
        if not specs:
            return available
        kv_per_token = sum(s.page_size_bytes // s.block_size for s in specs)
        return reserve_side_cache((self.vllm_config.additional_config or {}).get("vtoken"), kv_per_token, len(specs),
                                  specs[0].num_kv_heads, available, self.cache_config.num_gpu_blocks_override)
