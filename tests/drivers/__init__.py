"""Test and benchmark drivers (not part of the shipped ``vtoken`` package).

* :mod:`drivers.harness`: run requests through a real in-process vLLM engine in a child process
  and report tokens, blocks and the execution path (tests, benchmarks, soak).
* :mod:`drivers.launcher`: start ``vllm serve`` / the OpenAI server as a child process, wait for
  it and stop it (end-to-end tests, SLA benchmark).

They import ``vtoken`` and vLLM like any user code; nothing in ``vtoken`` imports them.
"""
