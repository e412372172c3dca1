"""vToken's CUDA worker: vLLM's GPU ``Worker`` building vToken's adapter of the runner vLLM picked.

``VTokenGPUWorker`` is set as ``parallel_config.worker_cls`` by the plugin on CUDA platforms
(``platforms.check_platform``). It overrides ``Worker._make_model_runner``, the override point
vLLM 0.32 documents for subclasses ("Construct the platform's model runner; subclasses
override this"), and follows vLLM's choice (``Worker.use_v2_model_runner``, from
``VllmConfig.use_v2_model_runner``: Model Runner V2 by default on CUDA, V1 when the user
turns it off through vLLM's own environment switch); vToken sets neither:

* V1: :class:`~vtoken.integrations.vllm.worker.gpu_runner.VTokenGPUModelRunner`;
* Model Runner V2: :class:`~vtoken.integrations.vllm.worker.gpu_runner.VTokenGPUModelRunnerV2`;
* an encoder-only multimodal runner (no KV cache to evict): vLLM's own runner, unchanged.

Nothing here has run on a GPU yet (README, "GPU support").
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

__all__ = ["VTokenGPUWorker"]


class VTokenGPUWorker(Worker):
    """vLLM's CUDA ``Worker`` with vToken's model-runner adapters (module docstring)."""

    def _make_model_runner(self):
        if self.vllm_config.is_mm_encoder_only:
            return super()._make_model_runner()
        from vtoken.integrations.vllm.worker.gpu_runner import VTokenGPUModelRunner, VTokenGPUModelRunnerV2

        cls = VTokenGPUModelRunnerV2 if self.use_v2_model_runner else VTokenGPUModelRunner
        return cls(self.vllm_config, self.device)
