"""Sparse decoding of a model loaded with transformers' own tensor parallelism (`tp_plan="auto"`).

Two CPU processes (gloo) each hold half of a tiny random llama's heads (4 query, 2 key/value): each rank's
SparseCache holds its key/value head and selects for it. Greedy tokens must equal the single-process run's.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparsekv
from sparsekv import SparseConfig
from sparsekv.attention import RUNTIME_ATTR
from sparsekv.cache import layer_infos
from sparsekv.config import ConfigError
from sparsekv.models import load_tensor_parallel, random_model
from tests.helpers import free_port

WORLD = 2
TIMEOUT_S = 90  # the whole 2-rank run takes a few seconds; a hung collective must fail CI, not stall it
PROMPT = (torch.arange(37) * 7 % 500 + 3).view(1, -1)
NEW_TOKENS = 12
CONFIGS = {
    "oracle-topk": SparseConfig(method="oracle-topk", budget=0.3, dense_layers=(0,)),
    "quest": SparseConfig(method="quest", budget=0.3, dense_layers=(0,)),
    "lsh": SparseConfig(method="lsh", budget=0.3, dense_layers=(0,)),
    # a hash per key/value head: each rank must use its own heads' hashes, not the first ones
    "spotlight": SparseConfig(method="spotlight", budget=0.3, dense_layers=(0,)),
}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def _decode(model) -> dict:
    """Dense greedy tokens, then each config's sparse greedy tokens and budget stats (plain Python values: a tensor
    sent through a multiprocessing queue is shared memory that vanishes when its rank exits)."""
    args = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    with torch.inference_mode():
        out = {"dense": model.generate(PROMPT, **args)[0].tolist()}
        for name, config in CONFIGS.items():
            with sparsekv.enabled(model, config) as runtime:
                tokens = model.generate(PROMPT, **args)[0].tolist()
                heads = layer_infos(model)[1].num_kv_heads
                sums = runtime.cache.stats.layer_sums().tolist()
                out[name] = (tokens, runtime.cache.stats.summary(), heads, sums)
    return out


def _rank(rank: int, port: int, model_dir: str, results) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
        )
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        model = load_tensor_parallel(model_dir, torch.float32)
        assert model.tp_size == WORLD
        results.put((rank, _decode(model)))
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure goes back to the test as text, so a rank never hangs it
        results.put((rank, traceback.format_exc()))



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "tiny-llama"
    random_model("tiny-llama", dtype=torch.float32, seed=0).save_pretrained(path)
    return str(path)


def test_tensor_parallel_matches_single_process(model_dir):
    from transformers import AutoModelForCausalLM

    single = _decode(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, model_dir, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(WORLD):
            try:
                rank, out = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"the {WORLD} ranks did not finish within {TIMEOUT_S}s (got {sorted(got)})")
            assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
            got[rank] = out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    assert single["oracle-topk"][2] == 2
    for rank, out in got.items():
        assert out["dense"] == single["dense"], rank
        for name in CONFIGS:
            tokens, stats, heads, sums = out[name]
            assert heads == 1, (rank, name)  # this rank's shard: one of the two key/value heads
            assert tokens == single[name][0], (rank, name)
            # decode steps ran sparse in layer 1 only (layer 0 is dense), keeping ~30% of the context
            assert list(stats["per_layer_avg_tokens"]) == [1], (rank, name)
            assert stats["avg_budget_fraction"] < 0.5, (rank, name, stats)
            # every rank reports the whole model's stats (its heads' rows summed with the other rank's)
            torch.testing.assert_close(torch.tensor(sums), torch.tensor(single[name][3]), msg=f"rank {rank} {name}")
    # the sparse methods did change the answer somewhere, so the comparison above is not dense vs dense
    assert any(single[name][0] != single["dense"] for name in CONFIGS)


def _as_tensor_parallel(model, tp_size: int):
    """The model as transformers leaves one loaded with tp_plan="auto" over `tp_size` ranks, as far as
    `layer_infos` reads it (no process group needed)."""
    model._tp_size = tp_size
    assert any(k.endswith("k_proj") and v == "colwise" for k, v in model.tp_plan.items())
    return model


def test_heads_per_rank():
    model = random_model("tiny-llama", dtype=torch.float32, seed=0)
    assert {(i.num_heads, i.num_kv_heads) for i in layer_infos(model)} == {(4, 2)}
    _as_tensor_parallel(model, 2)
    assert {(i.num_heads, i.num_kv_heads, i.group_size) for i in layer_infos(model)} == {(2, 1, 2)}


def test_a_ranks_per_head_state_is_its_share_of_the_models():
    """Per-head state made for the whole model — spotlight's hash functions, drawn or trained for every kv head —
    is cut to the rank's heads: rank 1 of 2 holds kv heads 2 and 3 of 4."""
    import dataclasses

    from sparsekv.selectors.spotlight import untrained_hash
    from sparsekv.step import LayerInfo

    whole = LayerInfo(layer_idx=1, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, scaling=0.25)
    second = dataclasses.replace(whole, num_heads=4, num_kv_heads=2, shards=2, shard=1)
    assert second.kv_heads == slice(2, 4)
    full, part = untrained_hash(whole, 64, "mlp", 0).state_tensors(), untrained_hash(second, 64, "mlp", 0)
    assert part.num_heads == 2
    for name, tensor in part.state_tensors().items():
        torch.testing.assert_close(tensor, full[name][2:4])


def test_heads_not_dividing_by_tp_size_are_refused():
    # 2 key/value heads over 4 ranks would split a GQA group
    model = _as_tensor_parallel(random_model("tiny-llama", dtype=torch.float32, seed=0), 4)
    with pytest.raises(ConfigError, match="divide by the TP size 4"):
        sparsekv.enable(model, CONFIGS["oracle-topk"])
    assert not any(hasattr(m, RUNTIME_ATTR) for m in model.modules())  # refused before touching the model


def _bench_generate(tmp_path, *launch: str, tp: int = 2) -> subprocess.CompletedProcess:
    args = ["-m", "sparsekv.cli", "bench", "generate", "--model", "tiny-llama", "--layers", "3", "--context", "48",
            "--batch", "2", "--rows", "hf-dense,dense,oracle-topk", "--budget", "0.2", "--new-tokens", "3",
            "--warmup", "1", "--tp", str(tp), "--output", str(tmp_path / "generate.json")]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the random checkpoint the ranks load goes there
    return subprocess.run([*launch, *args], capture_output=True, text=True, timeout=300, env=env, check=False)


def test_bench_generate_tensor_parallel(tmp_path):
    """`torchrun --nproc-per-node 2 -m sparsekv.cli bench generate --tp 2`: every row through model.generate() on
    a tensor-parallel model; rank 0 writes the table, with the stats of both ranks' heads."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    result = _bench_generate(tmp_path, *launch)
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((tmp_path / "generate.json").read_text())
    assert payload["tp"] == 2 and payload["rank"] == 0
    rows = {r["row"]: r for r in payload["summary"]}
    assert set(rows) == {"hf-dense", "dense", "oracle-topk"} and all(r["tpot_ms"] > 0 for r in rows.values())
    assert rows["oracle-topk"]["sparse_layers"] == [2]
    assert 0 < rows["oracle-topk"]["avg_budget_tokens"] < 0.5 * rows["oracle-topk"]["avg_context_tokens"]


def test_bench_generate_tensor_parallel_needs_torchrun(tmp_path):
    result = _bench_generate(tmp_path, sys.executable)
    assert result.returncode != 0
    assert "launch it as `torchrun --nproc-per-node 2" in " ".join((result.stdout + result.stderr).split())
    assert "Traceback" not in result.stderr


if __name__ == "__main__":
    # the same comparison on accelerators: save a model dir (e.g. `python tests/test_distributed.py save DIR`), then
    # `torchrun --nproc-per-node 2 tests/test_distributed.py DIR` (NCCL on GPUs: transformers picks the backend)
    if sys.argv[1] == "save":
        random_model("tiny-llama", dtype=torch.float32, seed=0).save_pretrained(sys.argv[2])
        sys.exit(0)
    model = load_tensor_parallel(sys.argv[1], torch.float32)
    PROMPT = PROMPT.to(model.device)
    out = _decode(model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        single = (
            AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to(model.device).eval()
        )
        reference = _decode(single)
        for rank, got in enumerate(gathered):
            for name in ("dense", *CONFIGS):
                mine, ref = (
                    (got[name], reference[name]) if name == "dense" else (got[name][0], reference[name][0])
                )
                print(
                    f"rank {rank} {name}: {'EQUAL' if mine == ref else 'DIFFERENT'}",
                    got[name][1:] if name != "dense" else "",
                )
    dist.destroy_process_group()
