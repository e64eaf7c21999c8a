"""`eval compare` under torchrun: cell i of the comparison runs on rank i % world, the results are gathered and
merged in the cells' order, so the merged JSON equals the single-process run's.

The sharding itself is checked in threads (a fake all-gather); the CLI with two gloo processes on CPU
(`python -m torch.distributed.run --nproc-per-node 2 -m sparsekv.cli eval compare ...`) on a tiny random model
saved to a folder with a byte tokenizer, against the same command in one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from sparsekv.config import ConfigError
from sparsekv.eval.distributed import Shard, data_parallel, world_from_env
from tests.helpers import free_port

TIMEOUT_S = 120  # each run takes a few seconds; a hung collective must fail the test, not stall it
#: wall-clock timings of a cell (ppl's per-run "seconds" and "tokens_per_second"): they differ between any two
#: runs, one process or several; every other field of the JSON must be equal
TIMING_FIELDS = {"seconds", "tokens_per_second"}


# ------------------------------------------------------------------------------------------------ sharding, in threads


def _fake_ppl(ran: list):
    def run(config):
        ran.append((config.method, config.budget))
        if config.method == "streaming" and config.budget == 0.02:
            raise RuntimeError("boom")
        budget = 0.0 if config.method == "dense" else config.budget
        return {"ppl": 10.0 + 100 * budget, "avg_budget_tokens": 100 * budget, "method": config.method}

    return run


def _run_ranks(world: int, methods: list[str], budgets: list[float]) -> tuple[list[dict], list[list]]:
    """run_compare on `world` threads sharing an all-gather: each rank's merged result and the cells it ran."""
    from sparsekv.eval.compare import run_compare

    barrier, slots = threading.Barrier(world, timeout=30), [None] * world
    results, ran, errors = [None] * world, [[] for _ in range(world)], []

    def rank(r: int) -> None:
        def gather(obj):
            slots[r] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        try:
            shard = Shard(rank=r, world=world, gather_fn=gather)
            results[r] = run_compare("ppl", _fake_ppl(ran[r]), methods, budgets, shard=shard).to_dict()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results, ran


@pytest.mark.parametrize("world", [2, 3, 8])  # 8 ranks: more than the 5 cells, some ranks run nothing
def test_cells_split_by_index_and_merged_in_order(world):
    from sparsekv.eval.compare import run_compare

    methods, budgets = ["dense", "oracle-topk", "streaming", "not-a-method"], [0.02, 0.1]
    single_ran = []
    single = run_compare("ppl", _fake_ppl(single_ran), methods, budgets).to_dict()
    results, ran = _run_ranks(world, methods, budgets)
    cells = [("dense", 0.02), ("oracle-topk", 0.02), ("oracle-topk", 0.1), ("streaming", 0.02), ("streaming", 0.1)]
    assert single_ran == cells
    for r in range(world):
        assert ran[r] == cells[r::world], r  # cell i on rank i % world
        assert results[r] == single, r  # every rank gets the whole result, in the cells' order
    assert [row["error"] for row in single["rows"]] == [None, None, None, "RuntimeError: boom", None]
    assert len(single["runs"]) == 4  # the failed cell has a row, not a run


# ------------------------------------------------------------------------------------------------ environment


def test_without_torchrun_nothing_changes(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert world_from_env() == (1, 0, 0)
    with data_parallel("cpu") as (shard, device):
        assert (shard.rank, shard.world, shard.is_main, device) == (0, 1, True, "cpu")
        assert shard.gather({"a": 1}) == [{"a": 1}]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert world_from_env() == (1, 0, 0)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not: launch it as `torchrun"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, r"RANK 2 is outside 0\.\.1"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ],
)
def test_bad_launch_environment_is_one_clear_error(monkeypatch, env, message):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        world_from_env()


# ------------------------------------------------------------------------------------------------ the CLI, 2 processes



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sparsekv.eval.testing import byte_tokenizer
    from sparsekv.models import random_model

    path = tmp_path_factory.mktemp("evald") / "tiny-llama"
    random_model("tiny-llama", num_hidden_layers=3, vocab_size=320, seed=0).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _compare(cwd, model_dir: str, methods: str, *launch: str) -> tuple[dict, str]:
    """`eval compare --task ppl` run in `cwd` (its outputs named relative to it, so both runs name the same files);
    the JSON and stdout."""
    args = ["-m", "sparsekv.cli", "eval", "compare", "--task", "ppl", "--methods", methods, "--budgets", "0.1,0.3",
            "--model", model_dir, "--context", "160", "--prefix", "40", "--chunk", "64", "--windows", "2",
            "-o", "quest:bogus=1", "--no-cache", "-q", "--output", "out.json"]  # fmt: skip
    cwd.mkdir()
    result = subprocess.run([sys.executable, *launch, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=TIMEOUT_S, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((cwd / "out.json").read_text()), result.stdout


def _without(payload, fields: set[str]):
    if isinstance(payload, dict):
        return {k: _without(v, fields) for k, v in payload.items() if k not in fields}
    if isinstance(payload, list):
        return [_without(v, fields) for v in payload]
    return payload


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no torch.distributed gloo")
def test_cli_compare_on_two_processes_equals_one_process(tmp_path, model_dir):
    methods = "dense,oracle-topk,streaming,quest,nope"  # 7 cells: 4 on rank 0, 3 on rank 1
    single, _ = _compare(tmp_path / "single", model_dir, methods)
    launch = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()))
    merged, stdout = _compare(tmp_path / "torchrun", model_dir, methods, *launch)
    assert _without(merged, TIMING_FIELDS) == _without(single, TIMING_FIELDS)
    assert stdout.count("| dense |") == 1  # rank 0 alone prints the table
    rows = single["rows"]
    assert single["missing_methods"] == ["nope"] and len(rows) == 7 and len(single["runs"]) == 5
    assert [r["error"] is None for r in rows] == [True] * 5 + [False] * 2  # quest's bad option: 2 error rows
    assert "has no option(s) ['bogus']" in rows[-1]["error"]
    assert len({r["value"] for r in rows[:5]}) > 1  # the methods differ: not dense compared with dense
