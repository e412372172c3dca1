"""VTokenMetrics without a server: gauges mirror the stats, counters add the increments."""

from __future__ import annotations

from prometheus_client import REGISTRY

from vtoken.integrations.vllm.sched.metrics import COUNTERS, GAUGES, VTokenMetrics
from vtoken.integrations.vllm.sched.scheduler import VTokenStats


def _val(name: str, engine: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": "unit", "engine": engine})


def test_update_mirrors_stats():
    m = VTokenMetrics("unit", "7")
    assert all(_val(n, "7") == 0 for n in GAUGES)
    s = VTokenStats(evicted_tokens=10, moved_tokens=4, freed_blocks=2, evictions=3, repack_seconds=0.5,
                    live_tokens=49, retained_blocks=2, naive_retained_blocks=5, dense_blocks=2)
    m.update(s)
    m.update(s)  # no change: counters must not double
    assert _val("vtoken:evicted_tokens_total", "7") == 10
    assert _val("vtoken:repack_seconds_total", "7") == 0.5
    assert _val("vtoken:live_tokens", "7") == 49
    assert _val("vtoken:naive_retained_blocks", "7") == 5
    s.evicted_tokens, s.live_tokens, s.retained_blocks = 15, 0, 0
    m.update(s)
    assert _val("vtoken:evicted_tokens_total", "7") == 15
    assert _val("vtoken:live_tokens", "7") == 0 and _val("vtoken:retained_blocks", "7") == 0
    # every exported field exists on VTokenStats
    assert all(hasattr(s, f) for f, _ in list(GAUGES.values()) + list(COUNTERS.values()))


def test_request_peak_blocks_histogram():
    """One observation per finished request, of its lifetime's ``peak_blocks``; a request
    without the figure is skipped."""
    m = VTokenMetrics("unit", "8")
    for peak in (3, 5, 200):
        m.observe_finished(dict(peak_blocks=peak))
    m.observe_finished(dict(peak_blocks=None))
    labels = {"model_name": "unit", "engine": "8"}
    assert REGISTRY.get_sample_value("vtoken:request_peak_blocks_count", labels) == 3
    assert REGISTRY.get_sample_value("vtoken:request_peak_blocks_sum", labels) == 208
    le = lambda b: REGISTRY.get_sample_value("vtoken:request_peak_blocks_bucket", dict(labels, le=b))  # noqa: E731
    assert (le("4.0"), le("8.0"), le("128.0"), le("256.0"), le("+Inf")) == (1, 2, 2, 3, 3)
