"""The worker step's tensor-parallel score reduction, on two real gloo processes (no engine).

Each rank holds per-request statistics averaged over its own query heads; after
``WorkerStep.fold_scores`` every rank must hold the mean over all heads:
``sum_r h_r * mean_r / sum_r h_r`` (head counts deliberately unequal here, 3 and 1, to check
the weighting), for requests asking for ``col_sum`` only, ``last_row`` only and both, in the
batch order of the step's rows; a step whose payload asks for nothing issues no collective.
"""

from __future__ import annotations

import json
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vtoken.integrations.vllm.worker.step import WorkerStep

HEADS = (3, 1)
LENS = {"a": 5, "b": 7, "c": 4}
NEEDS = {"a": (True, False), "b": (False, True), "c": (True, True)}  # (col_sum, last_row)


def _local(rank: int) -> dict:
    g = np.random.default_rng(rank)
    return {rid: tuple(g.random(n) if want else None for want in NEEDS[rid]) for rid, n in LENS.items()}


class _Step:
    def __init__(self, rank):
        self.rows = [(2, "b", 0), (0, "a", 0), (1, "c", 0)]  # batch order b, a, c
        self.num_heads = HEADS[rank]
        self._res = _local(rank)

    def result(self):
        return self._res


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    core = WorkerStep({}, layout_for=None)
    core._tp = SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=dist.group.WORLD)
    core.test_dir = os.path.dirname(out)
    folded = []  # what the worker's decisions fold: the reduced statistics
    core.decisions = SimpleNamespace(fold=folded.append)
    core.step, core.score_reqs = _Step(rank), {"a": 1, "b": 2, "c": 3}
    core.finish_step()
    # a step that asks for nothing: no collective (a second one would hang the other rank)
    core.step, core.score_reqs = None, {}
    core.finish_step()
    assert len(folded) == 1
    got = folded[0]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({rid: [None if a is None else a.tolist() for a in v] for rid, v in got.items()}, f)
    dist.destroy_process_group()


def test_two_ranks_reduce_to_the_mean_over_all_heads():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res")
        mp.spawn(_worker, args=(f"file://{d}/init", out), nprocs=2, join=True)
        got = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
        log = [open(os.path.join(d, f"allreduce-rank{r}.jsonl")).read().splitlines() for r in (0, 1)]
    assert got[0] == got[1]
    assert [len(x) for x in log] == [1, 1]  # one call per rank, none for the empty step
    rec = json.loads(log[0][0])
    assert rec["bytes"] == 8 * (1 + 5 + 7 + 2 * 4) and rec["rows"] == 3
    locs = [_local(r) for r in (0, 1)]
    for rid in LENS:
        for j in range(2):
            if locs[0][rid][j] is None:
                assert got[0][rid][j] is None
                continue
            want = (HEADS[0] * locs[0][rid][j] + HEADS[1] * locs[1][rid][j]) / sum(HEADS)
            np.testing.assert_allclose(got[0][rid][j], want, rtol=0, atol=1e-15)
