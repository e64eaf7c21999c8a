"""One small end-to-end run per evaluation task on a tiny random model (byte tokenizer), plus the CLI; and a
short perplexity sanity check on the real embedded model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsekv.config import SparseConfig
from sparsekv.eval.common import ResultCache


@pytest.fixture(scope="module")
def tiny():
    from sparsekv.eval.testing import tiny_handle

    return tiny_handle(layers=4)


@pytest.fixture(scope="module")
def text():
    from sparsekv.assets import haystack_text

    return haystack_text()[:60000]


def test_ppl_dense_equals_a_covering_budget_and_sparse_reports_budget(tiny, text, tmp_path):
    from sparsekv.eval.ppl import PplSettings, run_ppl

    settings = PplSettings(context=260, prefix=60, chunk=64)
    cache = ResultCache(tmp_path)
    dense = run_ppl(tiny, SparseConfig(method="dense"), settings, text=text, cache=cache)
    full = run_ppl(tiny, SparseConfig(method="oracle-topk", budget=100_000), settings, text=text)
    sparse = run_ppl(tiny, SparseConfig(method="oracle-topk", budget=0.1), settings, text=text, with_dense=True,
                     cache=cache)  # fmt: skip
    assert dense["tokens"] == 200 and dense["avg_budget_tokens"] is None
    assert full["ppl"] == pytest.approx(dense["ppl"], rel=1e-4)
    assert sparse["dense_ppl"] == pytest.approx(dense["ppl"], rel=1e-9)  # reused from the cache
    assert cache.hits == 1
    # queries see 61..259 tokens: 10% rounded up per query
    assert sparse["avg_budget_tokens"] == pytest.approx(sum(math.ceil(0.1 * n) for n in range(61, 260)) / 199)
    assert math.isfinite(sparse["ppl"]) and sparse["ppl"] != dense["ppl"]


def test_niah_grid_scores_and_heatmap(tiny, text, tmp_path):
    from sparsekv.eval.niah import NiahSettings, run_niah, score_answer
    from sparsekv.eval.plots import niah_heatmap

    settings = NiahSettings(lengths=(200, 300), depths=(0.0, 1.0), max_new_tokens=3, seed=1)
    payload = run_niah(tiny, SparseConfig(method="oracle-topk", budget=0.2), settings, haystack=text)
    assert [(c["length"], c["depth"]) for c in payload["cells"]] == [(200, 0.0), (200, 1.0), (300, 0.0), (300, 1.0)]
    assert payload["scorer"] == "keyword-recall" and payload["keywords"] == ["sandwich", "Dolores Park", "sunny"]
    assert 0 <= payload["score"] <= 1 and payload["avg_budget_tokens"] > 0
    assert score_answer("Eat a sandwich in Dolores Park on a sunny day.", settings)["score"] == 1.0
    png = niah_heatmap(payload, tmp_path / "niah.png")
    assert png.stat().st_size > 1000


def test_ruler_runs_every_task(tiny, text):
    from sparsekv.eval.ruler import TASKS, run_ruler

    payload = run_ruler(tiny, SparseConfig(method="streaming", budget=0.2), lengths=(1200,), samples=1, filler=text)
    assert set(payload["score_by_task"]) == set(TASKS)
    assert all(len(c["answers"]) >= 1 for c in payload["cells"])
    assert payload["metric"] == "string_match_all"


def test_iou_oracle_is_perfect_and_streaming_is_not(tiny, text, tmp_path):
    from sparsekv.eval.iou import IouSettings, run_iou
    from sparsekv.eval.plots import iou_map

    settings = IouSettings(context=300, queries=16)
    oracle = run_iou(tiny, SparseConfig(method="oracle-topk", budget=0.1), settings, text=text)
    assert oracle["iou_per_layer"][:2] == [None, None]  # dense layers
    assert oracle["mean_iou"] == pytest.approx(1.0) and oracle["mean_recall"] == pytest.approx(1.0)
    streaming = run_iou(tiny, SparseConfig(method="streaming", budget=0.1), settings, text=text)
    assert streaming["mean_iou"] < 0.9
    assert streaming["mean_mass"] <= streaming["mean_oracle_mass"] + 1e-6
    assert iou_map(streaming, tmp_path / "iou.png").stat().st_size > 1000


def test_iou_of_a_method_that_stores_its_own_keys(tiny, text):
    """self-index keeps only compressed keys: the oracle reads a full-precision shadow of every key stored, the
    prompt's included, so a budget covering everything scores 1 and a small one scores below it."""
    from sparsekv.eval.iou import IouSettings, run_iou

    settings = IouSettings(context=300, queries=16)
    full = run_iou(tiny, SparseConfig(method="self-index", budget=10_000), settings, text=text)
    assert full["mean_iou"] == pytest.approx(1.0)
    small = run_iou(tiny, SparseConfig(method="self-index", budget=0.1), settings, text=text)
    assert 0 < small["mean_iou"] < 0.95


def test_fidelity_covering_budget_reproduces_dense(tiny, tmp_path):
    from sparsekv.eval.fidelity import read_prompts, run_fidelity

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there, how are you today? I am fine."}\n{"prompt": "one two three"}\n')
    prompts = read_prompts(path)
    payload = run_fidelity(tiny, SparseConfig(method="oracle-topk", budget=10_000), prompts=prompts,
                           max_new_tokens=6)  # fmt: skip
    assert payload["exact"] == 1.0 and payload["rougeL"] == 1.0 and len(payload["cells"]) == 2


def test_cli_compare_and_ppl_write_json_markdown_and_plot(tiny, tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    import sparsekv.models
    from sparsekv.eval.cli import register

    monkeypatch.setattr(
        sparsekv.models, "load_model", lambda spec, dtype, device: (tiny.model, tiny.tokenizer)
    )
    text_file = tmp_path / "text.txt"
    from sparsekv.assets import haystack_text

    text_file.write_text(haystack_text()[:5000])
    app = typer.Typer()
    register(app)
    app.command()(lambda: None)  # a second command keeps `eval` a sub-command
    runner = CliRunner()
    out = tmp_path / "cmp" / "ppl.json"
    result = runner.invoke(app, ["eval", "compare", "--task", "ppl", "--methods", "dense,oracle-topk,nope",
                                 "--budgets", "0.05,0.2", "--model", "tiny", "--context", "200", "--prefix", "50",
                                 "--text-file", str(text_file), "--cache-dir", str(tmp_path / "cache"), "-q",
                                 "--output", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["missing_methods"] == ["nope"]
    assert [(r["method"], r["budget"]) for r in payload["rows"]] == [("dense", None), ("oracle-topk", 0.05),
                                                                     ("oracle-topk", 0.2)]  # fmt: skip
    values = {r["budget"]: r["value"] for r in payload["rows"]}
    assert values[0.2] < values[0.05]  # more budget, closer to dense on this text
    assert (tmp_path / "cmp" / "ppl.md").read_text().count("| oracle-topk |") == 1
    assert (tmp_path / "cmp" / "ppl.png").stat().st_size > 1000
    single = tmp_path / "ppl.json"
    result = runner.invoke(app, ["eval", "ppl", "--method", "oracle-topk", "--budget", "0.05", "--model", "tiny",
                                 "--context", "200", "--prefix", "50", "--text-file", str(text_file),
                                 "--cache-dir", str(tmp_path / "cache"), "-q", "--output", str(single)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(single.read_text())["ppl"] == pytest.approx(values[0.05])  # same cell, from the cache


#: the cells of test_result_cache_file_names_are_pinned, computed before the runners shared one skeleton
PINNED_CELLS = [
    "generate/dcd7b9e6dfebd10ded6d03d7.json",
    "iou/7a6a5f376c6de439ac2d9e7b.json",
    "niah/fabc1739ac5f3a140e582e8c.json",
    "ppl/36605424189b0d3788a49820.json",
    "ruler/be5c4aa1ca6f914c82078cdb.json",
]


def test_result_cache_file_names_are_pinned(tiny, text, tmp_path):
    """The file of a cell is named by the digest of its key: a change to any task's key orphans every cached cell
    (bump PROTOCOL_VERSION on purpose, then update these names)."""
    from sparsekv.eval.fidelity import run_fidelity
    from sparsekv.eval.iou import IouSettings, run_iou
    from sparsekv.eval.niah import NiahSettings, run_niah
    from sparsekv.eval.ppl import PplSettings, run_ppl
    from sparsekv.eval.ruler import run_ruler

    dense, cache = SparseConfig(method="dense"), ResultCache(tmp_path)
    run_ppl(tiny, dense, PplSettings(context=120, prefix=60, chunk=64), text=text[:3000], cache=cache)
    run_iou(tiny, dense, IouSettings(context=120, queries=8), text=text[:3000], cache=cache)
    run_niah(tiny, dense, NiahSettings(lengths=(200,), depths=(0.5,), max_new_tokens=1), haystack=text, cache=cache)
    run_ruler(tiny, dense, tasks=("niah_single",), lengths=(600,), samples=1, filler=text, cache=cache)
    run_fidelity(tiny, dense, prompts=["one two three"], max_new_tokens=1, cache=cache)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert names == PINNED_CELLS


@pytest.mark.slow
def test_real_model_ppl_is_sane_and_oracle_approaches_dense(real_model):
    from sparsekv.eval.common import ModelHandle
    from sparsekv.eval.ppl import PplSettings, run_ppl

    model, tokenizer = real_model
    handle = ModelHandle(spec="default", model=model, tokenizer=tokenizer, name="default")
    settings = PplSettings(context=384, prefix=128, chunk=128)
    torch.manual_seed(0)
    dense = run_ppl(handle, SparseConfig(method="dense"), settings)
    half = run_ppl(handle, SparseConfig(method="oracle-topk", budget=0.5), settings)
    assert 5 < dense["ppl"] < 80
    assert dense["ppl"] * 0.97 < half["ppl"] < dense["ppl"] * 1.1


def test_result_json_records_the_options_a_method_ran_with():
    """The config block of every eval JSON: the options given, and every option at the value the run used."""
    from sparsekv.eval.common import config_dict

    twilight = config_dict(SparseConfig(method="twilight"))
    assert twilight["options"] == {} and twilight["top_p"] is None
    assert twilight["effective_options"] == {"base": "lsh", "bits": 4, "top_p": 0.95}
    lsh = config_dict(SparseConfig(method="lsh", budget=0.1, options={"bits": 256}))
    assert lsh["effective_options"]["bits"] == 256 and lsh["effective_options"]["variant"] == "simhash"
    json.dumps(config_dict(SparseConfig(method="self-index", budget=0.1)))  # JSON-able as written


def test_a_chunked_prefix_is_its_own_cached_cell(tiny, text, tmp_path):
    """`--prefill-chunk-size` can change a compressing method's numbers: its cells are cached apart from the
    one-forward ones, and the payload says which it was."""
    from sparsekv.eval.ppl import PplSettings, run_ppl

    config, cache = SparseConfig(method="self-index", budget=0.5), ResultCache(tmp_path)
    whole = run_ppl(tiny, config, PplSettings(context=120, prefix=60, chunk=64), text=text[:3000], cache=cache)
    chunked = run_ppl(tiny, config, PplSettings(context=120, prefix=60, chunk=64, prefill_chunk=16),
                      text=text[:3000], cache=cache)  # fmt: skip
    assert len(list(tmp_path.rglob("*.json"))) == 2
    assert whole["prefill_chunk"] is None and chunked["prefill_chunk"] == 16
    assert math.isfinite(whole["ppl"]) and math.isfinite(chunked["ppl"])
