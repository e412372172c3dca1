"""Markdown tables of the benchmark docs, rendered from the committed result files.

``benchmarks/README.md``, the top-level README and docs/models.md hold these tables between
``<!-- generated: ... -->`` and ``<!-- end generated -->`` markers; ``tests/test_docs.py`` renders them again from the JSON
files and checks the docs agree. To refresh the docs after a new run:
``python benchmarks/doc_tables.py`` prints every table. Pure JSON -> text (no vLLM, no torch).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def sla_table(name: str = "sla.json") -> str:
    """One row per (arm, rate) of a ``bench_sla.py`` result: attainment, throughput, latencies
    (ms), preemptions, queue and KV-cache use, machine load."""
    d = _load(name)
    rows = ["| arm | rate (req/s) | attainment | completed req/s | goodput req/s | P50 / P99 TTFT (ms) "
            "| P50 / P99 TPOT (ms) | preemptions | max running / waiting | KV usage mean / max | load avg 1m |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in d["arms"].items():
        for r in a["runs"]:
            rows.append(
                f"| {arm} | {r['rate']:g} | {r['attainment']:.2f} | {r['request_throughput']:.3f} "
                f"| {r['request_goodput']:.3f} | {r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
                f"| {r['p50_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {r['preemptions']:.0f} "
                f"| {r['num_requests_running_max']:.0f} / {r['num_requests_waiting_max']:.0f} "
                f"| {r['kv_cache_usage_perc_mean']:.2f} / {r['kv_cache_usage_perc_max']:.2f} "
                f"| {r['load_average_1m']:.1f} |")
    return "\n".join(rows) + "\n"


def sla_unloaded_table(name: str = "sla.json") -> str:
    """Unloaded (one request at a time) P50 TTFT / TPOT per arm, and each arm's server start-up."""
    d = _load(name)
    rows = ["| arm | unloaded P50 TTFT (ms) | unloaded P50 TPOT (ms) | server start-up (s) |", "|---|---|---|---|"]
    for arm, a in d["arms"].items():
        u = a["unloaded"]
        rows.append(f"| {arm} | {u['p50_ttft_ms']:.0f} | {u['p50_tpot_ms']:.1f} | {a['server_startup_s']:.0f} |")
    return "\n".join(rows) + "\n"


def overhead_table(name: str = "overhead_small.json") -> str:
    """Per model and arm of a ``bench_overhead.py`` result: step time per repetition, its median,
    and the ratio to stock (median, min-max over the repetitions)."""
    d = _load(name)
    rows = ["| model | arm | vToken config | step time per repetition (ms) | median (ms) "
            "| vs stock: median (min-max) |", "|---|---|---|---|---|---|"]
    for model, res in d["results"].items():
        for arm, r in res.items():
            cfg = d["config"]["arms"].get(arm)
            reps = ", ".join(f"{x:.1f}" for x in r["step_ms"])
            ratio = "1" if arm == "stock" else f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            rows.append(f"| {model} | {arm} | {json.dumps(cfg) if cfg else 'off'} | {reps} "
                        f"| {r['step_ms_median']:.1f} | {ratio} |")
    return "\n".join(rows) + "\n"


def quality_scale_table(name: str = "quality_scale.json") -> str:
    """Per policy and budget of a ``bench_quality.py --scale`` result: NLL increase over the full
    cache (nats/token) and next-token agreement with it, under fixed and pressure pacing, and the
    mean live tokens at the end (pressure keeps what the pool allows)."""
    d = _load(name)["oracle"]
    by = {(r["policy"], r["budget"], r["pacing"]): r for r in d["summary"]}
    rows = ["| policy | budget | fixed: ΔNLL | fixed: agreement | pressure: ΔNLL | pressure: agreement "
            "| mean live tokens at the end, fixed / pressure |", "|---|---|---|---|---|---|---|"]
    for pol in d["config"]["policies"]:
        for b in d["config"]["budgets"]:
            f, pr = by[(pol, b, "fixed")], by[(pol, b, "pressure")]
            rows.append(f"| {pol} | {b} | +{f['delta_nll']:.3f} | {f['agree_full'] * 100:.1f} % "
                        f"| +{pr['delta_nll']:.3f} | {pr['agree_full'] * 100:.1f} % "
                        f"| {f['mean_final_live']:.0f} / {pr['mean_final_live']:.0f} |")
    return "\n".join(rows) + "\n"


def sla_headline_table(name: str = "sla.json") -> str:
    """Per arm of a ``bench_sla.py`` result: SLA throughput (the highest swept rate up to which
    attainment stays >= the threshold), peak goodput, preemptions over the sweep, and vToken over
    Naive-Evict of the same policy spec (SLA rate and peak goodput)."""
    d = _load(name)
    head, ratios = d["headline"]["per_arm"], d["headline"]["ratios"]
    rows = ["| arm | SLA throughput (req/s) | peak goodput (req/s) | preemptions | SLA rate / Naive-Evict "
            "| peak goodput / Naive-Evict |", "|---|---|---|---|---|---|"]

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for arm, h in head.items():
        r = ratios.get(arm, {})
        sla = "none" if h["sla_rate"] is None else f"{h['sla_rate']:g}"
        rows.append(f"| {arm} | {sla} | {h['peak_goodput']:.3f} | {h['preemptions']:.0f} "
                    f"| {x(r.get('vtoken_over_naive'))} | {x(r.get('peak_goodput_over_naive'))} |")
    return "\n".join(rows) + "\n"


def sla_k_grid_table(name: str = "sla.json") -> str:
    """SLA rate per arm for every SLO scale of ``k_grid_sla_rate`` (TTFT k x the fitted unloaded
    stock TTFT of the prompt's length, TPOT k x the unloaded stock P50 TPOT)."""
    d = _load(name)
    grid = d["k_grid_sla_rate"]
    arms = list(d["arms"])
    rows = ["| SLO scale | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for key, row in grid.items():
        cells = " | ".join("none" if row[a] is None else f"{row[a]:g}" for a in arms)
        rows.append(f"| {key.replace(',', ', ')} | {cells} |")
    return "\n".join(rows) + "\n"


SLA_FINE = ("sla_random_fine_r05.json", "sla_random_fine.json")


def sla_merged_runs(names: tuple[str, ...] = SLA_FINE, thr: float = 0.9) -> dict[str, dict]:
    """Per arm, the runs of several ``bench_sla.py`` results made with the same SLOs
    (``--slo-from``) and sorted by rate, plus the SLA rate over the union of their rates (the
    highest rate up to which every rate keeps attainment >= ``thr``).

    Raises:
        ValueError: the files were made with different SLOs or prompt counts.
    """
    ds = [_load(n) for n in names]
    keys = {(d["slo"]["ttft_b_ms_per_token"], d["slo"]["tpot_ms"], d["config"]["num_prompts"]) for d in ds}
    if len(keys) != 1:
        raise ValueError(f"{names}: made with different SLOs or prompt counts: {sorted(keys)}")
    out: dict[str, dict] = {}
    for d in ds:
        for arm, a in d["arms"].items():
            out.setdefault(arm, {"runs": []})["runs"].extend(a["runs"])
    for rec in out.values():
        rec["runs"].sort(key=lambda r: r["rate"])
        rec["sla_rate"] = None
        for r in rec["runs"]:
            if r["attainment"] is None or r["attainment"] < thr:
                break
            rec["sla_rate"] = r["rate"]
    return out


def sla_fine_table(names: tuple[str, ...] = SLA_FINE) -> str:
    """The Random arms' replicate on a finer rate grid: attainment / goodput (req/s) /
    preemptions per rate, and the SLA rate over all the rates of ``names``."""
    arms = sla_merged_runs(names)
    rates = [r["rate"] for r in next(iter(arms.values()))["runs"]]
    rows = ["| arm | " + " | ".join(f"{r:g} req/s" for r in rates) + " | SLA throughput (req/s) |",
            "|---|" + "---|" * (len(rates) + 1)]
    for arm, rec in arms.items():
        cells = " | ".join(f"{r['attainment']:.2f} / {r['request_goodput']:.3f} / {r['preemptions']:.0f}"
                           for r in rec["runs"])
        sla = "none" if rec["sla_rate"] is None else f"{rec['sla_rate']:g}"
        rows.append(f"| {arm} | {cells} | {sla} |")
    return "\n".join(rows) + "\n"


def step_split_table(name: str = "step_split.json") -> str:
    """Per arm of a ``bench_step_split.py`` result: median ms per decode step for each part, the
    step, and the step time over stock's."""
    d = _load(name)
    parts = d["config"]["parts"]
    rows = ["| arm | " + " | ".join(parts) + " | step (ms) | step / stock |",
            "|---|" + "---|" * (len(parts) + 2)]
    for arm, r in d["results"].items():
        m = r["median_ms"]
        rows.append(f"| {arm} | " + " | ".join(f"{m[p]:.2f}" for p in parts)
                    + f" | {m['step']:.2f} | {r['step_over_stock']:.2f}x |")
    return "\n".join(rows) + "\n"


def scheduler_table(name: str = "bench_scheduler.json") -> str:
    """``bench_scheduler.py``: host ms per decode step (median) of vLLM's ``Scheduler`` and
    vToken's (default config, one arm per policy), with the ratio to stock; and the worker-side
    ``DeviceDecider`` step (CPU)."""
    d = _load(name)
    arms = [a for a in d["config"]["arms"] if a != "stock"]
    label = {"h2o": "H2O", "random": "Random"}
    worker = {(w["policy"], w["num_requests"], w["live"]): w["median_ms"] for w in d.get("worker", {}).get("cpu", [])}
    head = "| running requests | live tokens | stock (ms) | " + " | ".join(
        f"vToken {label.get(a, a)} (ms, x stock)" for a in arms) + " | worker side, CPU: h2o / random (ms) |"
    rows = [head, "|" + "---|" * (4 + len(arms))]
    for c in sorted(d["cells"], key=lambda c: (c["live"], c["num_requests"])):
        st = c["arms"]["stock"]["total"]["median_ms"]
        cells = [f"{c['arms'][a]['total']['median_ms']:.2f} ({c['arms'][a]['total']['median_ms'] / st:.2f}x)"
                 for a in arms]
        w = [worker.get((p, c["num_requests"], c["live"])) for p in ("h2o", "random")]
        ws = " / ".join("-" if x is None else f"{x:.1f}" for x in w)
        rows.append(f"| {c['num_requests']} | {c['live']:,} | {st:.2f} | " + " | ".join(cells) + f" | {ws} |")
    return "\n".join(rows) + "\n"


def quality_granularity_table(name: str = "quality_granularity.json") -> str:
    """``bench_quality.py --granularity``: per policy, budget and pacing, ΔNLL and next-token
    agreement for each granularity, and vToken's / Naive-Evict's retained blocks after the last step."""
    d = _load(name)["oracle"]
    grans = d["config"]["granularities"]
    by = {(r["policy"], r["budget"], r["pacing"], r["granularity"]): r for r in d["summary"] if r["policy"] != "full"}
    rows = ["| policy | budget | pacing | " + " | ".join(f"{g}: ΔNLL / agreement" for g in grans)
            + " | retained blocks, vToken / Naive-Evict (" + ", ".join(grans) + ") |",
            "|---|---|---|" + "---|" * (len(grans) + 1)]
    for pol in d["config"]["policies"]:
        for b in d["config"]["budgets"]:
            for pc in d["config"]["pacings"]:
                rs = [by[(pol, b, pc, g)] for g in grans]
                rows.append(f"| {pol} | {b} | {pc} | " + " | ".join(
                    f"{r['delta_nll']:+.3f} / {r['agree_full'] * 100:.1f} %" for r in rs) + " | "
                    + ", ".join(f"{r['vtoken_blocks']:.1f} / {r['naive_blocks']:.1f}" for r in rs) + " |")
    return "\n".join(rows) + "\n"


def quality_keyonly_table(name: str = "quality_keyonly.json", attn: str = "quality_granularity.json") -> str:
    """``bench_quality.py --keyonly``: per key-only policy and budget (head token sets, fixed
    pacing), ΔNLL and next-token agreement over all its conversations and over the first ``n``
    that the ``--granularity`` run finished, beside that run's attention-scored policies at head
    sets (the same conversations, in the same order)."""
    ko, at = _load(name)["oracle"], _load(attn)["oracle"]
    n = max(r["n"] for r in at["summary"])
    full = {r["conv"]: r["nll"] for r in ko["rows"] if r["policy"] == "full"}

    def first(pol, b):
        rs = [r for r in ko["rows"] if r["policy"] == pol and r["budget"] == b and r["conv"] < n]
        return (sum(r["nll"] - full[r["conv"]] for r in rs) / len(rs), sum(r["agree_full"] for r in rs) / len(rs))

    n_all = max(r["n"] for r in ko["summary"])
    rows = [f"| policy | budget | ΔNLL / agreement, {n_all} conversations | ΔNLL / agreement, first {n} |",
            "|---|---|---|---|"]
    for b in ko["config"]["budgets"]:
        for pol in ko["config"]["policies"]:
            s = next(r for r in ko["summary"] if r["policy"] == pol and r["budget"] == b)
            d, a = first(pol, b)
            rows.append(f"| {pol} | {b} | {s['delta_nll']:+.3f} / {s['agree_full'] * 100:.1f} % | "
                        f"{d:+.3f} / {a * 100:.1f} % |")
        for pol in at["config"]["policies"]:
            s = next(r for r in at["summary"] if (r["policy"], r["budget"], r["pacing"], r.get("granularity"))
                     == (pol, b, "fixed", "head"))
            rows.append(f"| {pol} (attention-scored) | {b} | - | {s['delta_nll']:+.3f} / {s['agree_full'] * 100:.1f} % |")
    return "\n".join(rows) + "\n"


PREFIX_ARMS = (("stock", "stock vLLM"), ("vtoken", "vToken H2O (keeps its hit)"),
               ("vtoken_tova", "vToken TOVA (copies its hit)"),
               ("vtoken_skip", "vToken H2O, `prefix_hits: skip`"),
               ("vtoken_keydiff", "vToken KeyDiff (copies its hit at start)"),
               ("vtoken_protect_prompt", "vToken H2O, `protect_cached_prefix: true`"))


def prefix_cache_table(name: str = "prefix_cache_sharegpt.json") -> str:
    """``bench_prefix_cache.py``: per arm, vLLM's prefix-cache hit rate, blocks held by running
    requests (time mean / peak), tokens evicted, cached blocks copied at first evictions (and
    their MB), and the copies' time over the run (blocks x the measured ms per block)."""
    d = _load(name)
    arms = {a["arm"]: a for a in d["arms"]}
    mb = d["copy_cost"]["bytes_per_block"] / 2**20
    rows = ["| arm | hit rate | blocks mean / peak | evicted tokens | cached blocks copied (MB) | copy time | wall |",
            "|---|---|---|---|---|---|---|"]
    for arm, label in PREFIX_ARMS:
        a = arms[arm]
        ev = "-" if a["evicted_tokens"] is None else f"{a['evicted_tokens']:,.0f}"
        cp = "-" if a["unshared_blocks"] is None else f"{a['unshared_blocks']:.0f} ({a['unshared_blocks'] * mb:.0f})"
        ct = "-" if a.get("copy_ms_est") is None else f"{a['copy_ms_est']:.0f} ms"
        rows.append(f"| {label} | {a['prefix_cache_hit_rate'] * 100:.0f} % | {a['blocks_mean']:.1f} / "
                    f"{a['blocks_peak']:.0f} | {ev} | {cp} | {ct} | {a['wall_s']:.1f} s |")
    return "\n".join(rows) + "\n"


LONGEST_ARMS = (("stock", "stock vLLM"), ("naive", "Naive-Evict (H2O)"),
                ("vtoken_after", "vToken H2O, `prefill_eviction: after`"),
                ("vtoken_chunks", "vToken H2O, `prefill_eviction: chunks`"))


def longest_prompt_table(name: str = "longest_prompt.json") -> str:
    """``bench_longest_prompt.py``: per arm, the longest prompt served in the fixed pool, the peak
    blocks the request held at that length, and the first length refused (with the reason)."""
    d = _load(name)
    arms = {a["arm"]: a for a in d["arms"]}
    rows = ["| arm | longest prompt served (tokens) | peak blocks held | next length tried |", "|---|---|---|---|"]
    for arm, label in LONGEST_ARMS:
        a = arms[arm]
        best = max((r for r in a["runs"] if r["served"]), key=lambda r: r["length"], default=None)
        fail = next((r for r in a["runs"] if not r["served"]), None)
        peak = "-" if best is None or best.get("peak_blocks") is None else str(best["peak_blocks"])
        nxt = "- (the grid's last)" if fail is None else f"{fail['length']:,}: {fail['reason']}"
        rows.append(f"| {label} | {a['longest_served']:,} | {peak} | {nxt} |")
    return "\n".join(rows) + "\n"


def concurrency_chunks_table(name: str = "concurrency_chunks.json") -> str:
    """``bench_concurrency.py --chunks``: per policy and budget, the most requests decoding together
    with no preemption in the fixed pool: stock, Naive-Evict, vToken (eviction after the prompt)
    and vToken with ``prefill_eviction: chunks``, and the last one over Naive-Evict."""
    d = _load(name)
    by = {r["arm"]: r for r in d["results"]}
    stock = by["stock"]["max_feasible_n"]
    rows = ["| policy, budget | stock vLLM | Naive-Evict | vToken, after | vToken, chunks | chunks / Naive-Evict |",
            "|---|---|---|---|---|---|"]
    for b in d["meta"]["plan"]["budgets"]:
        for pol in d["meta"]["plan"]["chunk_policies"]:
            nv, vt, ch = (by.get(f"{m}/{pol}/{b}") for m in ("naive", "vtoken", "vtoken_chunks"))
            f = (lambda r: "-" if r is None else str(r["max_feasible_n"]))
            ratio = "-" if not ch or not nv or not nv["max_feasible_n"] else f"{ch['max_feasible_n'] / nv['max_feasible_n']:.2f}x"
            rows.append(f"| {pol}, {b} | {stock} | {f(nv)} | {f(vt)} | {f(ch)} | {ratio} |")
    return "\n".join(rows) + "\n"


def quality_prefill_table(name: str = "quality_prefill.json") -> str:
    """``bench_quality.py --prefill``: per policy and budget, ΔNLL over the full cache and
    next-token agreement with it when the prompt is cut to the budget after the whole prompt and
    between prefill chunks, and the mean peak of tokens held (prefill included)."""
    d = _load(name)
    summ = [s for s in d["oracle"]["summary"] if s["policy"] != "full"]
    by = {(s["policy"], s["budget"], s["prefill_eviction"]): s for s in summ}
    rows = ["| policy, budget | ΔNLL after / chunks | agreement after / chunks | peak tokens held after / chunks |",
            "|---|---|---|---|"]
    for pol, b in dict.fromkeys((s["policy"], s["budget"]) for s in summ):
        a, c = by[(pol, b, "after")], by[(pol, b, "chunks")]
        rows.append(f"| {pol}, {b} | {a['delta_nll']:+.3f} / {c['delta_nll']:+.3f} | {a['agree_full']:.3f} / "
                    f"{c['agree_full']:.3f} | {a['mean_peak_live']:,.0f} / {c['mean_peak_live']:,.0f} |")
    return "\n".join(rows) + "\n"


#: quality of each SLA-at-quality policy: the 40-conversation runs of ``bench_quality.py``, fixed
#: pacing at the policy's default token sets, decided on the worker (the SLA arms' settings):
#: ``--prefill`` (its ``chunks`` arm, the worker's default ``prefill_eviction``) for the
#: attention-scored policies, ``--keyonly`` for the key-only ones
SLA_QUALITY_FILES = (("quality_prefill.json", {"prefill_eviction": "chunks"}),
                     ("quality_keyonly.json", {"granularity": "head"}),
                     ("quality_compress.json", {"prefill_eviction": "chunks"}))
KEY_ONLY = ("knorm", "keydiff", "expected_attention")


def sla_quality(policy: str, budget: int, slack: int | None = None) -> tuple[dict, str] | tuple[None, None]:
    """``(summary row, file name)`` of ``policy`` at ``budget`` (and ``slack``: None, the policy's
    default) in ``SLA_QUALITY_FILES``."""
    for name, match in SLA_QUALITY_FILES:
        for s in _load(name)["oracle"]["summary"]:
            if (s["policy"], s["budget"], s.get("pacing"), s.get("slack")) == (policy, budget, "fixed", slack) and all(
                    s.get(k) == v for k, v in match.items()):
                return s, name
    return None, None


def _sla_cell(arm: dict, grid: list[float]) -> str:
    """An arm's SLA rate (req/s) for a table cell: a bound where it is off the ``grid``."""
    if not arm:
        return "not run"
    if "error" in arm:
        return "failed"
    r = arm["sla_rate"]
    return f"< {min(grid):g}" if r is None else (f"≥ {r:g}" if r == max(grid) else f"{r:g}")


def _sla_ratio(v: float | None, n: float | None, grid: list[float]) -> str:
    """vToken's SLA rate over Naive-Evict's; a bound where one of them is off the grid."""
    if v is None:
        return "-" if n is None else f"< {min(grid) / n:.2f}x"
    if n is None:
        return f"> {v / min(grid):.2f}x"
    return f"{'≥ ' if v == max(grid) else ''}{v / n:.2f}x"


def sla_at_quality_rows(name: str = "sla_at_quality.json", d: dict | None = None) -> list[dict]:
    """Per policy spec of a ``bench_sla.py`` run (``d``, else the file ``name``), grouped by each
    arm's recorded vToken config: ``policy``, ``label`` (the policy and any slack or score_every
    the arms set), its ``quality`` row at the run's budget (and slack) and the
    ``quality_file`` it came from (``sla_quality``; ``None`` when not measured), the ``naive`` arm
    record and the ``vtoken`` arm records by pacing (``{}`` for an arm that did not run)."""
    d = _load(name) if d is None else d
    rows: dict[tuple, dict] = {}
    for rec in d["arms"].values():
        vt = rec.get("vtoken")
        if vt is None:  # stock
            continue
        key = (vt["policy"], vt.get("score_every"), vt.get("decide_on"), vt.get("slack"))
        if key not in rows:
            q, qfile = sla_quality(vt["policy"], d["config"]["budget"], vt.get("slack"))
            opts = ", ".join(f"{k} {vt[k]}" for k in ("slack", "score_every") if vt.get(k) not in (None, 1))
            rows[key] = dict(policy=vt["policy"], label=f"`{vt['policy']}`" + (f" ({opts})" if opts else ""),
                             quality=q, quality_file=qfile, naive={},
                             vtoken={pc: {} for pc in d["config"]["pacings"]})
        if vt.get("mode") == "naive":
            rows[key]["naive"] = rec
        else:
            rows[key]["vtoken"][vt["pacing"]] = rec
    return list(rows.values())


def sla_common_rate(d: dict) -> float:
    """The highest rate every arm of a ``bench_sla.py`` run measured (under ``--search bisect``,
    the grid's middle rate: every search starts there), for side-by-side figures at one load."""
    common = set.intersection(*({x["rate"] for x in a["runs"]} for a in d["arms"].values()))
    return max(common)


def _kv_mean(arm: dict, rate: float) -> float | None:
    """An arm's mean KV-cache use (fraction of the pool, polled every 0.5 s) during its load at
    ``rate`` req/s; ``None`` when it did not run that rate."""
    x = next((x for x in arm.get("runs", []) if x["rate"] == rate), None)
    return None if x is None else x["kv_cache_usage_perc_mean"]


def _kv_at(arm: dict, rate: float) -> str:
    kv = _kv_mean(arm, rate)
    return "-" if kv is None else f"{kv * 100:.0f} %"


def sla_at_quality_table(name: str = "sla_at_quality.json") -> str:
    """README "Results": per policy, quality at the SLA run's budget beside each arm's SLA rate
    (the highest request rate at which 90 % of requests meet both SLOs), vToken's SLA rate over
    its own Naive-Evict arm's, and each arm's mean KV-cache use at the rate every arm measured.
    Stock vLLM (no eviction) on the first row."""
    d = _load(name)
    grid, b, pcs = d["config"]["rates"], d["config"]["budget"], d["config"]["pacings"]
    rc = sla_common_rate(d)
    arms = "Naive-Evict / " + " / ".join(f"vToken {pc}" for pc in pcs)
    rows = [f"| policy | ΔNLL / agreement at budget {b} | SLA rate (req/s): {arms} | vToken / Naive-Evict "
            f"| mean KV-cache use at {rc:g} req/s: {arms} |", "|---|---|---|---|---|"]
    stock = d["arms"]["stock"]
    rows.append(f"| stock vLLM (no eviction) | 0 / 100 % | {_sla_cell(stock, grid)} | | {_kv_at(stock, rc)} |")
    for r in sla_at_quality_rows(d=d):
        q = r["quality"]
        qc = "not measured" if q is None else f"{q['delta_nll']:+.3f} / {q['agree_full'] * 100:.1f} %"
        n = r["naive"].get("sla_rate")
        sla = " / ".join([_sla_cell(r["naive"], grid)] + [_sla_cell(r["vtoken"][pc], grid) for pc in pcs])
        ratios = ", ".join(_sla_ratio(r["vtoken"][pc].get("sla_rate"), n, grid) for pc in pcs)
        kv = " / ".join([_kv_at(r["naive"], rc)] + [_kv_at(r["vtoken"][pc], rc) for pc in pcs])
        key = " (key-only)" if r["policy"] in KEY_ONLY else ""
        rows.append(f"| {r['label']}{key} | {qc} | {sla} | {ratios} | {kv} |")
    return "\n".join(rows) + "\n"


def _rate_key(r: float | None) -> float:
    return -1.0 if r is None else r


def sla_pick_table(name: str = "sla_at_quality.json", goal_dnll: float = 0.3, goal_ratio: float = 1.5,
                   also: tuple[tuple[str, str], ...] = (("sla_at_quality_512_snapkv.json", "make bench-sla-512-snapkv"),
                                                        ("sla_at_quality_512.json", "make bench-sla-512"))) -> str:
    """README "Results": which policy to pick for which goal, from the SLA-at-quality run and the
    quality files it names (every figure read from them; ties go to the better quality). The goal
    row (first) also reads the runs ``also`` (result file, the command that makes it; another
    budget and prompt length): their policies within ``goal_dnll``, the ones reaching ``goal_ratio``
    first, the others after "also within"."""
    d = _load(name)
    grid, b = d["config"]["rates"], d["config"]["budget"]
    rows = sla_at_quality_rows(d=d)
    rated = [r for r in rows if r["quality"] is not None]
    fmt_q = lambda q: f"ΔNLL {q['delta_nll']:+.3f}, agreement {q['agree_full'] * 100:.1f} %"  # noqa: E731

    def best_arm(r: dict) -> tuple[str, dict]:
        return max(r["vtoken"].items(), key=lambda kv: _rate_key(kv[1].get("sla_rate")))

    out = ["| goal | pick | measured |", "|---|---|---|"]
    q = min(rated, key=lambda r: r["quality"]["delta_nll"])
    pc, arm = best_arm(q)
    out.append(f"| quality at budget {b} | `{q['policy']}` | {fmt_q(q['quality'])}; SLA rate {_sla_cell(arm, grid)} "
               f"req/s ({pc} pacing), Naive-Evict {_sla_cell(q['naive'], grid)} |")
    cands = [("stock vLLM (no eviction)", None, d["arms"]["stock"])] + [
        (f"`{r['policy']}`, {pc} pacing", r, a) for r in rows for pc, a in r["vtoken"].items()]
    top = max(cands, key=lambda c: (_rate_key(c[2].get("sla_rate")),
                                    -(c[1]["quality"]["delta_nll"] if c[1] and c[1]["quality"] else 0.0)))
    out.append(f"| most requests within the SLOs at budget {b} | {top[0]} | SLA rate {_sla_cell(top[2], grid)} req/s; stock "
               f"{_sla_cell(d['arms']['stock'], grid)} |")
    rc = sla_common_rate(d)
    kv = lambda a: _kv_mean(a, rc)  # noqa: E731  (every arm ran rc)
    lo = min(((r, pc, a) for r in rows for pc, a in r["vtoken"].items()), key=lambda t: kv(t[2]))
    out.append(f"| least KV cache held at one load ({rc:g} req/s) | `{lo[0]['policy']}`, {lo[1]} pacing | mean "
               f"{kv(lo[2]) * 100:.0f} % of the pool; its Naive-Evict {kv(lo[0]['naive']) * 100:.0f} %, stock "
               f"{kv(d['arms']['stock']) * 100:.0f} % |")
    ko = [s for s in _load("quality_keyonly.json")["oracle"]["summary"] if s["budget"] == b and s["policy"] in KEY_ONLY]
    k = min(ko, key=lambda s: s["delta_nll"])
    kr = next((r for r in rows if r["policy"] == k["policy"]), None)
    sla = "not in this SLA run" if kr is None else f"SLA rate {_sla_cell(best_arm(kr)[1], grid)} req/s"
    out.append(f"| no attention weights (key-only) | `{k['policy']}` | {fmt_q(k)}; {sla} |")
    hits, misses = [], []
    for r in rated:
        n = r["naive"].get("sla_rate")
        hit = False
        for pc, a in r["vtoken"].items():
            v = a.get("sla_rate")
            if r["quality"]["delta_nll"] <= goal_dnll and v is not None and (n is None or v / n >= goal_ratio):
                hit = True
                hits.append((f"`{r['policy']}`, {pc} pacing", f"{fmt_q(r['quality'])}; SLA rate {_sla_cell(a, grid)} "
                             f"req/s, {_sla_ratio(v, n, grid)} Naive-Evict's (`make bench-sla-at-quality`)"))
        if r["quality"]["delta_nll"] <= goal_dnll and not hit:
            misses.append(f"`{r['policy']}` at budget {b} (SLA rate {_sla_cell(best_arm(r)[1], grid)} req/s)")
    for name_b, make in also:  # runs at another budget: their policies within the goal's ΔNLL
        e = _load(name_b)
        eg, c = e["config"]["rates"], e["config"]
        peak = lambda a: max((x["request_goodput"] for x in a["runs"]), default=0.0)  # noqa: E731
        for r in sla_at_quality_rows(d=e):
            if r["quality"] is None or r["quality"]["delta_nll"] > goal_dnll:
                continue
            pc, arm = best_arm(r)
            n, v, s0 = r["naive"].get("sla_rate"), arm.get("sla_rate"), e["arms"]["stock"].get("sla_rate")
            if v is not None and (n is None or v / n >= goal_ratio):
                # fixed pacing: the default; decide_on: deprecated, no longer an option (the one path)
                vt = {k: v_ for k, v_ in arm["vtoken"].items() if (k, v_) != ("pacing", "fixed") and k != "decide_on"}
                hits.append((f"`{json.dumps(vt, separators=(',', ':'))}` on {c['prompt_len']:,}-token prompts",
                             f"{fmt_q(r['quality'])}; SLA rate {_sla_cell(arm, eg)} req/s, {_sla_ratio(v, n, eg)} "
                             f"Naive-Evict's and {_sla_ratio(v, s0, eg)} stock's; peak goodput "
                             f"{peak(arm) / peak(r['naive']):.2f}x Naive-Evict's (`{make}`)"))
            else:
                misses.append(f"{r['label']} at budget {c['budget']} (SLA rate {_sla_cell(arm, eg)} req/s, "
                              f"Naive-Evict {_sla_cell(r['naive'], eg)}; `{make}`)")
    goal = f"| ΔNLL within {goal_dnll:+.1f} and ≥ {goal_ratio:g}x Naive-Evict's SLA rate | "
    rest = f"also within {goal_dnll:+.1f}: {'; '.join(misses)}" if misses else ""
    if hits:
        out.insert(2, goal + hits[0][0] + " | " + hits[0][1] + "".join(f"; or {h[0]}: {h[1]}" for h in hits[1:])
                   + (f"; {rest}" if rest else "") + " |")
    else:
        out.insert(2, goal + "none | " + (rest or f"no policy within {goal_dnll:+.1f}") + " |")
    return "\n".join(out) + "\n"


#: the model-family matrix's execution paths, in column order (``tests/drivers/model_families.py``)
FAMILY_PATHS = (("v1-sync", "V1 sync"), ("mrv2-async", "MRV2 async"))


def _family_cell(r: dict) -> str:
    if r["status"] == "refused":
        return f"refused: `{r['refusal']}`"
    if r["status"] == "exact":
        return f"exact ({len(r['first_diff'])}/{len(r['first_diff'])})"
    bad = sum(v is not None for v in r["first_diff"].values())
    return f"**mismatch** ({bad}/{len(r['first_diff'])})"


def model_families_table(name: str = "model_families.json") -> str:
    """docs/models.md: one row per model family of the matrix (``PYTHONPATH=tests python -m drivers.model_families``):
    shape, what the family adds, and per execution path whether all requests' tokens equal the
    dense oracle's (or the start-up refusal)."""
    d = _load(name)
    rows = ["| family | heads (query / KV), head_dim | what it adds | " + " | ".join(h for _, h in FAMILY_PATHS)
            + " | Expected Attention |", "|---|---|---|" + "---|" * (len(FAMILY_PATHS) + 1)]
    for f in d["families"].values():
        cells = [_family_cell(f["paths"][p]) if p in f["paths"] else "-" for p, _ in FAMILY_PATHS]
        ea = f.get("expected_attention_refusal")
        if ea:  # in a few words, as README's table (the prose below the table explains)
            cells.append(f"refused: {_short_refusal(ea)}")
        else:
            first = next(iter(f["paths"].values()))
            cells.append("in the batch" if "expected_attention-head" in first.get("first_diff", {}) else "-")
        rows.append(f"| {f['label']} (`{f['config']}`) | {f['query_heads']} / {f['kv_heads']}, {f['head_dim']} "
                    f"| {f['what']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _short_refusal(text: str) -> str:
    """A refusal's reason in a few words: the part in parentheses after "does not support it yet",
    up to its first parenthesis or semicolon (the feature, not the explanation)."""
    inner = text.split("does not support it yet (", 1)[-1]
    if inner.startswith("Expected Attention"):  # "...; the model's config: <what>)": the what
        inner = inner.rsplit("; ", 1)[-1].rsplit(": ", 1)[-1]
    return re.split(r" \(|; ", inner, maxsplit=1)[0].rstrip(")")


#: the task-accuracy run README's "Results" leads with (``tasks_lead_table``)
TASKS_LEAD = "tasks.json"
#: README's lead table: the best policies shown (the default policy too), the others in one line
TASKS_LEAD_TOP = 3
#: the every-policy runs (``make bench-tasks`` at 1k, ``make bench-tasks-2k`` and ``-2k-rest``): one table,
#: a column per length
TASKS_FULL = ("tasks.json", "tasks_2k.json", "tasks_2k_b.json")

#: more bench_tasks runs whose eviction arms (``--variant``: other token sets, prefill eviction,
#: slack) join TASKS_LEAD's in the recommendation; a file not there yet is skipped
TASKS_EXTRA = ("tasks_arms.json", "tasks_2k.json", "tasks_2k_b.json", "tasks_2k_request.json", "tasks_4k_a.json",
               "tasks_4k_pick.json")


def recommend_task_config(cells: list[dict], tol: float = 0.05, floor: float = 0.6) -> dict:
    """The rule behind the task-accuracy recommendation, on ``bench_tasks.py`` cells: drop every
    (task, length) where dense (the ``stock`` arm) scores below ``floor``; a config (policy,
    budget ratio) qualifies when on every (task, length) left its accuracy is within ``tol`` of
    dense's; the pick is the qualifying config with the smallest KV cache kept (the mean
    ``kv_kept_fraction`` of its cells, to the percent; the budget ratio where not measured), then
    the highest mean accuracy. Configs equal on both are all picked, in the cells' order.

    A cell of a ``--variant`` arm is its own config, ``(policy, ratio, variant)``.

    Returns ``dict(kept=[(task, length, dense accuracy)], dropped=[...], picks=[(policy, ratio)],
    kv=the picks' KV kept or None, accuracy=the picks' mean accuracy or None)``; ``picks`` is
    empty when no config qualifies (or every (task, length) was dropped)."""
    if str(RESULTS.parent) not in sys.path:  # (bench_tasks beside this file, also when it was loaded by path)
        sys.path.append(str(RESULTS.parent))
    from bench_tasks import dense_gate  # (the gate the run applied: one rule, in one place)

    stock = [c for c in cells if c["arm"] == "stock"]
    keep, gone = dense_gate(stock, floor)
    kept = [(c["task"], c["length"], c["accuracy"]) for c in stock if (c["task"], int(c["length"])) in keep]
    dropped = [(d["task"], d["length"], d["accuracy"]) for d in gone]
    by: dict[tuple, dict] = {}
    for c in cells:
        if c["policy"]:
            cfg = (c["policy"], c["budget_ratio"]) + ((c["variant"],) if c.get("variant") else ())
            by.setdefault(cfg, {})[(c["task"], c["length"])] = c
    ranked = []
    for cfg, here in by.items():
        cs = [here.get((t, n)) for t, n, _ in kept]
        if not kept or None in cs or any(c["accuracy"] < a - tol - 1e-9 for c, (_, _, a) in zip(cs, kept)):
            continue
        kv = sum(cfg[1] if c.get("kv_kept_fraction") is None else c["kv_kept_fraction"] for c in cs) / len(cs)
        ranked.append((round(kv * 100), -sum(c["accuracy"] for c in cs) / len(cs), cfg, kv))
    best = min(ranked, key=lambda r: r[:2], default=None)
    picks = [r for r in ranked if best and r[:2] == best[:2]]
    return dict(kept=kept, dropped=dropped, picks=[r[2] for r in picks],
                kv=best[3] if best else None, accuracy=-best[1] if best else None)


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _task_config(settings: dict, policy: str, ratio: float, variant: str | None = None) -> str:
    """A pick as the vToken config the run served it with (settings' prefill eviction and token sets,
    then the ``variant``'s config over them)."""
    cfg = {"policy": policy, "budget_ratio": ratio}
    if settings.get("prefill_eviction") not in (None, "chunks"):  # chunks: the default
        cfg["prefill_eviction"] = settings["prefill_eviction"]
    if settings.get("granularity") not in (None, "policy default"):
        cfg["granularity"] = settings["granularity"]
    if variant:
        cfg.update(settings["variants"][variant]["config"])
    return json.dumps(cfg, separators=(",", ":"))


def _task_cells(name: str, extra: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """``name``'s run and its cells, then the cells of each run in ``extra`` that exists (their
    stock cells only for a (task, length) no run before has: dense once per pair); each cell with
    its run's ``settings`` under ``_settings``."""
    d = _load(name)
    cells = [dict(c, _settings=d["settings"]) for c in d["cells"]]
    for e in extra:
        try:
            x = _load(e)
        except FileNotFoundError:
            continue
        have = {(c["task"], c["length"]) for c in cells if c["arm"] == "stock"}
        cells += [dict(c, _settings=x["settings"]) for c in x["cells"]
                  if c["policy"] or (c["task"], c["length"]) not in have]
    return d, cells


def tasks_pick_text(name: str = "tasks.json", tol: float = 0.05, floor: float = 0.6,
                    extra: tuple[str, ...] = (), dropped: bool = True) -> str:
    """The recommendation of a ``bench_tasks.py`` run (:func:`recommend_task_config`) with the
    eviction arms of the runs in ``extra`` (:func:`_task_cells`), its rule stated, and each (task,
    length) the rule dropped with dense's accuracy (``dropped``; False where the dense table is beside it)."""
    _, cells = _task_cells(name, extra)
    r = recommend_task_config(cells, tol, floor)
    tasks = {t for t, _, _ in r["kept"]}
    where = ((lambda t, n, a: f"{t} at {n:,} tokens: {_pct(a)}") if len(tasks) > 1 else
             (lambda t, n, a: f"{_pct(a)} at {n:,} tokens") if len(r["kept"]) > 1 else (lambda t, n, a: _pct(a)))
    if len(tasks) == 1 and len(r["kept"]) > 1 and len({a for _, _, a in r["kept"]}) == 1:  # one figure
        _, _, a = r["kept"][0]
        ns = [f"{n:,}" for _, n, _ in r["kept"]]
        near = f"accuracy within {tol * 100:g} points of dense ({_pct(a)} at {', '.join(ns[:-1])} and {ns[-1]} tokens)"
    else:
        near = f"accuracy within {tol * 100:g} points of dense ({', '.join(where(*k) for k in r['kept'])})"
    if r["dropped"] and dropped:  # grouped by length, more than two as a count (names, figures: the dense table)
        by_len: dict[int, list[str]] = {}
        for t, n, a in r["dropped"]:
            by_len.setdefault(int(n), []).append(t)
        near += f"; dropped, dense under {floor * 100:g} %: " + "; ".join(
            f"{', '.join(ts) if len(ts) <= 2 else f'{len(ts)} tasks'} at {n:,} tokens" for n, ts in sorted(by_len.items()))
    if not r["picks"]:
        return f"**No config recommended**: none has {near}.\n"

    def config(pick: tuple) -> str:
        c = next(c for c in cells if c["policy"] == pick[0] and c["budget_ratio"] == pick[1]
                 and c.get("variant") == (pick[2] if len(pick) > 2 else None))
        return _task_config(c["_settings"], *pick)

    first, *rest = r["picks"]
    return (f"**Recommended: `{config(first)}`**"
            + "".join(f" (or `{p[0]}`)" if p[1:] == first[1:] else f" (or `{config(p)}`)" for p in rest)
            + f": the smallest KV cache kept ({_pct(r['kv'])} of dense's) with {near}.\n")


def tasks_table(names: str | tuple[str, ...] = "tasks.json") -> str:
    """``bench_tasks.py``: per (task, length) and policy, accuracy (correct / n) at each budget ratio
    of the prompt, and stock's with the full cache on the same task and length (in the header
    where the runs have one (task, length)). ``names``: one result file or several (runs at other
    lengths, e.g. ``tasks_2k.json``); files not committed are skipped. The recommendation is the
    arms table's (:func:`tasks_arms_table`), over both runs."""
    runs = [_load(n) for n in ((names,) if isinstance(names, str) else names) if (RESULTS / n).exists()]
    cells = [c for d in runs for c in d["cells"]]
    variants = {k: v for d in runs for k, v in d["settings"].get("variants", {}).items()}
    ratios = sorted({c["budget_ratio"] for c in cells if c["budget_ratio"]})
    # (task, length) pairs with eviction cells; those with stock's alone were dropped by the dense gate
    pairs = sorted({(c["task"], c["length"]) for c in cells if c["policy"]}) or sorted(
        {(c["task"], c["length"]) for c in cells})

    def stock_of(task: str, length: int) -> str:  # (runs that disagree all shown)
        return ", ".join(dict.fromkeys(f"{c['correct']}/{c['n']}" for c in cells
                                       if c["arm"] == "stock" and (c["task"], c["length"]) == (task, length)))

    def label(pol: str, var: str | None) -> str:
        return f"`{pol}`" + (f", `{json.dumps(variants[var]['config'])}`" if var else "")

    one = len(pairs) == 1
    if len(pairs) > 1 and len({t for t, _ in pairs}) == 1:  # one task at several lengths: a column per length
        task = pairs[0][0]
        lengths = [n for _, n in pairs]
        ns = {c["n"] for c in cells if c["policy"] and c["task"] == task}
        of = f" of {ns.pop()}" if len(ns) == 1 else ""
        rows = [f"| {task}, correct{of}: policy | " + " | ".join(f"{n:,} tokens at " + ", ".join(f"{r * 100:g}" for r in ratios)
                                                               + " %" for n in lengths) + " |",
                "|---|" + "---|" * len(lengths),
                "| stock (full cache) | " + " | ".join(stock_of(task, n) for n in lengths) + " |"]
        for pol, var in dict.fromkeys((c["policy"], c.get("variant")) for c in cells if c["policy"]):
            got = {(c["length"], c["budget_ratio"]): (str(c["correct"]) if of else f"{c['correct']}/{c['n']}")
                   for c in cells if (c["policy"], c.get("variant")) == (pol, var)}
            rows.append(f"| {label(pol, var)} | " + " | ".join(", ".join(got.get((n, r), "-") for r in ratios)
                                                      for n in lengths) + " |")
        return "\n".join(rows) + "\n"
    if one:
        (task, length), = pairs
        rows = [f"| {task}, {length:,} tokens: policy | " + " | ".join(f"{r * 100:g} %" for r in ratios)
                + f" of the prompt (stock, full cache: {stock_of(task, length)}) |", "|---|" + "---|" * len(ratios)]
    else:
        rows = ["| task, length | policy | " + " | ".join(f"{r * 100:g} %" for r in ratios)
                + " of the prompt | stock (full cache) |", "|---|---|" + "---|" * (len(ratios) + 1)]
    for task, length in pairs:
        here = [c for c in cells if (c["task"], c["length"]) == (task, length)]
        stock = stock_of(task, length)
        for pol, var in dict.fromkeys((c["policy"], c.get("variant")) for c in here if c["policy"]):
            acc = {c["budget_ratio"]: f"{c['correct']}/{c['n']}" for c in here
                   if (c["policy"], c.get("variant")) == (pol, var)}
            cols = " | ".join(acc.get(r, "-") for r in ratios)
            rows.append(f"| {label(pol, var)} | {cols} |" if one else
                        f"| {task}, {length:,} | {label(pol, var)} | {cols} | {stock} |")
    return "\n".join(rows) + "\n"


def tasks_arms_table(name: str = "tasks_arms.json", base: str = "tasks.json") -> str:
    """``bench_tasks.py --variant``: per variant (its label; its ``vtoken`` config over the shared
    settings is in the run's command) and policy, accuracy (correct / n) at each budget ratio, beside the same policy and ratio in
    ``base`` (the policy's defaults, prefill eviction ``after``) where ``base`` has the same task
    and length; then the rule's pick over both runs' cells (:func:`tasks_pick_text`)."""
    d = _load(name)
    cells = [c for c in d["cells"] if c.get("variant")]
    b = _load(base)["cells"]
    ratios = sorted({c["budget_ratio"] for c in cells})
    (task, length), = {(c["task"], c["length"]) for c in d["cells"]}
    ref = {(c["policy"], c["budget_ratio"]): c for c in b if (c["task"], c["length"]) == (task, length)}
    stock = next(f"{c['correct']}/{c['n']}" for c in d["cells"] if c["arm"] == "stock")
    rows = [f"| {task}, {length:,} tokens (stock: {stock}): variant | policy | "
            + " | ".join(f"{r * 100:g} %" for r in ratios) + " (default settings) |",
            "|---|---|" + "---|" * len(ratios)]
    for label, v in d["settings"]["variants"].items():
        for pol in v["policies"]:
            acc = []
            for r in ratios:
                c = next((c for c in cells if (c["variant"], c["policy"], c["budget_ratio"]) == (label, pol, r)), None)
                old = ref.get((pol, r))
                acc.append(("-" if c is None else f"{c['correct']}/{c['n']}")
                           + ("" if old is None else f" ({old['correct']}/{old['n']})"))
            rows.append(f"| {label} | `{pol}` | " + " | ".join(acc) + " |")
    return "\n".join(rows) + "\n\n" + tasks_pick_text(base, extra=TASKS_EXTRA if name in TASKS_EXTRA else (name,),
                                                      dropped=False)


#: the dense-only runs (``bench_tasks.py --policies``): 1k and 2k, then 4k
TASKS_DENSE = ("tasks_dense.json", "tasks_dense_4k.json")


def tasks_dense_table(names: tuple[str, ...] = TASKS_DENSE) -> str:
    """``bench_tasks.py --policies`` (stock alone): dense accuracy per task and length, and which
    pairs the gate (``dense_gate``: accuracy under ``--dense-floor``) drops from the eviction arms.
    ``names``: the runs (files not committed are skipped; the first one's floor)."""
    runs = [_load(n) for n in names if n == names[0] or (RESULTS / n).exists()]
    floor = runs[0]["dense_gate"]["floor"]
    cells = [c for d in runs for c in d["cells"]]
    lengths = sorted({c["length"] for c in cells})
    rows = ["| task | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for task in sorted({c["task"] for c in cells}):
        acc = {c["length"]: c["accuracy"] for c in cells if c["task"] == task}
        rows.append(f"| {task} | " + " | ".join(
            "-" if n not in acc else _pct(acc[n]) + ("" if acc[n] >= floor else " (dropped)") for n in lengths) + " |")
    return "\n".join(rows) + "\n"


def tasks_lead_table(name: str = TASKS_LEAD, top: int | None = None, default: str = "h2o",
                     extra: tuple[str, ...] = ()) -> str:
    """README "Results", first: accuracy per policy (and stock) at each budget ratio on the
    (task, length) pairs the rule keeps, the run's task, length, samples, model, command and prefix
    caching, the recommended cells in bold, then ``tasks_pick_text``. ``top``: only the ``top``
    policies by mean accuracy over the ratios (ties in the run's order), and ``default`` (the
    default policy) after them if it is not one, the others named in one line. ``extra``: runs whose
    eviction arms join the recommendation (:func:`tasks_pick_text`); a picked ``--variant`` arm gets
    a row of its own (its config beside the policy)."""
    d, every = _task_cells(name, extra)
    cells, st = d["cells"], d["settings"]
    r = recommend_task_config(every)
    keep = [(t, n) for t, n, _ in r["kept"]] or sorted({(c["task"], c["length"]) for c in cells})
    here = [c for c in cells if (c["task"], c["length"]) in keep]
    shown_cells = [c for c in every if (c["task"], c["length"]) in keep]
    ns = sorted({c["n"] for c in shown_cells})
    ratios = sorted({c["budget_ratio"] for c in here if c["budget_ratio"]})
    runs = [name] + [e for e in extra if (RESULTS / e).exists()]
    src = (f"`{d['command']}`" if len(runs) == 1 else
           f"{len(runs)} runs, commands in benchmarks/README.md")
    lengths = {t: " / ".join(f"{n:,}" for u, n in keep if u == t) for t, _ in keep}  # (a cell: a figure per length)
    head = (f"RULER {', '.join(f'{t} at {ns} tokens' for t, ns in lengths.items())}, "
            f"{'-'.join(map(str, (ns[0], ns[-1]) if len(ns) > 1 else ns))} samples a cell, "
            f"{Path(st['model']).name}, prefix caching {'on' if st.get('prefix_caching') else 'off'} ({src}):")

    def acc(cs: list[dict]) -> str:  # one figure per kept (task, length), "-" where not run
        by = {(c["task"], c["length"]): c for c in cs}
        return " / ".join(f"{by[k]['accuracy'] * 100:.0f}" if k in by else "-" for k in keep) + " %"

    rows = ["| accuracy, % of the prompt kept: | " + " | ".join(f"{x * 100:g} %" for x in ratios) + " | 100 % |",
            "|---|" + "---|" * (len(ratios) + 1),
            "| stock vLLM (dense) |" + " |" * len(ratios) + f" {acc([c for c in shown_cells if c['arm'] == 'stock'])} |"]
    pols = list(dict.fromkeys(c["policy"] for c in here if c["policy"]))
    rest: list[str] = []
    if top is not None and len(pols) > top:
        mean = {p: sum(c["accuracy"] for c in here if c["policy"] == p) / max(1, sum(c["policy"] == p for c in here))
                for p in pols}
        shown = sorted(pols, key=lambda p: -mean[p])[:top]
        shown += [default] if default in pols and default not in shown else []
        rest = [p for p in pols if p not in shown]
        pols = shown
    picked = list(dict.fromkeys((p[0], p[2]) for p in r["picks"] if len(p) > 2))
    for pol, var in [(p, None) for p in pols] + picked:
        row = []
        for x in ratios:
            cs = [c for c in shown_cells if (c["policy"], c["budget_ratio"]) == (pol, x) and c.get("variant") == var]
            v = acc(cs) if cs else "-"
            row.append(f"**{v}**" if (pol, x) + ((var,) if var else ()) in r["picks"] else v)
        label = f"`{pol}`" if var is None else \
            f"`{pol}`, `{json.dumps(next(c for c in every if c.get('variant') == var)['_settings']['variants'][var]['config'])}`"
        rows.append(f"| {label} | " + " | ".join(row) + " | |")
    if rest:
        rows.append(f"| {len(rest)} more | [below](benchmarks/README.md#task-accuracy-ruler) |" + " |" * len(ratios))
    return head + "\n\n" + "\n".join(rows) + "\n\n" + tasks_pick_text(name, extra=extra)


def model_families_readme_table(name: str = "model_families.json") -> str:
    """README.md: per model family, whether every request's tokens equal the dense oracle's on each
    execution path (H2O and K-norm, head and request sets), and Expected Attention's status; a
    refusal in a few words (docs/models.md has the full table)."""
    d = _load(name)
    rows = ["| family | " + " | ".join(h for _, h in FAMILY_PATHS) + " | Expected Attention |",
            "|---|" + "---|" * (len(FAMILY_PATHS) + 1)]
    for f in d["families"].values():
        cells = []
        for p, _ in FAMILY_PATHS:
            r = f["paths"].get(p)
            cells.append("-" if r is None else r["status"] if r["status"] != "refused"
                         else f"refused: {_short_refusal(r['refusal'])}")
        first = next(iter(f["paths"].values()))
        ea = f.get("expected_attention_refusal")
        cells.append(f"refused: {_short_refusal(ea)}" if ea else
                     first["status"] if "expected_attention-head" in first.get("first_diff", {}) else "-")
        rows.append(f"| {f['label']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def worker_step_table(name: str = "bench_worker_step.json") -> str:
    """``bench_worker_step.py``: per request count, the worker's eviction step (begin + fold) in ms
    and what it dispatches per step: torch ops, host syncs, uploads and Python lines in ``vtoken/``
    (the counts must not grow with the number of requests)."""
    d = _load(name)
    rows = ["| requests x live tokens | step (ms) | begin / fold (ms) | torch ops | host syncs | uploads "
            "| Python lines | take_naive_freed: ops / syncs |", "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        c, ms = r["counts"], r["ms"]
        rows.append(f"| {r['R']} x {r['live']:,} | {ms['step']['median']:.1f} | {ms['begin']['median']:.1f} / "
                    f"{ms['fold']['median']:.1f} | {c['step']['ops']} | {c['step']['host_syncs']} "
                    f"| {c['step']['uploads']} | {c['step']['py_lines']} | {c['naive']['ops']} / {c['naive']['host_syncs']} |")
    return "\n".join(rows) + "\n"


ENGINE_OPS = ("engine_ops_b8.json", "engine_ops_b64.json")


def engine_ops_table(names: tuple[str, ...] = ENGINE_OPS, top: int = 4) -> str:
    """``bench_engine_step.py --count-ops``: the torch ops one decode step dispatches, stock's and
    vToken's own (by the innermost ``vtoken/`` frame), and vToken's largest sources; runs (batches)
    with the same figures share a row."""
    rows = ["| batch | stock: ops per step | vToken: vLLM's / own | largest (ops) |", "|---|---|---|---|"]
    cells: dict[str, list[int]] = {}
    for name in names:
        d = _load(name)
        oc = {r["arm"]: r for r in d["op_counts"]}
        vt = oc["vtoken"]
        big = sorted(vt["vtoken_sites"].items(), key=lambda kv: -kv[1])[:top]
        where = ", ".join(f"`{k.rsplit(':', 1)[-1]}` {v:.0f}" for k, v in big)
        cells.setdefault(f"{oc['stock']['total']:.0f} | {vt['vllm']:.0f} / {vt['vtoken']:.0f} | {where}", []).append(
            d["config"]["batch"])
    for cell, batches in cells.items():
        rows.append(f"| {' and '.join(map(str, batches))} | {cell} |")
    return "\n".join(rows) + "\n"


def retained_blocks_table(name: str = "retained_blocks_full.json", model: str = "smollm2") -> str:
    """``bench_retained_blocks.py --full``: per policy and budget, the time-average blocks a request
    holds with no eviction, under Naive-Evict, under vToken and ideally (``ceil(kept/B)``), and
    vToken's reduction against Naive-Evict, at block sizes 32 and 64."""
    s = {(r["policy"], r["budget"], r["block_size"]): r for r in _load(name)["summary"] if r["model"] == model}
    rows = ["| policy | budget | B=32: no eviction / Naive-Evict / vToken / ideal | B=32 reduction "
            "| B=64: Naive-Evict / vToken | B=64 reduction |", "|---|---|---|---|---|---|"]
    for pol in dict.fromkeys(p for p, _, _ in s):
        for b in sorted({b for p, b, _ in s if p == pol}):
            a, c = s[(pol, b, 32)], s[(pol, b, 64)]
            rows.append(f"| {pol} | {b} | {a['full_avg']:.1f} / {a['naive_avg']:.1f} / {a['vtoken_avg']:.1f} / "
                        f"{a['ideal_avg']:.1f} | **{100 * a['reduction_avg']:.1f} %** | {c['naive_avg']:.1f} / "
                        f"{c['vtoken_avg']:.1f} | **{100 * c['reduction_avg']:.1f} %** |")
    return "\n".join(rows) + "\n"


def preempt_table(name: str = "preempt_recompute.json") -> str:
    """``bench_preempt.py``: per token-set granularity, the tokens vLLM schedules when a preempted
    request resumes, against what a re-prefill of the live tokens or stock's re-prefill computes."""
    rows = ["| granularity | preemptions | live / logical at preemption | scheduled at the resume "
            "| re-prefill of the live tokens | stock re-prefill | blocks after the resume |",
            "|---|---|---|---|---|---|---|"]
    for gran, v in _load(name)["granularity"].items():
        r, = v["resumes"]
        rows.append(f"| {gran} | {v['preemptions']} | {r['live']} / {r['logical']} | {r['scheduled']} "
                    f"| {r['live'] + 1} | {r['logical'] + 1} | {r['blocks']} |")
    return "\n".join(rows) + "\n"


def soak_rss_table(name: str = "soak_rss.json") -> str:
    """``soak.py --rss-every``: per server process, VmRSS growth (MiB) from the sample after the
    warm-up to the last one, stock against vToken, and the verdict's rule."""
    v = _load(name)["verdict"]
    rows = [f"| process | growth after {v['warmup_requests']} requests, stock (MiB) | vToken (MiB) |",
            "|---|---|---|"]
    for proc, g in v["all_processes_mib"].items():
        if proc != "resource_tracker":
            rows.append(f"| {proc} | {g['stock']:+.2f} | {g['vtoken']:+.2f} |")
    return "\n".join(rows) + "\n"


STEP_COST_RUNS = (("overhead_policies.json", "batch 8"), ("overhead_keyonly_b32.json", "batch 32"),
                  ("overhead_keyonly_slack.json", "batch 8, slack run"))


def step_cost_table(runs: tuple[tuple[str, str], ...] = STEP_COST_RUNS) -> str:
    """``bench_overhead.py`` runs side by side: per run and arm, the median decode step (ms) and
    its ratio to the same run's stock arm (median, min-max over the repetitions); the arm names
    say the policy (``:sl16``: slack 16; the rest slack 0, budget 64; the run's ``evict-`` and
    ``@worker`` left out; "old path": the deleted ``decide_on: scheduler`` default)."""
    rows = ["| run | arm | median step (ms) | vs stock: median (min-max) |", "|---|---|---|---|"]
    for name, label in runs:
        d = _load(name)
        for model, res in d["results"].items():
            for arm, r in res.items():
                ratio = "1" if arm == "stock" else f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
                name = arm.removeprefix("evict-")
                name = name.removesuffix("@worker") if name.endswith("@worker") or name == "stock" else \
                    f"{name} (old path)"
                rows.append(f"| {label} | {name} | {r['step_ms_median']:.1f} | {ratio} |")
    return "\n".join(rows) + "\n"


TABLES = {"overhead_table": overhead_table,
          "quality_scale_table": quality_scale_table,
          "sla_full_table": lambda: sla_table("sla.json"), "sla_full_unloaded_table": lambda: sla_unloaded_table("sla.json"),
          "sla_headline_table": sla_headline_table, "sla_k_grid_table": sla_k_grid_table,
          "sla_fine_table": sla_fine_table, "step_split_table": step_split_table,
          "scheduler_table": scheduler_table, "worker_step_table": worker_step_table,
          "quality_granularity_table": quality_granularity_table,
          "overhead_policies_table": lambda: overhead_table("overhead_policies.json"),
          "overhead_keyonly_b32_table": lambda: overhead_table("overhead_keyonly_b32.json"),
          "overhead_keyonly_slack_table": lambda: overhead_table("overhead_keyonly_slack.json"),
          "prefix_cache_table": prefix_cache_table, "longest_prompt_table": longest_prompt_table,
          "concurrency_chunks_table": concurrency_chunks_table, "quality_prefill_table": quality_prefill_table,
          "quality_keyonly_table": quality_keyonly_table, "sla_at_quality_table": sla_at_quality_table,
          "sla_pick_table": sla_pick_table,
          "model_families_table": model_families_table,
          "model_families_readme_table": model_families_readme_table,
          "tasks_lead_table": lambda: tasks_lead_table(TASKS_LEAD, top=TASKS_LEAD_TOP, extra=TASKS_EXTRA),
          "tasks_full_table": lambda: tasks_table(TASKS_FULL),
          "sla_at_quality_runs_table": lambda: sla_table("sla_at_quality.json"),
          "sla_at_quality_unloaded_table": lambda: sla_unloaded_table("sla_at_quality.json"),
          "sla_keyonly_table": lambda: sla_at_quality_table("sla_at_quality_keyonly.json"),
          "sla_keyonly_runs_table": lambda: sla_table("sla_at_quality_keyonly.json"),
          "sla_keyonly_unloaded_table": lambda: sla_unloaded_table("sla_at_quality_keyonly.json"),
          "sla_512_table": lambda: sla_at_quality_table("sla_at_quality_512.json"),
          "sla_512_runs_table": lambda: sla_table("sla_at_quality_512.json"),
          "sla_512_unloaded_table": lambda: sla_unloaded_table("sla_at_quality_512.json"),
          "sla_512_headline_table": lambda: sla_headline_table("sla_at_quality_512.json"),
          "sla_512_k_grid_table": lambda: sla_k_grid_table("sla_at_quality_512.json"),
          "sla_512_snapkv_table": lambda: sla_at_quality_table("sla_at_quality_512_snapkv.json"),
          "sla_512_snapkv_headline_table": lambda: sla_headline_table("sla_at_quality_512_snapkv.json"),
          "sla_512_snapkv_runs_table": lambda: sla_table("sla_at_quality_512_snapkv.json"),
          "sla_512_snapkv_unloaded_table": lambda: sla_unloaded_table("sla_at_quality_512_snapkv.json"),
          "retained_blocks_table": retained_blocks_table,
          "preempt_table": preempt_table, "soak_rss_table": soak_rss_table,
          "step_cost_table": step_cost_table, "engine_ops_table": engine_ops_table,
          "tasks_dense_table": tasks_dense_table,
          "tasks_arms_table": tasks_arms_table}


if __name__ == "__main__":
    for n, f in TABLES.items():
        try:
            print(f"<!-- generated: benchmarks/doc_tables.py {n} -->\n{f()}<!-- end generated -->\n")
        except FileNotFoundError as e:  # a run not committed yet (tasks_full_table: results/tasks.json)
            print(f"<!-- {n}: skipped, {Path(e.filename).name} not there -->\n")

