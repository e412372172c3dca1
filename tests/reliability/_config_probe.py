"""Run ``EngineArgs(...).create_engine_config()`` with the vToken plugin for a table of cases.

``python _config_probe.py CASES.json OUT.json``: each case is ``{"id", "engine": {EngineArgs
kwargs}}``; the output maps id -> ``{"ok": bool, "type": exception class, "module": its
module, "msg": str(exception), "frames": [last traceback frames' files]}``. No engine starts.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> int:
    cases = json.loads(open(sys.argv[1]).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # nothing to bridge for metrics
    import vtoken.integrations.vllm.plugin as plugin

    plugin.register()
    from vllm.engine.arg_utils import EngineArgs

    out = {}
    for c in cases:
        try:
            EngineArgs(**c["engine"]).create_engine_config()
            out[c["id"]] = dict(ok=True)
        except Exception as e:  # noqa: BLE001 - every failure is recorded and judged by the test
            tb = traceback.extract_tb(e.__traceback__)
            out[c["id"]] = dict(ok=False, type=type(e).__name__, module=type(e).__module__, msg=str(e),
                                raised_in=tb[-1].filename if tb else "")
    open(sys.argv[2], "w").write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
