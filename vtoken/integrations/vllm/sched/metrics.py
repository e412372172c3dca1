"""vToken's Prometheus metrics (``vtoken:*``), exported on the OpenAI server's ``/metrics``.

Names follow vLLM's own (``vllm:num_requests_running`` ...), with the same labels
``model_name`` and ``engine``:

==================================  =======  =================================================
name                                kind     meaning
==================================  =======  =================================================
``vtoken:live_tokens``              gauge    live (physical) tokens of the requests vToken tracks
``vtoken:logical_tokens``           gauge    logical tokens (ever seen) of those requests
``vtoken:retained_blocks``          gauge    KV blocks those requests hold
``vtoken:naive_retained_blocks``    gauge    blocks Naive-Evict would hold for the same decisions
``vtoken:dense_blocks``             gauge    sum over requests of ``ceil(live / block_size)``
``vtoken:evicting_requests``        gauge    requests that have evicted at least one token
``vtoken:evicted_tokens_total``     counter  tokens evicted
``vtoken:moved_tokens_total``       counter  token moves (holes filled from the tail; every token set)
``vtoken:freed_blocks_total``       counter  tail blocks returned to the block pool
``vtoken:evictions_total``          counter  eviction events (one per request and step)
``vtoken:repack_seconds_total``     counter  time spent on eviction (scheduler counts, worker selects and moves)
``vtoken:preemption_resets_total``  counter  vLLM preempted a vToken request (resumed with its saved K/V)
``vtoken:request_faults_total``     counter  faults confined to one request (a worker fault ends it with an error)
``vtoken:tokens_above_budget``      gauge    pressure pacing: live tokens kept above budget
``vtoken:pressure_events_total``    counter  pressure pacing: steps where the pool was short
``vtoken:pressure_evictions_total`` counter  pressure pacing: eviction events under pressure
``vtoken:shortfalls_covered_total`` counter  pressure pacing: short steps fully covered (preemptions avoided)
``vtoken:prefill_evictions_total``  counter  prefill_eviction chunks: evictions before a prefill chunk
``vtoken:unshared_blocks_total``    counter  prefix caching: cached blocks copied into private ones at a first eviction
``vtoken:unshare_deferred_total``   counter  prefix caching: first evictions deferred (no free blocks for the copies)
``vtoken:request_peak_blocks``      histo.   per finished request: the most KV blocks it held after a ``schedule()``
==================================  =======  =================================================

Gauges are the state after the last ``schedule()`` (and after the engine goes idle: the
scheduler publishes once more when its last request finishes or is aborted); counters are mirrored from the scheduler's monotonic
:class:`~vtoken.integrations.vllm.sched.scheduler.VTokenStats`; the histogram is observed once per
finished (or aborted) request, from its lifetime figures.

The bridge between processes
----------------------------
The scheduler runs in the EngineCore process, ``/metrics`` is served by the API-server
process. Only vToken's own metrics cross: :func:`setup_prometheus_bridge` runs in process 0
while the engine config is built (before the EngineCore starts): it makes a temporary
directory, names it in ``VTOKEN_PROMETHEUS_DIR`` (inherited by the EngineCore) and registers
a ``prometheus_client`` ``MultiProcessCollector`` over it in the default registry, which
``/metrics`` serves. The EngineCore's :class:`VTokenMetrics` write their values there
(prometheus_client's file-backed values, for these metrics only). vLLM's own metrics stay
in-process: Prometheus multiprocess mode for all of them (``PROMETHEUS_MULTIPROC_DIR``) would
make every front-end metric update (several per token) a file write. Where ``PROMETHEUS_MULTIPROC_DIR`` is set already (by the user, or
by vLLM with ``--api-server-count > 1``), vLLM's registry collects that directory and vToken
writes there instead.

Where the engine runs decides, not the variable alone: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps only a *synchronous* engine (``LLM``, ``LLMEngine``) in this process, and then there
is nothing to bridge and nothing changes. An asynchronous client (the OpenAI server's
``AsyncLLM``) always starts the EngineCore in its own process, whatever the variable says;
so with the variable at 0 the bridge is set up when such a client is made
(``EngineCoreClient.make_async_mp_client``, before it starts the EngineCore process;
patches/ entry of that symbol).
Without the ``vtoken`` key nothing here runs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Optional

import prometheus_client
from prometheus_client import values as _prom_values
from prometheus_client.multiprocess import MultiProcessCollector

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

__all__ = ["VTokenMetrics", "setup_prometheus_bridge", "GAUGES", "COUNTERS", "HISTOGRAMS", "UNITS",
           "metrics_table_markdown"]

#: gauge name -> (VTokenStats field, help)
GAUGES: dict[str, tuple[str, str]] = {
    "vtoken:live_tokens": ("live_tokens", "Live (physical) KV tokens of the requests vToken tracks."),
    "vtoken:logical_tokens": ("logical_tokens", "Logical tokens (ever seen) of the requests vToken tracks."),
    "vtoken:retained_blocks": ("retained_blocks", "KV-cache blocks held by the requests vToken tracks."),
    "vtoken:naive_retained_blocks": (
        "naive_retained_blocks", "KV-cache blocks Naive-Evict would hold for the same eviction decisions (from the "
        "worker's dead-block counts, one step late, two under async scheduling)."),
    "vtoken:dense_blocks": ("dense_blocks", "Sum over tracked requests of ceil(live_tokens / block_size)."),
    "vtoken:evicting_requests": ("num_evicting_requests", "Tracked requests that have evicted at least one token."),
    "vtoken:tokens_above_budget": ("tokens_above_budget",
                                   "Pressure pacing: live tokens kept above the requests' budgets (no pressure)."),
}
#: counter name (prometheus_client appends ``_total``) -> (VTokenStats field, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "vtoken:evicted_tokens": ("evicted_tokens", "Tokens evicted from the KV cache."),
    "vtoken:moved_tokens": ("moved_tokens", "Token moves that filled holes from the tail, one per token and token set "
                                        "(counted by the worker of rank 0)."),
    "vtoken:freed_blocks": ("freed_blocks", "Tail KV-cache blocks returned to the block pool."),
    "vtoken:evictions": ("evictions", "Eviction events (one per request and step)."),
    "vtoken:repack_seconds": ("repack_seconds", "Seconds spent on eviction: the scheduler counting how many tokens each "
                                            "request evicts, plus the worker (rank 0) selecting victims, planning and "
                                            "applying the moves."),
    "vtoken:preemption_resets": ("preemption_resets", "Preemptions of vToken requests (under mode vtoken the worker keeps "
                                                        "its live K/V and policy state and restores them at the resume; "
                                                        "under mode naive it restarts from its prompt)."),
    "vtoken:pressure_events": ("pressure_events",
                               "Pressure pacing: steps where a step's block demand plus the watermark exceeded the free blocks."),
    "vtoken:pressure_evictions": ("pressure_evictions", "Pressure pacing: eviction events decided under pressure."),
    "vtoken:shortfalls_covered": ("shortfalls_covered",
                                  "Pressure pacing: short steps whose whole shortfall eviction freed, before vLLM "
                                  "had to preempt (preemptions avoided)."),
    "vtoken:prefill_evictions": ("prefill_evictions",
                                 "prefill_eviction chunks: eviction events before a prefill chunk (a request cut to "
                                 "its budget between the chunks of its prompt)."),
    "vtoken:unshared_blocks": ("unshared_blocks",
                               "Prefix caching: hashed or shared blocks a request copied into private blocks at its "
                               "first eviction (the cached block stays in the cache for other requests)."),
    "vtoken:unshare_deferred": ("unshare_deferred",
                                "Prefix caching: first evictions deferred because the free blocks could not cover "
                                "the copies of the cached blocks (the request keeps its tokens until its next eviction)."),
    "vtoken:prefix_reads_skipped": ("prefix_reads_skipped",
                                    "Prefix caching with prefix_hits skip: requests that did not read the prefix "
                                    "cache (their policy cannot take a hit exactly; they computed their prompt)."),
    "vtoken:same_step_hits_trimmed": ("same_step_hits_trimmed",
                                      "Prefix caching: hits cut short at a block vLLM hashed in the same step (its KV "
                                      "not yet computed; the request computes those tokens itself, as if alone)."),
    "vtoken:request_faults": ("request_faults",
                              "Faults confined to one request (see the log): a bad override turns its eviction "
                              "off; a failure on the worker (policy exception, non-finite statistics) ends it with "
                              "an error."),
}

#: histogram name -> (key of ``RequestState.lifetime()``, help, bucket upper bounds); observed once
#: per finished request
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "vtoken:request_peak_blocks": (
        "peak_blocks", "Per finished request: the most KV-cache blocks it held after any schedule() (prefill chunks "
        "included; with prefill_eviction chunks at most ceil((budget + slack + prefill_eviction_every + 1) / "
        "block_size)).",
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)),
}

#: unit of each metric (by the name in GAUGES / COUNTERS / HISTOGRAMS)
UNITS: dict[str, str] = {
    "vtoken:live_tokens": "tokens",
    "vtoken:logical_tokens": "tokens",
    "vtoken:retained_blocks": "blocks",
    "vtoken:naive_retained_blocks": "blocks",
    "vtoken:dense_blocks": "blocks",
    "vtoken:evicting_requests": "requests",
    "vtoken:evicted_tokens": "tokens",
    "vtoken:moved_tokens": "tokens",
    "vtoken:freed_blocks": "blocks",
    "vtoken:evictions": "events",
    "vtoken:repack_seconds": "seconds",
    "vtoken:preemption_resets": "requests",
    "vtoken:request_faults": "requests",
    "vtoken:prefill_evictions": "events",
    "vtoken:unshared_blocks": "blocks",
    "vtoken:unshare_deferred": "events",
    "vtoken:prefix_reads_skipped": "requests",
    "vtoken:same_step_hits_trimmed": "requests",
    "vtoken:tokens_above_budget": "tokens",
    "vtoken:pressure_events": "steps",
    "vtoken:pressure_evictions": "events",
    "vtoken:shortfalls_covered": "steps",
    "vtoken:request_peak_blocks": "blocks",
}


def metrics_table_markdown() -> str:
    """The README's table of every ``vtoken:`` metric: exported name, type, unit, meaning.

    Generated from :data:`GAUGES`, :data:`COUNTERS`, :data:`HISTOGRAMS` and :data:`UNITS`
    (counters are exported with prometheus_client's ``_total`` suffix, histograms as
    ``_bucket`` / ``_sum`` / ``_count``); every metric has the labels ``model_name`` and ``engine``.
    """
    rows = ["| metric | type | unit | meaning |", "|---|---|---|---|"]
    for name, (_, doc) in GAUGES.items():
        rows.append(f"| `{name}` | gauge | {UNITS[name]} | {doc} |")
    for name, (_, doc) in COUNTERS.items():
        rows.append(f"| `{name}_total` | counter | {UNITS[name]} | {doc} |")
    for name, (_, doc, buckets) in HISTOGRAMS.items():
        rows.append(f"| `{name}` | histogram | {UNITS[name]} | {doc} Buckets: {', '.join(map(str, buckets))}. |")
    return "\n".join(rows) + "\n"


_LABELS = ["model_name", "engine"]
#: the directory the EngineCore writes vToken's metrics to, named by process 0 (:func:`_bridge`)
DIR_ENV = "VTOKEN_PROMETHEUS_DIR"
# One family per (name, directory) per process (a second scheduler in the same process reuses them).
_families: dict[tuple[str, Optional[str]], Any] = {}
_bridge_dir: Optional[tempfile.TemporaryDirectory] = None
_file_values: dict[str, Any] = {}  # directory -> prometheus_client's file-backed value class


def setup_prometheus_bridge() -> Optional[str]:
    """Put this process (and the processes it starts) in Prometheus multiprocess mode.

    Call in process 0 before the EngineCore starts and before vLLM creates its stat
    loggers. Sets ``PROMETHEUS_MULTIPROC_DIR`` to a fresh temporary directory (removed
    at exit) unless it is set already, and makes prometheus_client build multiprocess
    values from now on (it chose its value class when first imported, usually before
    this point). Idempotent. Returns the directory, or None when it is not set up now:
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` a synchronous engine runs in this process
    (nothing to bridge), and the bridge is deferred to the moment an asynchronous client
    starts an EngineCore process (see the module docstring).
    """
    from vllm import envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        _bridge_when_async_client_is_made()
        return None
    return _bridge()


def _bridge_when_async_client_is_made() -> None:
    from vllm.v1.engine.core_client import EngineCoreClient

    orig = EngineCoreClient.make_async_mp_client
    if getattr(orig, "_vtoken_wrapped", False):
        return

    def make_async_mp_client(*args, **kwargs):
        # the EngineCore will run in its own process: bridge before it starts
        _bridge()
        return orig(*args, **kwargs)

    make_async_mp_client._vtoken_wrapped = True
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)


def _bridge() -> str:
    """Process 0: the directory of vToken's metrics and a collector of it in the default registry
    (once per process; a directory inherited from a parent is not reused: it holds another
    server's EngineCore files)."""
    global _bridge_dir
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:  # multiprocess mode already: vLLM's registry collects this directory
        return path
    if _bridge_dir is None:
        _bridge_dir = tempfile.TemporaryDirectory(prefix="vtoken_prom_")
        os.environ[DIR_ENV] = _bridge_dir.name
        MultiProcessCollector(prometheus_client.REGISTRY, path=_bridge_dir.name)
        logger.info("vToken: the EngineCore's vtoken: metrics reach /metrics through %s (%s)", _bridge_dir.name,
                    DIR_ENV)
    return _bridge_dir.name


def _metrics_dir() -> Optional[str]:
    """Where this process's :class:`VTokenMetrics` write (an EngineCore of a bridged server), or
    None: in memory, in the default registry."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(DIR_ENV) or None


def _family(kind: str, name: str, doc: str, buckets: tuple[float, ...] = (), path: Optional[str] = None):
    """The family ``name``: in the default registry, or (``path``) unregistered, its children
    file-backed in ``path`` (:func:`_child`)."""
    fam = _families.get((name, path))
    if fam is None:
        reg = prometheus_client.REGISTRY if path is None else None
        if kind == "histogram":
            fam = prometheus_client.Histogram(name, doc, labelnames=_LABELS, buckets=buckets, registry=reg)
        elif kind == "gauge":
            # livemostrecent: the value of the live EngineCore only (a dead engine's gauge vanishes).
            fam = prometheus_client.Gauge(name, doc, labelnames=_LABELS, multiprocess_mode="livemostrecent",
                                          registry=reg)
        else:
            fam = prometheus_client.Counter(name, doc, labelnames=_LABELS, registry=reg)
        _families[(name, path)] = fam
    return fam


def _child(fam, path: Optional[str], labels: dict[str, str]):
    """``fam.labels(**labels)``; with ``path``, its values written to files in ``path`` (the value
    class prometheus_client reads when a child is made, switched for this call only)."""
    if path is None:
        return fam.labels(**labels)
    cls = _file_values.get(path)
    if cls is None:
        # (read when a value opens its file, and again after a fork: set for this EngineCore process,
        # whose only Prometheus metrics are these; the API server's stay in memory)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        cls = _file_values[path] = _prom_values.MultiProcessValue()
    saved, _prom_values.ValueClass = _prom_values.ValueClass, cls
    try:
        return fam.labels(**labels)
    finally:
        _prom_values.ValueClass = saved


def _labels_from_config(vllm_config) -> tuple[str, str]:
    name = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    pc = vllm_config.parallel_config
    idx = getattr(pc, "data_parallel_index", None)
    if idx is None:
        idx = getattr(pc, "data_parallel_rank", 0) or 0
    return str(name), str(idx)


class VTokenMetrics:
    """Mirrors a scheduler's ``VTokenStats`` into the ``vtoken:`` Prometheus metrics.

    Args:
        model_name, engine: label values (as vLLM's ``model_name`` / ``engine`` labels).
    """

    def __init__(self, model_name: str, engine: str = "0"):
        lv = dict(model_name=model_name, engine=engine)
        path = _metrics_dir()
        self._gauges = [(f, _child(_family("gauge", n, d, path=path), path, lv)) for n, (f, d) in GAUGES.items()]
        self._counters = [(f, _child(_family("counter", n, d, path=path), path, lv))
                          for n, (f, d) in COUNTERS.items()]
        self._histograms = [(k, _child(_family("histogram", n, d, b, path=path), path, lv))
                            for n, (k, d, b) in HISTOGRAMS.items()]
        self._last: dict[str, float] = {f: 0 for f, _ in self._counters}
        self._last_gauges: dict[str, float] = {}
        for f, g in self._gauges:
            g.set(0)
            self._last_gauges[f] = 0

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "VTokenMetrics":
        return cls(*_labels_from_config(vllm_config))

    def observe_finished(self, lifetime: dict) -> None:
        """Observe one finished request's :data:`HISTOGRAMS` figures (``lifetime``: a
        ``RequestState.lifetime()`` dict; a missing or None figure is skipped)."""
        for k, h in self._histograms:
            v = lifetime.get(k)
            if v is not None:
                h.observe(v)

    def update(self, stats) -> None:
        """Publish ``stats`` (a ``VTokenStats``): set the gauges, add counter deltas."""
        for f, g in self._gauges:
            v = getattr(stats, f)
            if v != self._last_gauges[f]:
                g.set(v)
                self._last_gauges[f] = v
        for f, c in self._counters:
            v = getattr(stats, f)
            d = v - self._last[f]
            if d > 0:
                c.inc(d)
                self._last[f] = v
