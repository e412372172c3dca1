"""Shared fixtures for the asset tests: they use the real shared cache (built once per machine)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from vtoken.assets import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def sharegpt_paths(smollm2_path):
    from vtoken.assets import ensure_sharegpt, ensure_sharegpt_long

    return ensure_sharegpt(), ensure_sharegpt_long()


@pytest.fixture(scope="session")
def tiny_path():
    from vtoken.assets import ensure_tiny_model

    return ensure_tiny_model()
