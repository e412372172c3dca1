"""The scheduler side (EngineCore): vToken's ``Scheduler`` subclasses, per-request state, block
accounting in the KV manager subclass, invariant checks, ``vtoken:`` metrics.

The payload between the scheduler and the workers is ``vtoken.integrations.vllm.protocol``.
"""
