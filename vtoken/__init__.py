"""vToken: token-level KV-cache eviction for vLLM that hands freed blocks back to the block pool.

The core (this package, except ``vtoken.integrations``, the ``vllm`` command of ``vtoken.cli`` and the
``vtoken.patches`` tooling: ``docs/layout.md``) never imports vllm.
"""

__version__ = "0.1.0"
