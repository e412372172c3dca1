"""lm-eval model ``vtoken-completions``: lm-eval's ``local-completions`` with vToken's per-request fields.

Every generation request gets ``vllm_xargs`` built by :func:`bench_tasks.request_xargs` from this
model's own ``model_args`` (``vtoken_policy``, ``vtoken_budget_ratio``, ``vtoken_budget``,
``vtoken_granularity``, ``vtoken_enable``): the ratio becomes a ``vtoken_budget`` in tokens of each
request's own prompt (``ceil(ratio * prompt tokens)``, what the engine's ``budget_ratio`` gives), so
arms that differ only in these fields share one ``vllm serve``. Needs ``tokenized_requests=True``
and ``batch_size=1`` with a ratio (one prompt per request). ``xargs_log=<path>`` appends one JSON line
per request (prompt tokens and the ``vllm_xargs`` sent).

Run as lm-eval's command line with the model registered first::

    .venv/bin/python benchmarks/lm_eval_vtoken.py run --model vtoken-completions \\
        --model_args model=smollm2,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<dir>,\\
        tokenized_requests=True,vtoken_policy=h2o,vtoken_budget_ratio=0.25 --tasks niah_single_1 ...
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tasks import request_xargs  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

_LOCK = threading.Lock()


@register_model("vtoken-completions")
class VTokenCompletions(LocalCompletionsAPI):
    """``local-completions`` that adds ``vllm_xargs`` (vToken's per-request overrides) to each
    generation payload; log-likelihood requests are sent unchanged."""

    def __init__(self, vtoken_policy: Optional[str] = None, vtoken_budget_ratio: Optional[float] = None,
                 vtoken_budget: Optional[int] = None, vtoken_granularity: Optional[str] = None,
                 vtoken_enable: Optional[bool] = None, xargs_log: Optional[str] = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.vtoken_fields = dict(policy=vtoken_policy, budget_ratio=vtoken_budget_ratio, budget=vtoken_budget,
                                  granularity=vtoken_granularity, enable=vtoken_enable)
        self.xargs_log = xargs_log
        if vtoken_budget_ratio is not None and (not self.tokenized_requests or int(self._batch_size) != 1):
            raise ValueError("vtoken_budget_ratio needs tokenized_requests=True and batch_size=1 "
                             "(the budget is computed from each request's own prompt tokens)")

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if not generate:
            return payload
        prompt = payload["prompt"]
        ids = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else prompt
        xargs = request_xargs(ids, **self.vtoken_fields)
        if xargs:
            payload["vllm_xargs"] = xargs
        if self.xargs_log:
            n = len(ids) if isinstance(ids, list) else None
            with _LOCK, open(self.xargs_log, "a") as f:
                f.write(json.dumps(dict(prompt_tokens=n, vllm_xargs=xargs)) + "\n")
        return payload


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
