"""The worker side: vToken's workers and model-runner adapters, the runner-neutral worker step
(``step.py``: moves, physical addressing, scoring), the worker's eviction step (``eviction.py``:
which tokens go), KV layouts, CUDA graphs.

The payload between the scheduler and the workers is ``vtoken.integrations.vllm.protocol``.
"""
