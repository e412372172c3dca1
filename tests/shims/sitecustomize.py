"""Test-only shims that put vLLM's default GPU execution path on this CPU machine.

Loaded by every Python process whose ``PYTHONPATH`` starts with this directory (the
tests set it for the engine subprocesses, so vLLM's spawned EngineCore and worker
processes get it too). Nothing here ships in the ``vtoken`` package.

``VTOKEN_TEST_MRV2=1``
    Model Runner V2 runs under Triton's interpreter. vLLM's
    ``vllm/triton_utils/importing.py`` enables Triton on a CPU build only when
    ``triton.backends.backends`` has a ``"cpu"`` entry; the PyPI Triton wheel has none,
    and the interpreter needs no driver, so a stand-in entry (whose driver is never
    active) is added before vLLM is imported. Also sets ``TRITON_INTERPRET=1`` and
    ``VLLM_USE_V2_MODEL_RUNNER=1`` unless they are set already.

``VTOKEN_TEST_ASYNC=1``
    Async scheduling on CPU: ``CpuPlatform.check_and_update_config`` sets
    ``scheduler_config.async_scheduling = False``; this wraps it (once
    ``vllm.platforms.cpu`` is imported) to set it back to True afterwards, which gives
    vLLM's ``AsyncScheduler`` path with a batch queue of 2.
"""

import os
import sys


def _install_triton_cpu_standin() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        import triton.backends as tb
    except ImportError:  # pragma: no cover - triton is a vLLM dependency
        return

    class _InactiveDriver:
        @staticmethod
        def is_active() -> bool:
            return False

    if "cpu" not in tb.backends:
        tb.backends["cpu"] = tb.Backend(compiler=None, driver=_InactiveDriver)


def _patch_when_imported(module_name: str, patch) -> None:
    """Run ``patch(module)`` right after ``module_name`` is first imported."""
    import importlib.abc
    import importlib.machinery

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            orig_exec = spec.loader.exec_module

            def exec_module(module):
                orig_exec(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


def _force_async(cpu_mod) -> None:
    plat = cpu_mod.CpuPlatform
    orig = plat.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    plat.check_and_update_config = classmethod(check_and_update_config)


if os.environ.get("VTOKEN_TEST_MRV2") == "1":
    _install_triton_cpu_standin()
if os.environ.get("VTOKEN_TEST_ASYNC") == "1":
    _patch_when_imported("vllm.platforms.cpu", _force_async)
