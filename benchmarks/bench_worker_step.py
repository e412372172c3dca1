"""The worker's eviction step alone (the scheduler says how many, the worker says which): wall
time, dispatched torch ops and host syncs per decode step, at R running requests.

Run:  .venv/bin/python benchmarks/bench_worker_step.py [--quick] [--requests 8 64 256] [--live 2048]
          [--steps 5] [--warmup 2] [--count-steps 2] [--policy h2o] [--granularity head]
          [--layers 30] [--kv-heads 3] [--block-size 32] [--threads 1] [--device cpu]
          [--scores batched|numpy|torch] [--out benchmarks/results/bench_worker_step.json]

Why. The design (``../shared/DESIGN.md``, section 2): the worker's step runs on the device, with no numpy,
no host sync and no Python loop over requests or token sets, from the ``SchedulerOutput`` to the
forward and from the forward's statistics into the side cache. This benchmark counts what the
step does per request, so that a change towards that shows in its figures, and a regression too.

What runs. No model, no vLLM engine, no KV cache: one
:class:`~vtoken.integrations.vllm.worker.eviction.WorkerEviction` on ``--device`` (CPU by
default) with a pool of exactly ``R * cdiv(live, B) + 1`` blocks (block 0 unused, as vLLM's null
block), ``--layers`` x ``--kv-heads`` (30 x 3, SmolLM2-135M's) and granularity ``--granularity``
(``head``: 90 token sets per request), policy ``--policy`` (H2O; the policies whose statistics are
column sums and/or last rows, or none: ``h2o``, ``tova``, ``scissorhands``, ``streaming``,
``random``). Its budget is ``live - 1`` (so ``live`` tokens are the steady state after a decode
step's append, the budget plus the appended token), protections from ``VTokenConfig.protections``.

* **Setup (not measured).** One ``begin`` whose ``StepPayload.states`` starts all R requests
  (``WorkerSpec`` as the scheduler builds it) and whose ``SchedulerOutput`` (a ``SimpleNamespace``
  stand-in with the fields ``begin`` reads: ``finished_req_ids``, ``preempted_req_ids``,
  ``scheduled_new_reqs[i].req_id/.block_ids``, ``scheduled_cached_reqs.req_ids/.new_block_ids/
  .resumed_req_ids``, ``num_scheduled_tokens``) schedules ``live`` tokens each with their
  ``cdiv(live, B)`` blocks (a seeded permutation of the pool's ids), then one ``fold`` of the
  prompt's statistics.
* **A step (measured)** is a steady decode step: ``begin`` with ``payload.evict = {rid: 1}`` for
  every request and one scheduled token each (no new blocks: the evicted slot makes room), which
  returns the K/V moves (not applied: there is no KV cache), then ``fold`` with one step's
  statistics, drawn once from a seeded generator (every step folds the same values), in the
  format ``--scores`` names: ``batched`` (the default; what the engine's worker folds,
  ``StepScores.batched`` in ``vtoken/integrations/vllm/worker/scoring.py``): a
  ``BatchedScores`` whose one-query rows carry float64 tensors on ``--device``, ``[R, L, Hkv,
  live]`` per (layer, KV head) (``[R, live]`` at granularity ``request``), the same values as
  column sums and last rows; ``numpy``: ``StepScores.result``'s ``ScoreMap`` (``protocol.py``),
  req_id -> (col_sum, last_row), float64 numpy ``[S, live]`` (``[live]`` with one set), only the
  arrays the policy needs (H2O: col_sum), which ``fold`` packs request by request;
  ``torch``: the same as float64 tensors on ``--device``. The step's inputs are built outside
  the timer (the scheduler and the forward make them).
  ``WorkerEviction.take_naive_freed``, which the worker calls after the fold, is timed and
  counted as its own phase (``naive``), not in the step's figures.
* **Checks (outside the measured region, every step).** Every request has ``live`` live tokens
  and ``live + steps`` logical ones (the decider's ``live``/``logical`` rows, read once per
  step), each request's Naive-Evict count (``DeviceDecider.dead``, one per evicted (set, token))
  grew by exactly S, i.e. R x S evictions in the step, and every returned move is well formed
  (``src``, ``dst``, ``sets`` of one length, sets in ``[0, S)``, ``src != dst``). After the
  last step, per (set, request): the live slots hold ``live`` distinct logical positions below
  ``logical``, the sinks and the whole recent window among them: so each set evicted one token
  per step.

What is measured, per R (``--requests``; each R in a fresh ``WorkerEviction``):

* **wall time**: median (min, max) ms of ``begin``, ``fold``, their sum (the step) and
  ``take_naive_freed``, over ``--steps`` steps after ``--warmup`` steps (``time.perf_counter_ns``;
  ``torch.cuda.synchronize()`` after each phase on CUDA), torch on ``--threads`` threads (1:
  two OpenMP threads on the shared 2-core machine cost waits), glibc's malloc thresholds raised
  first as in ``bench_scheduler.py`` (``tune_cpu_malloc``). No instrumentation is active.
* **counts**, over ``--count-steps`` further steps (the figures of the last; ``stable`` says
  whether all of them agreed), with every counter below on at once:

  - ``ops``: every aten op dispatched, counted by a
    ``torch.utils._python_dispatch.TorchDispatchMode`` subclass (:class:`Instrument`): ops after
    autograd and after CompositeImplicit decompositions, views included, each op once (its
    kernel's own nested calls are not seen). ``torch.tensor``/``torch.from_numpy`` show up as
    ``aten::lift_fresh``, ``Tensor.numpy()`` as ``aten::detach``.
  - host syncs, in three categories (``host_syncs`` is their sum):
    ``local_scalar_dense``: ``aten::_local_scalar_dense`` ops (``.item()``, ``int(t)``,
    ``bool(t)``, ``float(t)``);
    ``to_host``: calls of ``Tensor.cpu``, ``Tensor.numpy``, ``Tensor.tolist`` (wrapped for the
    measured step; on CPU they dispatch nothing) on a tensor that would live on the device (not
    the result of a ``.cpu()``, ``torch.from_numpy`` or a ``torch.tensor`` without ``device``),
    plus device-to-host ``_to_copy``/``copy_`` ops outside those calls (CUDA only);
    ``data_dependent``: ops whose output shape depends on tensor values, a sync on CUDA
    (``nonzero``, ``masked_select``, ``unique*``, ``repeat_interleave`` without ``output_size``,
    ``index``/``index_put`` with a boolean index, e.g. ``t[mask]``, ``t[mask] = v``).
  - ``uploads``: ``torch.from_numpy`` and ``torch.tensor``/``torch.as_tensor`` of host data
    (lists, numpy, scalars): wrapped; ``upload_bytes`` their tensors' bytes (a host-to-device
    copy on a GPU: ``fold``'s statistics come from the host), ``to_host_bytes`` the bytes of the
    ``to_host`` reads.
  - ``numpy_calls``: top-level calls of the ``numpy`` namespace's functions (``np.zeros``, ...;
    wrapped: not ufuncs, not ndarray methods or indexing, so a per-request ``col[i] = c`` copy
    shows in ``py_lines``, not here).
  - ``py_calls``: each wrapped Python call by name (``item``, ``tolist``, ``numpy``, ``cpu``,
    ``from_numpy``, ``tensor``, ``as_tensor``), all of them, whatever the tensor.
  - ``py_lines`` / ``py_funcs``: Python lines executed and functions called in ``vtoken/``
    during the step (``sys.settrace``): a Python loop over requests or token sets shows as a
    slope here. Each traced line is also charged the wall time until the next traced event (its
    Python and the torch/numpy work it calls): ``line_ms`` (under tracing, so an overestimate
    for cheap lines; the tensor-heavy lines' times are the real ones).

* **call sites**: every counted event is filed under the innermost frame of
  ``vtoken/integrations/vllm/worker/eviction.py`` or ``vtoken/side_cache.py`` on the stack
  (``focus``: the lines the step's own code runs), under all of those frames (``chain``:
  ``site < caller < ...``), and under the innermost frame anywhere in ``vtoken/`` (``inner``:
  select.py, the policies); ``py_lines`` and ``line_ms`` per line. For each site the slope per
  request between the smallest and the largest R, and whether the counts are linear in R
  (``a + b R`` exactly at every R); ``sources`` gives the files' sha256 and commit the line
  numbers belong to.

* **growth**: per category, the step's count at each R, its slope per request
  ``(c(R_max) - c(R_min)) / (R_max - R_min)`` and ``flat`` (the same count at every R).

Outputs: a table on stdout (tqdm progress on stderr), the sites that grow with R, and
``benchmarks/results/bench_worker_step.json`` (or ``--out``): the command, date, torch/numpy/python
versions, machine, load average before and after, the settings, the counter's description, per R
the timings, counts per phase, op names, checks and call sites, and ``growth``.
``--quick``: R = 8 and 32, 256 live tokens, 3 steps (a few seconds). The default run takes
about 80 s on the 2-core machine and peaks at about 4.7 GB resident (R = 256: the side cache of
90 sets x 524,320 slots x 16 bytes, 755 MB, and the step's ``[S*R, live]`` temporaries).
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import gc
import json
import linecache
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vtoken.config import VTokenConfig  # noqa: E402
from vtoken.integrations.vllm.protocol import StepPayload, WorkerSpec  # noqa: E402
from vtoken.integrations.vllm.worker.eviction import WorkerEviction, num_sets  # noqa: E402
from vtoken.integrations.vllm.worker.scoring import BatchedScores  # noqa: E402
from vtoken.policies.base import AttentionNeed  # noqa: E402
from vtoken.counts import evictable  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_worker_step.json"
VTOKEN_DIR = str(ROOT / "vtoken") + os.sep
FOCUS = (str(ROOT / "vtoken" / "integrations" / "vllm" / "worker" / "eviction.py"), str(ROOT / "vtoken" / "side_cache.py"))
#: policies whose step statistics are column sums and/or last rows (or none): what ``fold`` takes
POLICIES = ("h2o", "tova", "scissorhands", "streaming", "random")
PHASES = ("begin", "fold", "naive")
STEP_PHASES = ("begin", "fold")
#: the count categories (``growth`` and the tables); ``host_syncs`` is the sum of the three before it
CATEGORIES = ("ops", "local_scalar_dense", "to_host", "data_dependent", "host_syncs", "uploads", "numpy_calls",
              "py_lines", "py_funcs", "upload_bytes", "to_host_bytes")
PY_CALLS = ("item", "tolist", "numpy", "cpu", "from_numpy", "tensor", "as_tensor")
#: aten ops whose output shape depends on tensor values (a host sync on CUDA)
DATA_DEPENDENT = {"aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                  "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::argwhere"}
BOOL_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
                "aten::_unsafe_index_put", "aten::_unsafe_index"}
OUTSIDE = "(outside vtoken)"
_ABSENT = object()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# counters


def numpy_functions() -> list[str]:
    """Names of the public functions in the ``numpy`` namespace that :class:`Instrument` wraps
    (Python functions, builtins and array-function dispatchers; not ufuncs, types or modules,
    whose attributes code reads, e.g. ``np.add.reduce``)."""
    import types

    out = []
    for name in dir(np):
        if name.startswith("_"):
            continue
        obj = getattr(np, name, None)
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)) or type(obj).__name__ == "_ArrayFunctionDispatcher":
            out.append(name)
    return out


def _site(frame, prefixes: tuple[str, ...]) -> str:
    """``path:function:line`` of the innermost frame from ``frame`` outwards whose file starts
    with one of ``prefixes`` (relative to the repository), or :data:`OUTSIDE`."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith(prefixes):
            return f"{os.path.relpath(fn, ROOT)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return OUTSIDE


def _chain(frame) -> str:
    """Every frame of eviction.py/side_cache.py on the stack, innermost first (``site < caller <
    ...``), or :data:`OUTSIDE`."""
    out = []
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith(FOCUS):
            out.append(f"{os.path.relpath(fn, ROOT)}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out) or OUTSIDE


class Counts:
    """What :class:`Instrument` counted in one phase: ``cats`` (category -> n, :data:`CATEGORIES`),
    ``ops_by_name`` (aten op -> n), ``py_calls`` (wrapped call -> n), ``focus`` / ``inner`` (call
    site -> category -> n) and ``lines`` (``path:function:line`` -> executions)."""

    def __init__(self):
        self.cats: collections.Counter = collections.Counter({c: 0 for c in CATEGORIES})
        self.ops_by_name: collections.Counter = collections.Counter()
        self.py_calls: collections.Counter = collections.Counter({c: 0 for c in PY_CALLS})
        self.focus: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.chain: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.lines: collections.Counter = collections.Counter()
        self.line_ns: collections.Counter = collections.Counter()

    def add(self, other: "Counts") -> "Counts":
        self.cats.update(other.cats)
        self.ops_by_name.update(other.ops_by_name)
        self.py_calls.update(other.py_calls)
        for mine, theirs in ((self.focus, other.focus), (self.inner, other.inner), (self.chain, other.chain)):
            for k, v in theirs.items():
                mine[k].update(v)
        self.lines.update(other.lines)
        self.line_ns.update(other.line_ns)
        return self

    def summary(self) -> dict[str, int]:
        return {c: int(self.cats[c]) for c in CATEGORIES}

    def to_json(self) -> dict[str, Any]:
        def sites(d):
            return {k: {c: int(n) for c, n in sorted(v.items())} for k, v in sorted(d.items())}
        return dict(counts=self.summary(), py_calls={k: int(v) for k, v in sorted(self.py_calls.items())},
                    ops_by_name={k: int(v) for k, v in sorted(self.ops_by_name.items())},
                    focus_sites=sites(self.focus), inner_sites=sites(self.inner), chain_sites=sites(self.chain),
                    lines={k: int(v) for k, v in sorted(self.lines.items())},
                    line_ms={k: round(v / 1e6, 4) for k, v in sorted(self.line_ns.items())})


class Instrument(TorchDispatchMode):
    """Counts a region's dispatched aten ops, host syncs, uploads and Python lines (module
    docstring, "counts"). Use as a context manager; :attr:`phase` names the :class:`Counts` that
    events go to (:attr:`counts`: phase -> Counts).

    While active it replaces ``torch.Tensor.item/.tolist/.numpy/.cpu`` and ``torch.from_numpy``,
    ``torch.tensor``, ``torch.as_tensor`` with counting wrappers and sets a ``sys.settrace``
    function (lines and calls in ``vtoken/``); all are restored on exit.
    """

    def __init__(self, device_type: str = "cpu", trace_lines: bool = True):
        super().__init__()
        self.device_type = device_type
        self.trace_lines = trace_lines
        self.counts: dict[str, Counts] = collections.defaultdict(Counts)
        self.phase = "all"
        self._py_depth = 0  # inside a wrapped Python call: its nested ops are not to_host again
        self._last_cpu: Optional[torch.Tensor] = None  # the result of a ``.cpu()`` just called
        self._np_depth = 0  # inside a wrapped numpy function
        self._line_key: Optional[str] = None  # the vtoken/ line running now (line_ns)
        self._line_t = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._old_trace = None

    # -- events
    def _event(self, cats: Iterable[str], frame, weights: Optional[dict[str, int]] = None) -> None:
        """Count ``cats`` once each (``weights``: category -> amount, e.g. bytes) at ``frame``'s sites."""
        self._last_cpu = None
        c = self.counts[self.phase]
        focus = _site(frame, FOCUS)
        inner = _site(frame, (VTOKEN_DIR,))
        chain = _chain(frame)
        for cat, n in [(cat, 1) for cat in cats] + list((weights or {}).items()):
            c.cats[cat] += n
            c.focus[focus][cat] += n
            c.inner[inner][cat] += n
            c.chain[chain][cat] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name
        cats = ["ops"]
        if name == "aten::_local_scalar_dense":
            cats += ["local_scalar_dense", "host_syncs"]
        elif self._data_dependent(name, func, args, kwargs):
            cats += ["data_dependent", "host_syncs"]
        elif self._py_depth == 0 and self._device_to_host(name, args, kwargs):
            cats += ["to_host", "host_syncs"]
        self.counts[self.phase].ops_by_name[name] += 1
        self._event(cats, sys._getframe(1))
        return func(*args, **kwargs)

    @staticmethod
    def _data_dependent(name: str, func, args, kwargs) -> bool:
        if name in DATA_DEPENDENT:
            return True
        if name == "aten::repeat_interleave":  # the Tensor-repeats overloads, without output_size
            return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        if name in BOOL_INDEXED and len(args) > 1:
            idx = args[1]
            return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                       for t in (idx if isinstance(idx, (list, tuple)) else [idx]))
        return False

    @staticmethod
    def _device_to_host(name: str, args, kwargs) -> bool:
        if name == "aten::_to_copy" and args and isinstance(args[0], torch.Tensor):
            dev = kwargs.get("device")
            return args[0].device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu"
        if name == "aten::copy_" and len(args) > 1 and all(isinstance(a, torch.Tensor) for a in args[:2]):
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        return False

    # -- Python-level wrappers
    def _wrap(self, owner, attr: str, make: Callable[[Callable], Callable]) -> None:
        orig = getattr(owner, attr)
        self._saved.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
        setattr(owner, attr, make(orig))

    def _install(self) -> None:
        inst = self

        def reader(name):  # Tensor.cpu / .numpy / .tolist: a read to the host unless already there
            def make(orig):
                def wrapper(t, *a, **k):
                    frame = sys._getframe(1)
                    cats = ["py:" + name]
                    # on the host already: made there, or ``.cpu()``'s result (on CPU that is the
                    # same object, so only the call right after the ``.cpu()`` is let through)
                    weights = None
                    if not (getattr(t, "_vt_host", False) or inst._last_cpu is t):
                        cats += ["to_host", "host_syncs"]
                        weights = {"to_host_bytes": t.numel() * t.element_size()}
                    inst._event(cats, frame, weights)
                    inst._py_depth += 1
                    try:
                        out = orig(t, *a, **k)
                    finally:
                        inst._py_depth -= 1
                    if name == "cpu" and isinstance(out, torch.Tensor):
                        if out is not t:
                            out._vt_host = True
                        inst._last_cpu = out
                    return out
                return wrapper
            return make

        def item(orig):  # counted as a sync by its aten::_local_scalar_dense op
            def wrapper(t, *a, **k):
                inst._event(["py:item"], sys._getframe(1))
                return orig(t, *a, **k)
            return wrapper

        def upload(name):
            def make(orig):
                def wrapper(data, *a, **k):
                    host = not isinstance(data, torch.Tensor)
                    cats = ["py:" + name] + (["uploads"] if host else [])
                    out = orig(data, *a, **k)
                    weights = {"upload_bytes": out.numel() * out.element_size()} if host and isinstance(
                        out, torch.Tensor) else None
                    inst._event(cats, sys._getframe(1), weights)
                    if host and isinstance(out, torch.Tensor) and (name == "from_numpy" or k.get("device") is None):
                        out._vt_host = True  # host data on the host: its .numpy() reads nothing
                    return out
                return wrapper
            return make

        def numpy_fn(orig):  # a top-level call of a numpy function (not the ones it calls itself)
            def wrapper(*a, **k):
                if inst._np_depth:
                    return orig(*a, **k)
                inst._event(["numpy_calls"], sys._getframe(1))
                inst._np_depth += 1
                try:
                    return orig(*a, **k)
                finally:
                    inst._np_depth -= 1
            return wrapper

        for n in numpy_functions():
            self._wrap(np, n, numpy_fn)
        for n in ("cpu", "numpy", "tolist"):
            self._wrap(torch.Tensor, n, reader(n))
        self._wrap(torch.Tensor, "item", item)
        for n in ("from_numpy", "tensor", "as_tensor"):
            self._wrap(torch, n, upload(n))

    def _restore(self) -> None:
        while self._saved:
            owner, attr, orig = self._saved.pop()
            if orig is _ABSENT:  # inherited (torch.Tensor's methods come from torch._C.TensorBase)
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)

    # -- line tracing
    # Each vtoken/ line is also charged the wall time until the next traced event (its own
    # Python, and the torch and numpy work it calls outside vtoken/): ``line_ns``, under tracing.
    def _charge(self) -> None:
        now = time.perf_counter_ns()
        if self._line_key is not None:
            self.counts[self.phase].line_ns[self._line_key] += now - self._line_t
        self._line_t = now

    @staticmethod
    def _line_site(frame) -> str:
        return f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_code.co_name}:{frame.f_lineno}"

    def _trace_call(self, frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(VTOKEN_DIR):
            return None
        self._charge()
        self._line_key = None
        self.counts[self.phase].cats["py_funcs"] += 1
        return self._trace_line

    def _trace_line(self, frame, event, arg):
        if event == "line":
            self._charge()
            c = self.counts[self.phase]
            c.cats["py_lines"] += 1
            self._line_key = self._line_site(frame)
            c.lines[self._line_key] += 1
        elif event == "return":
            self._charge()
            back = frame.f_back
            self._line_key = (self._line_site(back) if back is not None
                              and back.f_code.co_filename.startswith(VTOKEN_DIR) else None)
        return self._trace_line

    def __enter__(self):
        self._install()
        try:
            out = super().__enter__()
        except BaseException:
            self._restore()
            raise
        if self.trace_lines:
            self._old_trace = sys.gettrace()
            sys.settrace(self._trace_call)
        return out

    def __exit__(self, *exc):
        if self.trace_lines:
            sys.settrace(self._old_trace)
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()


def _split_py(c: Counts) -> Counts:
    """Move ``py:NAME`` events from ``cats`` and the site tables to ``py_calls`` (site tables keep
    them as ``py:NAME``)."""
    for k in [k for k in c.cats if k.startswith("py:")]:
        c.py_calls[k[3:]] += c.cats.pop(k)
    return c


# ----------------------------------------------------------------------------------------------
# the workload


def make_policy(policy: str, live: int, granularity: str):
    """The policy object and its ``WorkerSpec`` as the scheduler builds them, budget ``live - 1``."""
    if policy not in POLICIES:
        raise SystemExit(f"bench_worker_step: policy {policy!r} is not supported here (it needs the KV cache or "
                         f"key statistics); choose from {POLICIES}")
    plan = VTokenConfig(policy=policy, budget=live - 1, granularity=granularity).plan()
    return plan.policy, WorkerSpec(plan)


class WorkerStepBench:
    """One ``WorkerEviction`` holding R requests x ``live`` live tokens (module docstring).

    :meth:`step` runs one decode step (``begin`` + ``fold``, then ``take_naive_freed``) and
    checks it; :meth:`final_check` checks every set's logical positions.
    """

    def __init__(self, num_requests: int, live: int, *, policy: str = "h2o", granularity: str = "head",
                 layers: int = 30, kv_heads: int = 3, block_size: int = 32, device: str = "cpu", seed: int = 0,
                 scores: str = "batched"):
        if scores not in ("batched", "numpy", "torch"):
            raise ValueError(f"scores = {scores!r}; allowed: batched, numpy, torch")
        self.R, self.L, self.B = int(num_requests), int(live), int(block_size)
        self.device = torch.device(device)
        self.policy, self.spec = make_policy(policy, live, granularity)
        self.S = num_sets(self.spec.plan.granularity, layers, kv_heads)
        k = evictable(live, live, self.spec.plan.sink_tokens, self.spec.plan.recent_tokens, 0)
        if k < 1:
            raise ValueError(f"policy {policy!r} at budget {live - 1} protects all {live} live tokens")
        self.nb = cdiv(live, block_size)
        self.num_blocks = self.R * self.nb + 1
        self.wd = WorkerEviction(self.num_blocks, block_size, self.device, num_layers=layers, num_kv_heads=kv_heads)
        self.rids = [f"req-{i}" for i in range(self.R)]
        rng = np.random.default_rng(seed)
        ids = (1 + rng.permutation(self.R * self.nb)).reshape(self.R, self.nb)
        new = [NS(req_id=rid, block_ids=(ids[i].tolist(),)) for i, rid in enumerate(self.rids)]
        so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=new,
                scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
                num_scheduled_tokens={rid: live for rid in self.rids})
        self.wd.begin(so, StepPayload(states={rid: self.spec for rid in self.rids}))
        (self.group,) = self.wd.groups.values()
        self.dec = self.group.dec
        self.rows = torch.tensor([self.wd.where[rid][1] for rid in self.rids], device=self.device)
        # statistics: one draw, every step folds the same values (StepScores.result's format)
        need = self.policy.needs
        self.want_col = bool(need & AttentionNeed.COL_SUM)
        self.want_last = bool(need & AttentionNeed.LAST_ROW)
        # (StepScores.result: [S, live] for a request with token sets, [live] at granularity request)
        shape = (self.R, live) if self.spec.plan.granularity == "request" else (self.R, self.S, live)
        self.stats = {}
        if self.want_col:
            self.stats["col"] = rng.random(shape)
        if self.want_last:
            self.stats["last"] = rng.random(shape)
        if scores == "torch":
            self.stats = {k: torch.from_numpy(v).to(self.device) for k, v in self.stats.items()}
        self.batched_stats = None
        if scores == "batched" and self.stats:
            # StepScores.batched: one tensor per step for every row (column sums and last rows
            # alike); per (layer, KV head) with token sets, the mean over every one without
            per_head = acc = None
            if self.spec.plan.granularity == "request":
                acc = torch.from_numpy(rng.random((self.R, live))).to(self.device)
            else:
                per_head = torch.from_numpy(rng.random((self.R, layers, kv_heads, live))).to(self.device)
            n = np.full(self.R, live, dtype=np.int64)
            need = np.full(self.R, int(need.value), dtype=np.int64)
            self.batched_stats = (n, need, acc, per_head)
        self.scores_format = scores
        self.wd.fold(self.scores())  # the prompt's statistics
        self.sync()
        self.steps = 0
        self.moves_per_step: list[int] = []
        self.check()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def scores(self) -> Any:
        """One step's ``ScoreMap``: req_id -> (col_sum or None, last_row or None), ``[S, live]``
        (``[live]`` at granularity ``request``)."""
        if not self.stats:
            return None
        if self.batched_stats is not None:
            n, need, acc, per_head = self.batched_stats
            return BatchedScores(list(self.rids), n, need, acc, per_head, {}, None)
        col, last = self.stats.get("col"), self.stats.get("last")
        return {rid: (None if col is None else col[i], None if last is None else last[i])
                for i, rid in enumerate(self.rids)}

    def inputs(self) -> tuple[Any, StepPayload, Optional[dict]]:
        """A steady decode step's ``SchedulerOutput`` stand-in, payload and statistics."""
        so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=[],
                scheduled_cached_reqs=NS(req_ids=list(self.rids), new_block_ids=[None] * self.R,
                                         resumed_req_ids=set()),
                num_scheduled_tokens={rid: 1 for rid in self.rids})
        return so, StepPayload(evict={rid: 1 for rid in self.rids}), self.scores()

    def _dead(self) -> torch.Tensor:
        return self.dec.dead[self.rows].sum(1, dtype=torch.int64) if self.dec.dead.shape[1] else torch.zeros(
            self.R, dtype=torch.int64, device=self.device)

    def step(self, inst: Optional[Instrument] = None) -> dict[str, float]:
        """One decode step; returns ms per phase (``begin``, ``fold``, ``naive``). With ``inst``
        (active), its :attr:`Instrument.phase` is set per phase. Checked afterwards."""
        so, payload, scores = self.inputs()
        dead0 = self._dead()
        t = [0] * 4
        if inst is not None:
            inst.phase = "begin"
        t[0] = time.perf_counter_ns()
        moves = self.wd.begin(so, payload)
        self.sync()
        t[1] = time.perf_counter_ns()
        if inst is not None:
            inst.phase = "fold"
        self.wd.fold(scores)
        self.sync()
        t[2] = time.perf_counter_ns()
        if inst is not None:
            inst.phase = "naive"
        self.wd.take_naive_freed()
        self.sync()
        t[3] = time.perf_counter_ns()
        if inst is not None:
            inst.phase = "outside"
        self.steps += 1
        self.check(moves, dead0)
        return {"begin": (t[1] - t[0]) / 1e6, "fold": (t[2] - t[1]) / 1e6, "naive": (t[3] - t[2]) / 1e6}

    def check(self, moves=None, dead0: Optional[torch.Tensor] = None) -> None:
        """Live and logical counts, R x S evictions, well-formed moves (module docstring)."""
        live = self.dec.live[self.rows].tolist()
        logical = self.dec.logical[self.rows].tolist()
        assert live == [self.L] * self.R, f"live counts {sorted(set(live))}, expected {self.L}"
        assert logical == [self.L + self.steps] * self.R, f"logical {sorted(set(logical))}, expected {self.L + self.steps}"
        if moves is None:
            return
        per_row = (self._dead() - dead0).tolist()
        assert per_row == [self.S] * self.R, f"evictions per request {sorted(set(per_row))}, expected {self.S} (one per set)"
        m = 0
        for gran, src, dst, sets in moves:
            assert gran == self.spec.plan.granularity
            assert src.shape == dst.shape == sets.shape and src.dim() == 1
            if src.numel():
                assert bool((src != dst).all()) and int(sets.min()) >= 0 and int(sets.max()) < self.S
                assert int(torch.stack([src, dst]).max()) < self.num_blocks * self.B
            m += src.numel()
        self.moves_per_step.append(int(m))

    def final_check(self) -> dict[str, Any]:
        """Per (set, request): ``live`` distinct positions below ``logical``, sinks and recent window live."""
        table = self.group.table([self.wd.where[rid][1] for rid in self.rids])
        slots, mask = self.dec._slots(self.rows, table, self.L)
        assert bool(mask.all())
        pos = self.dec.side.fields["pos"][:, slots.reshape(-1)].view(self.S, self.R, self.L)
        srt = pos.sort(dim=-1).values
        logical = self.L + self.steps
        assert bool((srt[..., 1:] > srt[..., :-1]).all()), "a set holds a logical position twice"
        assert int(srt[..., 0].min()) >= 0 and int(srt[..., -1].max()) == logical - 1
        sinks, recent = self.spec.plan.sink_tokens, self.spec.plan.recent_tokens
        if recent:
            assert bool(((pos >= logical - recent).sum(-1) == recent).all()), "a recent token was evicted"
        if sinks:
            assert bool(((pos < sinks).sum(-1) == sinks).all()), "a sink token was evicted"
        return dict(sets_checked=self.S * self.R, distinct_live=self.L, logical=logical, sinks=sinks, recent=recent)


# ----------------------------------------------------------------------------------------------
# the run


def tune_cpu_malloc() -> Optional[str]:
    """glibc's mmap and trim thresholds to 1 and 2 GiB, as ``bench_scheduler.tune_cpu_malloc``
    does (big temporaries reuse heap memory instead of fresh zero pages every step)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(-3, 1 << 30) == 1 and libc.mallopt(-1, 1 << 31) == 1
    except (OSError, AttributeError):
        return None
    return "glibc mallopt M_MMAP_THRESHOLD=1GiB M_TRIM_THRESHOLD=2GiB" if ok else None


def _ms(xs: list[float]) -> dict[str, float]:
    return dict(median=round(statistics.median(xs), 4), min=round(min(xs), 4), max=round(max(xs), 4), n=len(xs))


def growth(values: dict[int, float]) -> dict[str, Any]:
    """Per-R values -> ``slope_per_request`` (between the smallest and largest R), ``flat`` (equal
    at every R) and ``linear`` (``a + b R`` exactly at every R)."""
    rs = sorted(values)
    lo, hi = rs[0], rs[-1]
    slope = (values[hi] - values[lo]) / (hi - lo) if hi > lo else 0.0
    base = values[lo] - slope * lo
    return dict(per_R={str(r): values[r] for r in rs}, slope_per_request=slope,
                flat=len({values[r] for r in rs}) == 1,
                linear=all(abs(values[r] - (base + slope * r)) < 1e-9 for r in rs))


def site_growth(per_r: dict[int, dict[str, dict[str, int]]], cat: str, with_source: bool = True) -> list[dict[str, Any]]:
    """Sites whose ``cat`` count changes with R, largest slope first: ``site``, counts per R,
    ``per_request`` slope, ``linear``, the source line."""
    sites = set().union(*(d.keys() for d in per_r.values()))
    out = []
    for s in sites:
        g = growth({r: d.get(s, {}).get(cat, 0) for r, d in per_r.items()})
        if g["flat"]:
            continue
        row = dict(site=s, per_R=g["per_R"], per_request=g["slope_per_request"], linear=g["linear"])
        if with_source and s != OUTSIDE:
            path, _, line = s.split(" < ")[0].rsplit(":", 2)
            row["source"] = linecache.getline(str(ROOT / path), int(line)).strip()
        out.append(row)
    return sorted(out, key=lambda r: (-abs(r["per_request"]), r["site"]))


def run_one(R: int, args, progress: bool = True) -> dict[str, Any]:
    """Build, warm up, time and count one R (module docstring)."""
    t0 = time.perf_counter()
    bench = WorkerStepBench(R, args.live, policy=args.policy, granularity=args.granularity, layers=args.layers,
                            kv_heads=args.kv_heads, block_size=args.block_size, device=args.device, seed=args.seed,
                            scores=args.scores)
    setup_s = time.perf_counter() - t0
    total = args.warmup + args.steps + args.count_steps
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=f"R={R:>4} x {args.live} x {bench.S} sets", file=sys.stderr, leave=False)
    times: dict[str, list[float]] = {p: [] for p in ("step", *PHASES)}
    for i in range(args.warmup + args.steps):
        got = bench.step()
        if i >= args.warmup:
            for p in PHASES:
                times[p].append(got[p])
            times["step"].append(got["begin"] + got["fold"])
        if bar:
            bar.update()
    counted: list[dict[str, Counts]] = []
    for _ in range(args.count_steps):
        inst = Instrument(bench.device.type)
        with inst:
            bench.step(inst)
        counted.append({p: _split_py(inst.counts[p]) for p in PHASES})
        if bar:
            bar.update()
    if bar:
        bar.close()
    final = bench.final_check()
    # the counted step with the fewest ops: a rare step also grows the decider's Naive-Evict
    # table (DeviceDecider.evict, a few ops, amortised), which is not per-request work
    per_step = [{p: c[p].summary() for p in PHASES} for c in counted]
    last = counted[min(range(len(counted)), key=lambda i: (sum(per_step[i][p]["ops"] for p in STEP_PHASES), i))]
    step_counts = Counts().add(last["begin"]).add(last["fold"])
    stable = all(x == per_step[0] for x in per_step)
    row = dict(
        R=R, live=args.live, num_sets=bench.S, num_blocks=bench.num_blocks, side_bytes_per_token=bench.wd.bytes_per_token(),
        setup_s=round(setup_s, 2), wall_s=round(time.perf_counter() - t0, 2),
        ms={p: _ms(v) for p, v in times.items()},
        counts={"step": step_counts.summary(), **{p: last[p].summary() for p in PHASES}},
        py_calls={"step": {k: int(v) for k, v in sorted(step_counts.py_calls.items())},
                  **{p: {k: int(v) for k, v in sorted(last[p].py_calls.items())} for p in PHASES}},
        counts_stable=stable, counted_steps=args.count_steps, counts_per_counted_step=per_step,
        checks=dict(steps=bench.steps, evictions_per_step=R * bench.S, live_every_step=args.live,
                    mean_moves_per_step=round(statistics.mean(bench.moves_per_step), 2), **final),
        detail={p: last[p].to_json() for p in PHASES} | {"step": step_counts.to_json()},
    )
    del bench
    gc.collect()
    return row


def run(args, progress: bool = True) -> dict[str, Any]:
    """The whole benchmark; returns the JSON document (also written to ``args.out`` unless None)."""
    old_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = tune_cpu_malloc() if args.device == "cpu" and not args.default_malloc else None
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows = []
    try:
        for R in args.requests:
            rows.append(run_one(R, args, progress))
            if progress:
                print(_row_line(rows[-1]), flush=True)
    finally:
        torch.set_num_threads(old_threads)
    doc = _document(args, rows, load_before, os.getloadavg(), time.perf_counter() - t0, malloc)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _document(args, rows, load_before, load_after, elapsed, malloc) -> dict[str, Any]:
    by_r = {r["R"]: r for r in rows}
    growth_by_phase = {ph: {c: growth({R: r["counts"][ph][c] for R, r in by_r.items()}) for c in CATEGORIES}
                       for ph in ("step", *PHASES)}
    for ph in ("step", *PHASES):
        growth_by_phase[ph]["ms_median"] = growth({R: r["ms"][ph]["median"] for R, r in by_r.items()})
    sites = {}
    if len(by_r) > 1:
        focus = {R: r["detail"]["step"]["focus_sites"] for R, r in by_r.items()}
        inner = {R: r["detail"]["step"]["inner_sites"] for R, r in by_r.items()}
        lines = {R: {k: {"py_lines": v} for k, v in r["detail"]["step"]["lines"].items()} for R, r in by_r.items()}
        naive = {R: r["detail"]["naive"]["focus_sites"] for R, r in by_r.items()}
        sites = dict(
            ops_focus=site_growth(focus, "ops"), host_syncs_focus=site_growth(focus, "host_syncs"),
            uploads_focus=site_growth(focus, "uploads"), ops_inner=site_growth(inner, "ops"),
            py_lines=site_growth(lines, "py_lines"), naive_ops_focus=site_growth(naive, "ops"),
            naive_py_lines=site_growth({R: {k: {"py_lines": v} for k, v in r["detail"]["naive"]["lines"].items()}
                                        for R, r in by_r.items()}, "py_lines"),
            upload_bytes_focus=site_growth(focus, "upload_bytes"),
            upload_bytes_chain=site_growth({R: r["detail"]["step"]["chain_sites"] for R, r in by_r.items()},
                                           "upload_bytes"),
            to_host_bytes_focus=site_growth(focus, "to_host_bytes"),
            # wall time per vtoken/ line in the (traced) counted step: the 30 fastest-growing
            line_ms=site_growth({R: {k: {"ms": v} for k, v in r["detail"]["step"]["line_ms"].items()}
                                 for R, r in by_r.items()}, "ms")[:30],
        )
    return dict(
        bench="bench_worker_step",
        command=" ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_worker_step.py"] + args.argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        versions=dict(torch=torch.__version__, numpy=np.__version__, python=platform.python_version()),
        machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                     cpu_count=os.cpu_count(), omp_num_threads=os.environ.get("OMP_NUM_THREADS")),
        loadavg_before=[round(x, 2) for x in load_before], loadavg_after=[round(x, 2) for x in load_after],
        elapsed_s=round(elapsed, 1), sources=_sources(),
        settings=dict(requests=list(args.requests), live=args.live, budget=args.live - 1, policy=args.policy,
                      granularity=args.granularity, layers=args.layers, kv_heads=args.kv_heads,
                      block_size=args.block_size, steps=args.steps, warmup=args.warmup, count_steps=args.count_steps,
                      threads=args.threads, device=args.device, scores=args.scores, seed=args.seed,
                      cpu_malloc=malloc),
        counter=("ops: torch.utils._python_dispatch.TorchDispatchMode subclass (aten ops after autograd and "
                 "CompositeImplicit decompositions, views included); local_scalar_dense: aten::_local_scalar_dense; "
                 "to_host: wrapped Tensor.cpu/.numpy/.tolist on tensors not already on the host, plus device-to-host "
                 "_to_copy/copy_ ops outside them; data_dependent: nonzero, masked_select, unique*, "
                 "repeat_interleave without output_size, index/index_put with a boolean index; host_syncs: the sum of "
                 "those three; uploads: wrapped torch.from_numpy and torch.tensor/as_tensor of host data; py_lines/"
                 "py_funcs: sys.settrace line and call events in vtoken/"),
        phases=dict(step="begin + fold", begin="WorkerEviction.begin (evict k=1 + append 1 per request)",
                    fold="WorkerEviction.fold (one step's statistics per request)",
                    naive="WorkerEviction.take_naive_freed (after the fold; not in the step's figures)"),
        rows=rows,
        growth=growth_by_phase["step"],
        growth_by_phase=growth_by_phase,
        sites=sites,
    )


def _sources() -> dict[str, Any]:
    """The commit and the measured files' sha256 (the call sites' line numbers are theirs)."""
    import hashlib
    import subprocess

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - metadata only
            return None

    files = {}
    for f in (*FOCUS, str(ROOT / "vtoken" / "select.py")):
        rel = os.path.relpath(f, ROOT)
        files[rel] = dict(sha256=hashlib.sha256(Path(f).read_bytes()).hexdigest()[:16],
                          modified=bool(git("status", "--porcelain", "--", rel)))
    return dict(git_commit=git("rev-parse", "HEAD") or None, files=files)


def _row_line(r: dict[str, Any]) -> str:
    c, ms = r["counts"]["step"], r["ms"]
    return (f"| {r['R']:>4} | {ms['step']['median']:>9.2f} | {ms['begin']['median']:>9.2f} | {ms['fold']['median']:>9.2f} "
            f"| {c['ops']:>5} | {c['local_scalar_dense']:>4} | {c['to_host']:>4} | {c['data_dependent']:>4} "
            f"| {c['host_syncs']:>5} | {c['uploads']:>4} | {c['upload_bytes'] / 2**20:>9.3f} | {c['numpy_calls']:>4} "
            f"| {c['py_lines']:>6} | {ms['naive']['median']:>8.2f} "
            f"| {r['counts']['naive']['ops']:>4} | {r['counts']['naive']['host_syncs']:>4} |")


HEADER = ("|    R |   step ms |  begin ms |   fold ms |   ops |  lsd | to_host | data-dep | syncs | uploads "
          "| upload MiB | np calls | py lines | naive ms | naive ops | naive syncs |")
RULE = "|" + "---|" * 16


def print_report(doc: dict[str, Any], top: int = 25) -> None:
    s = doc["settings"]
    print(f"\nworker step: {s['policy']} granularity {s['granularity']} ({doc['rows'][0]['num_sets']} sets), "
          f"{s['live']} live tokens, B={s['block_size']}, {s['device']}, {s['threads']} thread(s), "
          f"median of {s['steps']} steps; counts: one step (begin + fold); load {doc['loadavg_before']} -> "
          f"{doc['loadavg_after']}")
    print(HEADER)
    print(RULE)
    for r in doc["rows"]:
        print(_row_line(r))
    print("\ngrowth per request (step):")
    for c in (*CATEGORIES, "ms_median"):
        g = doc["growth"][c]
        print(f"  {c:<20} {'flat' if g['flat'] else 'grows':<6} slope {g['slope_per_request']:+.4g}/request "
              f"({', '.join(f'{k}: {v:g}' for k, v in g['per_R'].items())})")
    for key, title in (("ops_focus", "ops per request by call site in eviction.py/side_cache.py"),
                       ("host_syncs_focus", "host syncs per request by call site"),
                       ("uploads_focus", "uploads per request by call site"),
                       ("upload_bytes_focus", "upload bytes per request by call site"),
                       ("ops_inner", "ops per request by innermost vtoken/ frame"),
                       ("py_lines", "Python lines per request (vtoken/)"),
                       ("naive_ops_focus", "take_naive_freed: ops per request"),
                       ("naive_py_lines", "take_naive_freed: Python lines per request")):
        rows = doc["sites"].get(key) or []
        print(f"\n{title}: {len(rows)} sites grow" + (":" if rows else ""))
        for x in rows[:top]:
            print(f"  {x['per_request']:+8.3f}/req  {x['site']:<62} {x.get('source', '')[:90]}")
    rmax = max(doc["rows"], key=lambda r: r["R"])
    slow = sorted(rmax["detail"]["step"]["line_ms"].items(), key=lambda kv: -kv[1])[:15]
    print(f"\nwall time by vtoken/ line at R={rmax['R']} (the traced counted step, "
          f"{sum(rmax['detail']['step']['line_ms'].values()):.0f} ms in vtoken/ lines):")
    for site, ms in slow:
        path, _, line = site.rsplit(":", 2)
        print(f"  {ms:9.1f} ms  {site:<62} {linecache.getline(str(ROOT / path), int(line)).strip()[:90]}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=None, help="running requests R (default 8 64 256)")
    p.add_argument("--live", type=int, default=None, help="live tokens per request (default 2048)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per R (default 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--count-steps", type=int, default=2, help="instrumented steps per R (the last one's counts)")
    p.add_argument("--policy", default="h2o", choices=POLICIES)
    p.add_argument("--granularity", default="head", choices=("request", "layer", "head", "head_shared"))
    p.add_argument("--layers", type=int, default=30, help="attention layers (SmolLM2-135M: 30)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads per layer (SmolLM2-135M: 3)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--scores", default="batched", choices=("batched", "numpy", "torch"),
                   help="statistics handed to fold: batched (StepScores.batched, the engine's), numpy "
                        "(StepScores.result's ScoreMap) or its arrays as device tensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--default-malloc", action="store_true", help="keep glibc's malloc thresholds")
    p.add_argument("--quick", action="store_true", help="R = 8 32, 256 live tokens, 3 steps")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.requests = a.requests or ([8, 32] if a.quick else [8, 64, 256])
    a.live = a.live or (256 if a.quick else 2048)
    a.steps = a.steps or (3 if a.quick else 5)
    if a.steps < 1 or a.count_steps < 1 or a.warmup < 0 or a.live < 2:
        p.error("--steps and --count-steps >= 1, --warmup >= 0, --live >= 2")
    a.requests = sorted(set(a.requests))
    return a


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(HEADER)
    print(RULE, flush=True)
    doc = run(args)
    print_report(doc)
    if args.out:
        print(f"\nwrote {args.out} ({doc['elapsed_s']} s)")
    return doc


if __name__ == "__main__":
    main()
