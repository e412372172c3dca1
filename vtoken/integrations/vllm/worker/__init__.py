"""The worker side: vToken's workers and model-runner adapters, the runner-neutral worker core
(moves, physical addressing, scoring), ``decide_on: worker``'s decisions, KV layouts, CUDA graphs.

The payload between the scheduler and the workers is ``vtoken.integrations.vllm.protocol``.
"""
