"""The front end and start-up checks: request validation (the raw-JSON guard, beam search),
the refusals table, platform and attention-backend checks.

The payload between the scheduler and the workers is ``vtoken.integrations.vllm.protocol``.
"""
