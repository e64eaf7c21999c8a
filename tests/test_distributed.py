"""Sparse decoding of a model loaded with transformers' own tensor parallelism (`tp_plan="auto"`).

Two CPU processes (gloo) each hold half of a tiny random llama's heads (4 query, 2 key/value): each rank's
SparseCache holds its key/value head and selects for it. Greedy tokens must equal the single-process run's.
"""

from __future__ import annotations

import os
import queue
import socket
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
from sparsekv.models import random_model

WORLD = 2
TIMEOUT_S = 90  # the whole 2-rank run takes a few seconds; a hung collective must fail CI, not stall it
PROMPT = (torch.arange(37) * 7 % 500 + 3).view(1, -1)
NEW_TOKENS = 12
CONFIGS = {
    "oracle-topk": SparseConfig(method="oracle-topk", budget=0.3, dense_layers=(0,)),
    "quest": SparseConfig(method="quest", budget=0.3, dense_layers=(0,)),
    "lsh": SparseConfig(method="lsh", budget=0.3, dense_layers=(0,)),
}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def _decode(model) -> dict:
    """Dense greedy tokens, then each config's sparse greedy tokens and budget stats."""
    args = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    with torch.inference_mode():
        out = {"dense": model.generate(PROMPT, **args)[0].tolist()}
        for name, config in CONFIGS.items():
            with sparsekv.enabled(model, config) as runtime:
                tokens = model.generate(PROMPT, **args)[0].tolist()
                heads = layer_infos(model)[1].num_kv_heads
                out[name] = (tokens, runtime.cache.stats.summary(), heads)
    return out


def _load_tensor_parallel(model_dir: str):
    """`from_pretrained(model_dir, tp_plan="auto")` over the initialised process group's ranks."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # releases before DistributedConfig take tp_plan directly
        return AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    config = DistributedConfig(tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=config, dtype=torch.float32
    ).eval()


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
        model = _load_tensor_parallel(model_dir)
        assert model.tp_size == WORLD
        results.put((rank, _decode(model)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure goes back to the test as text, so a rank never hangs it
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
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
            tokens, stats, heads = out[name]
            assert heads == 1, (rank, name)  # this rank's shard: one of the two key/value heads
            assert tokens == single[name][0], (rank, name)
            # decode steps ran sparse in layer 1 only (layer 0 is dense), keeping ~30% of the context
            assert list(stats["per_layer_avg_tokens"]) == [1], (rank, name)
            assert stats["avg_budget_fraction"] < 0.5, (rank, name, stats)
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


def test_heads_not_dividing_by_tp_size_are_refused():
    # 2 key/value heads over 4 ranks would split a GQA group
    model = _as_tensor_parallel(random_model("tiny-llama", dtype=torch.float32, seed=0), 4)
    with pytest.raises(ConfigError, match="divide by the TP size 4"):
        sparsekv.enable(model, CONFIGS["oracle-topk"])
    assert not any(hasattr(m, RUNTIME_ATTR) for m in model.modules())  # refused before touching the model


if __name__ == "__main__":
    # the same comparison on accelerators: save a model dir (e.g. `python tests/test_distributed.py save DIR`), then
    # `torchrun --nproc-per-node 2 tests/test_distributed.py DIR` (NCCL on GPUs: transformers picks the backend)
    import sys

    if sys.argv[1] == "save":
        random_model("tiny-llama", dtype=torch.float32, seed=0).save_pretrained(sys.argv[2])
        sys.exit(0)
    model = _load_tensor_parallel(sys.argv[1])
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
