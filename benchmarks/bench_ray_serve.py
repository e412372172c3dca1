"""vToken behind Ray Serve LLM: two replicas of one model, both evicting (issue 45, item 3).

Reruns itself in a network namespace that holds only ``lo`` (``unshare --net``; ``--no-netns``
to skip), starts a local Ray instance there (no dashboard), Ray Serve's HTTP proxy on 127.0.0.1,
and ``ray.serve.llm.build_openai_app`` with one ``LLMConfig``: ``--replicas`` vLLM engines whose
``engine_kwargs`` carry ``additional_config={"vtoken": ...}``. vToken is not passed to Ray at
all: each replica's vLLM loads it through the ``vllm.general_plugins`` entry point, as
``vllm serve`` does. Then it

1. sends greedy completions at once (mixed per-request policies and budgets in ``vllm_xargs``)
   through Ray Serve's OpenAI ingress;
2. asks every replica for its own ``vtoken:`` metrics: the replica class is ``LLMServer`` plus
   one read-only method that collects the replica's Prometheus multiprocess directory (vToken's
   bridge puts each replica's EngineCore metrics there);
3. records the listening sockets of its process tree (all must be on loopback), stops Serve and Ray;
4. checks that every replica logged ``vToken on:`` and evicted (``vtoken:evicted_tokens_total > 0``
   on each), that each request's tokens equal the dense oracle's and the replicas' counters add
   up to the oracle's (``tests/e2e/test_server.py``: what one vToken server gives);
5. sends the same requests to one plain vToken server (``vllm serve``, same options;
   ``--no-single`` to skip) and checks that its tokens equal the replicas';
6. writes ``benchmarks/results/ray_serve_<device>.json`` (exit status 1 if a check failed).

It needs ``ray[serve]`` and ray[llm]'s other dependencies next to vLLM and vToken (``ray[llm]``
pins another vLLM build: install it without that pin, as ``make bench-ray-serve`` does; see
docs/scaling.md) and runs with that environment's python. ``--device gpu`` is the same check on
an NVIDIA machine (vLLM's CUDA build, ``make install-gpu``; GPU bundles, no CPU thread settings).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info, run_metadata, write_json  # noqa: E402

MODEL_ID = "tiny"
#: the tests' vToken config (tests/e2e/test_data_parallel.py)
VT = {"policy": "h2o", "budget": 48, "slack": 0}
#: per-request overrides, one per request (None: the server's config)
XARGS: list[Optional[dict[str, Any]]] = [
    None, {"vtoken_policy": "tova"}, {"vtoken_policy": "streaming", "vtoken_budget": 40},
    {"vtoken_policy": "scissorhands", "vtoken_budget": 64}, {"vtoken_budget": 56},
    {"vtoken_policy": "tova", "vtoken_budget": 72}, {"vtoken_policy": "random"}, None]
BLOCK_SIZE = 32
NUM_BLOCKS = 96
COUNTERS = ("evicted_tokens", "evictions", "freed_blocks")


def engine_kwargs(device: str, vt: dict[str, Any], gpus_per_replica: float = 1.0) -> dict[str, Any]:
    """vLLM engine arguments of each replica (the e2e tests' server shape, a fixed pool of
    ``NUM_BLOCKS`` blocks; ``vtoken`` in ``additional_config``). On a GPU, replicas sharing one
    (``gpus_per_replica < 1``) each ask for that share of its memory, less a margin."""
    e: dict[str, Any] = dict(
        dtype="float32", block_size=BLOCK_SIZE, max_model_len=2048, enforce_eager=True, max_num_seqs=8,
        num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=False, seed=0,
        additional_config={"vtoken": vt})
    if device == "cpu":
        e["gpu_memory_utilization"] = 0.2  # as the e2e tests' servers (tests/e2e/e2e_server.py)
    elif gpus_per_replica < 1:
        e["gpu_memory_utilization"] = round(0.8 * gpus_per_replica, 3)
    return e


def llm_config(model: str, device: str, replicas: int, vt: dict[str, Any],
               gpus_per_replica: float = 1.0) -> dict[str, Any]:
    """The ``LLMConfig`` (as a dict) of the deployment: ``replicas`` fixed replicas.

    CPU: ``accelerator_config={"kind": "cpu"}`` (Ray Serve LLM then gives each engine a
    ``{"CPU": 1}`` bundle, merged with the replica actor's into one per replica, and vLLM's mp
    executor) and one OpenMP thread per replica, unbound (vLLM's automatic binding would put every
    replica on the same core). GPU: Ray Serve LLM's
    default (a ``{"GPU": 1}`` bundle per engine, vLLM's Ray executor), or a fractional bundle.
    """
    cfg: dict[str, Any] = dict(
        model_loading_config=dict(model_id=MODEL_ID, model_source=model),
        engine_kwargs=engine_kwargs(device, vt, gpus_per_replica),
        deployment_config=dict(num_replicas=replicas),
        log_engine_metrics=False,
    )
    env = {"VLLM_LOGGING_LEVEL": "INFO"}
    if device == "cpu":
        cfg["accelerator_config"] = {"kind": "cpu"}
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    elif gpus_per_replica != 1.0:
        cfg["placement_group_config"] = dict(bundles=[{"GPU": gpus_per_replica}])
    cfg["runtime_env"] = {"env_vars": env}
    return cfg


def cli_args(kwargs: dict[str, Any]) -> list[str]:
    """``vllm serve`` options equal to engine ``kwargs`` (``additional_config`` left out: the
    launcher passes it): ``x_y=v`` -> ``--x-y v``, ``True`` -> ``--x-y``, ``False`` -> ``--no-x-y``."""
    out: list[str] = []
    for k, v in kwargs.items():
        if k == "additional_config":
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def completion_body(prompt: str, max_tokens: int, xargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One greedy completion (EOS ignored, token ids returned; ``vllm_xargs``: per-request vToken
    overrides)."""
    body: dict[str, Any] = dict(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True, return_token_ids=True)
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return body


def prompts(n: int) -> list[str]:
    """``n`` ShareGPT first human turns (ASCII, >= 120 chars, cut to 200): the e2e tests' prompts,
    120..200 tokens for the tiny model's byte-level tokenizer, so every budget above evicts."""
    from vtoken.assets.paths import ensure_sharegpt

    out: list[str] = []
    for conv in json.loads(Path(ensure_sharegpt()).read_text()):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = " ".join(turns[0].get("value", "").split())
        if len(text) >= 120 and text.isascii():
            out.append(text[:200])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} prompts in the ShareGPT file")


def vtoken_samples(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """``{metric name: value}`` of the ``vtoken:`` samples (summed over labels; counters keep
    prometheus_client's ``_total`` name)."""
    out: dict[str, float] = {}
    for name, _labels, value in samples:
        if name.startswith("vtoken:"):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def started_pids(lines: list[str]) -> set[int]:
    """Process ids of the ``vToken on:`` lines (Ray prefixes each worker line with ``pid=N``)."""
    return {int(m.group(1)) for line in lines for m in [re.search(r"pid=(\d+)", line)] if m}


def check(per_replica: dict[str, dict[str, float]], want: dict[str, int], replicas: int,
          tokens_equal: list[bool], replica_pids: Optional[dict[str, int]] = None,
          vtoken_on_pids: Optional[set[int]] = None) -> list[str]:
    """The run's failures (empty: passed): ``replicas`` replicas answered, each logged ``vToken on:``
    (its pid in ``vtoken_on_pids``) and evicted, the counters' sums equal the oracle's (``want``),
    every request's tokens equal the oracle's."""
    fails = []
    if len(per_replica) != replicas:
        fails.append(f"{len(per_replica)} replicas answered, {replicas} expected")
    for rid, pid in sorted((replica_pids or {}).items()):
        if pid not in (vtoken_on_pids or set()):
            fails.append(f"replica {rid} (pid {pid}) did not log 'vToken on:'")
    for rid, m in sorted(per_replica.items()):
        if not m.get("vtoken:evicted_tokens_total", 0) > 0:
            fails.append(f"replica {rid} evicted nothing")
    for k, v in want.items():
        got = sum(m.get(f"vtoken:{k}_total", 0.0) for m in per_replica.values())
        if got != v:
            fails.append(f"sum over replicas of vtoken:{k}_total = {got:g}, oracle {v}")
    bad = [i for i, ok in enumerate(tokens_equal) if not ok]
    if bad:
        fails.append(f"requests {bad}: tokens differ from the oracle's")
    return fails


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def off_loopback(listening: list[tuple[str, int, str]], interface_ips: list[str]) -> list[tuple[str, int, str]]:
    """The ``(ip, port, process)`` sockets of ``listening`` reachable from off the loopback interface.

    A socket bound to a loopback address is on it; one bound to a wildcard (``0.0.0.0``, ``::``)
    is on every interface, so it counts as loopback only when this network namespace has no other
    address (``interface_ips``: every IPv4/IPv6 address of every interface).
    """
    only_lo = all(_is_loopback(ip) for ip in interface_ips)
    return [x for x in listening
            if not (_is_loopback(x[0]) or (x[0] in ("0.0.0.0", "::", "") and only_lo))]


# ----------------------------------------------------------------------------- the run (needs ray)
def _server_cls():
    from ray.serve.llm.deployment import LLMServer

    class VTokenLLMServer(LLMServer):
        """Ray Serve LLM's replica plus a read-only view of this replica's ``vtoken:`` metrics."""

        def vtoken_metrics(self) -> dict[str, Any]:
            from prometheus_client import CollectorRegistry
            from prometheus_client.multiprocess import MultiProcessCollector
            from ray import serve

            d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            samples = []
            if d and os.path.isdir(d):
                reg = CollectorRegistry()
                MultiProcessCollector(reg, path=d)
                samples = [(s.name, dict(s.labels), s.value) for fam in reg.collect() for s in fam.samples]
            return dict(replica=serve.get_replica_context().replica_id.unique_id, pid=os.getpid(),
                        multiproc_dir=d, samples=[s for s in samples if s[0].startswith("vtoken:")])

    return VTokenLLMServer


def _interface_ips() -> list[str]:
    import socket

    import psutil

    return sorted({a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family in (socket.AF_INET, socket.AF_INET6)})


def _listening(root_pid: int) -> list[tuple[str, int, str]]:
    """``(ip, port, process name)`` of every listening TCP socket of ``root_pid``'s descendants."""
    import psutil

    procs = {p.pid: p for p in psutil.Process(root_pid).children(recursive=True)}
    procs[root_pid] = psutil.Process(root_pid)
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return sorted(set(out))


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    import requests

    r = requests.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:2000]}")
    return r.json()


def _send(base: str, texts: list[str], xargs: list[Optional[dict[str, Any]]], max_tokens: int,
          timeout: float) -> list[dict[str, Any]]:
    """All requests at once; per request its overrides, prompt and output token ids."""
    def one(i: int) -> dict[str, Any]:
        js = _post(base + "/v1/completions", completion_body(texts[i], max_tokens, xargs[i]), timeout)
        ch = js["choices"][0]
        return dict(xargs=xargs[i], prompt_token_ids=list(js.get("prompt_token_ids") or ch["prompt_token_ids"]),
                    token_ids=list(ch["token_ids"]), text=ch.get("text"))

    with ThreadPoolExecutor(max_workers=len(texts)) as ex:
        return list(ex.map(one, range(len(texts))))


def single_server(a: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """The same requests on one plain vToken server (``vllm serve``, same engine options and
    ``--additional-config``): its tokens, for comparison with the replicas'."""
    from drivers.launcher import run_server

    e = engine_kwargs(a.device, VT, a.gpus_per_replica)
    t0 = time.monotonic()
    with run_server(a.model, logdir / "single_server.log", cli_args(e), e["additional_config"],
                    served_model_name=MODEL_ID, env=dict(VLLM_LOGGING_LEVEL="INFO"),
                    start_timeout_s=a.start_timeout) as srv:
        reqs = _send(srv.url, prompts(a.requests), request_xargs(a.requests), a.max_tokens, a.request_timeout)
        m = srv.metrics()
    return dict(argv=srv.argv, total_s=round(time.monotonic() - t0, 1), token_ids=[r["token_ids"] for r in reqs],
                vtoken={k: m.get(k, 0.0) for k in (f"vtoken:{c}_total" for c in COUNTERS)})


def request_xargs(n: int) -> list[Optional[dict[str, Any]]]:
    return [XARGS[i % len(XARGS)] for i in range(n)]


def _wait_ready(base: str, deadline_s: float) -> float:
    import requests

    t0 = time.monotonic()
    while True:
        try:
            r = requests.get(base + "/v1/models", timeout=10)
            if r.status_code == 200 and any(m.get("id") == MODEL_ID for m in r.json().get("data", [])):
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"Ray Serve app not ready after {deadline_s:.0f} s")
        time.sleep(2)


def _replica_metrics(handle, replicas: int, deadline_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """Call ``vtoken_metrics`` until every replica has answered (Serve routes each call to one)."""
    seen: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    while len(seen) < replicas and time.monotonic() - t0 < deadline_s:
        resps = [handle.vtoken_metrics.remote() for _ in range(4 * replicas)]
        for r in resps:
            got = r.result(timeout_s=60)
            seen[got["replica"]] = got
    return seen


def _start_lines(session_dir: Path) -> list[str]:
    """The ``vToken on:`` start-up lines in this Ray session's logs (one per engine)."""
    lines = []
    for p in sorted((session_dir / "logs").rglob("*")):
        if p.is_file() and p.suffix in (".out", ".err", ".log"):
            try:
                for line in p.read_text(errors="replace").splitlines():
                    if "vToken on:" in line:
                        lines.append(f"{p.name}: {line.strip()[-400:]}")
            except OSError:
                pass
    return lines


def run(a: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from drivers.launcher import free_port

    model = a.model
    texts, xargs = prompts(a.requests), request_xargs(a.requests)
    port = a.port or free_port()
    # Ray's own processes: loopback only, no dashboard; logical CPUs so that the proxy, the ingress
    # and every replica's bundle fit on 2 cores
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=a.num_cpus,
             log_to_driver=False, configure_logging=False)
    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    res: dict[str, Any] = dict(ray_version=ray.__version__, session_dir=str(session_dir))
    try:
        serve.start(http_options=dict(host="127.0.0.1", port=port))
        cfg = llm_config(model, a.device, a.replicas, VT, a.gpus_per_replica)
        cfg["server_cls"] = _server_cls()
        app = build_openai_app(dict(llm_configs=[cfg]))
        t0 = time.monotonic()
        serve.run(app, name="vtoken", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, a.start_timeout)
        res["start_s"] = round(time.monotonic() - t0, 1)
        res["interface_ips"] = _interface_ips()
        res["listening"] = _listening(os.getpid())
        res["off_loopback"] = off_loopback(res["listening"], res["interface_ips"])

        t1 = time.monotonic()
        res["requests"] = _send(base, texts, xargs, a.max_tokens, a.request_timeout)
        res["requests_s"] = round(time.monotonic() - t1, 1)
        time.sleep(2)  # the schedulers publish their last counters when they go idle
        status = serve.status().applications["vtoken"]
        dep = next(n for n in status.deployments if n.startswith("VTokenLLMServer"))
        handle = serve.get_deployment_handle(dep, app_name="vtoken")
        got = _replica_metrics(handle, a.replicas)
        res["replicas"] = {rid: dict(pid=g["pid"], multiproc_dir=g["multiproc_dir"],
                                     vtoken=vtoken_samples([tuple(s) for s in g["samples"]]))
                           for rid, g in got.items()}
        res["deployment"] = dep
        res["vtoken_on_lines"] = _start_lines(session_dir)
        res["total_s"] = round(time.monotonic() - t0, 1)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        # Ray ends the replicas without running their exit handlers: remove vToken's metric directories
        for r in res.get("replicas", {}).values():
            d = r.get("multiproc_dir") or ""
            if Path(d).name.startswith("vtoken_prom_"):
                shutil.rmtree(d, ignore_errors=True)
    return res


def oracle_check(model: str, res: dict[str, Any], max_tokens: int) -> None:
    """Each request's tokens against the dense oracle; the oracle's counter totals (``res['oracle']``)."""
    from vtoken.config import parse_config, parse_request_overrides
    from reference.oracle import load_oracle_model, oracle_generate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from e2e_server import expected_counters

    om = load_oracle_model(model)
    base = parse_config(VT)
    want = {k: 0 for k in COUNTERS}
    for r in res["requests"]:
        cfg = parse_request_overrides(r["xargs"]).apply(base) if r["xargs"] else base
        o = oracle_generate(om, r["prompt_token_ids"], max_tokens, cfg)
        r["oracle_token_ids"] = list(o.token_ids)
        r["tokens_equal_oracle"] = r["token_ids"] == list(o.token_ids)
        for k, v in expected_counters(o, BLOCK_SIZE).items():
            want[k] += v
    res["oracle"] = want


NETNS_ENV = "VTOKEN_RAY_NETNS"


def netns_argv(python: str, script: str, args: list[str], root: bool) -> list[str]:
    """The command that reruns this script in a new network namespace holding only ``lo``
    (brought up first): Ray's processes bind some sockets to every interface (``0.0.0.0`` /
    ``::``) and advertise the node's routable address, whatever ``ray.init`` is given; in this
    namespace there is no interface but loopback. Not root: a user namespace maps us to root."""
    return (["unshare", "--net"] + ([] if root else ["--map-root-user"])
            + ["--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', python, script] + list(args))


def _reexec_in_netns(args: list[str]) -> int:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("unshare(1) and ip(8) are needed to keep Ray on the loopback interface "
                         "(or pass --no-netns)")
    env = dict(os.environ, **{NETNS_ENV: "1", "HF_HUB_OFFLINE": "1"})
    return subprocess.call(netns_argv(sys.executable, str(Path(__file__).resolve()), args, os.geteuid() == 0),
                           env=env)


def _tiny() -> str:
    from vtoken.assets.paths import ensure_tiny_model

    return str(ensure_tiny_model())


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--num-cpus", type=int, default=8, help="logical CPUs Ray schedules with (not cores)")
    ap.add_argument("--port", type=int, default=None, help="Serve's HTTP port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--start-timeout", type=float, default=1200.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/ray_serve_<device>.json")
    ap.add_argument("--gpus-per-replica", type=float, default=1.0,
                    help="--device gpu: the GPU share of each replica's bundle (0.5: two replicas on one GPU)")
    ap.add_argument("--no-single", action="store_true",
                    help="skip the comparison with one plain vToken server (vllm serve) after Ray is stopped")
    ap.add_argument("--no-netns", action="store_true",
                    help="run Ray in this network namespace (Ray then also listens on the machine's other "
                         "interfaces; the loopback check is only recorded)")
    a = ap.parse_args(argv)
    try:
        import ray
    except ImportError:
        raise SystemExit("ray is not installed in this environment: see docs/scaling.md, 'Ray Serve LLM'")
    del ray
    if not a.no_netns and os.environ.get(NETNS_ENV) != "1":
        return _reexec_in_netns(sys.argv[1:] if argv is None else argv)
    out = a.out or RESULTS / f"ray_serve_{a.device}.json"
    model = a.model or _tiny()
    a.model = model
    res = run(a)
    oracle_check(model, res, a.max_tokens)
    per = {rid: r["vtoken"] for rid, r in res["replicas"].items()}
    fails = check(per, res["oracle"], a.replicas, [r["tokens_equal_oracle"] for r in res["requests"]],
                  {rid: r["pid"] for rid, r in res["replicas"].items()}, started_pids(res["vtoken_on_lines"]))
    if not a.no_single:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vtoken_ray_single_") as d:
            res["single_server"] = single_server(a, Path(d))
        same = [r["token_ids"] == t for r, t in zip(res["requests"], res["single_server"]["token_ids"])]
        res["single_server"]["tokens_equal_ray_serve"] = same
        if not all(same):
            bad = [i for i, ok in enumerate(same) if not ok]
            fails.append(f"requests {bad}: tokens differ from the single server's")
    if res["off_loopback"] and not a.no_netns:
        fails.append(f"listening off the loopback interface: {res['off_loopback']}")
    res["netns"] = "loopback only (unshare --net)" if not a.no_netns else "the machine's"
    res["failures"] = fails
    res["passed"] = not fails
    meta = run_metadata(model=model, machine_info=machine_info(), device=a.device, replicas=a.replicas,
                        vtoken=VT, llm_config=llm_config(model, a.device, a.replicas, VT, a.gpus_per_replica))
    write_json(out, dict(meta=meta, **res))
    for rid, r in sorted(res["replicas"].items()):
        print(f"replica {rid} (pid {r['pid']}): " + ", ".join(
            f"{k}={r['vtoken'].get(f'vtoken:{k}_total', 0):g}" for k in COUNTERS)
              + f", finished requests={r['vtoken'].get('vtoken:request_peak_blocks_count', 0):g}")
    print("oracle totals:", res["oracle"])
    if "single_server" in res:
        print("single vToken server:", res["single_server"]["vtoken"], "tokens equal:",
              sum(res["single_server"]["tokens_equal_ray_serve"]), "of", len(res["requests"]))
    print("PASSED" if not fails else "FAILED:\n  " + "\n  ".join(fails))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
