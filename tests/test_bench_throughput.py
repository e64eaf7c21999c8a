"""`sparsekv bench throughput` on CPU: the max-batch search, the summary, the argument checks, the table, JSON and
plot — with an injected probe and injected timings (the real measurement needs a CUDA device)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import throughput
from sparsekv.bench.throughput import largest_fitting_batch, memory_limit_bytes, run_throughput, summarize
from sparsekv.config import ConfigError


def _threshold_probe(threshold: int):
    """A probe under which batches up to `threshold` fit; it records every batch tried."""
    tried: list[int] = []

    def fits(batch: int) -> bool:
        tried.append(batch)
        return batch <= threshold

    return fits, tried


@pytest.mark.parametrize("threshold", [1, 2, 16, 17, 31, 100, 1023])
@pytest.mark.parametrize("upper", [1024, 1500])
def test_search_finds_the_exact_largest_batch(threshold, upper):
    fits, tried = _threshold_probe(threshold)
    assert largest_fitting_batch(fits, upper) == threshold
    assert len(tried) == len(set(tried)), f"a batch was tried twice: {tried}"
    assert len(tried) <= 2 * upper.bit_length()  # doubling then bisecting, not a linear scan
    assert threshold + 1 in tried  # the answer is shown: the next batch was tried and did not fit


def test_search_reports_0_when_batch_1_does_not_fit():
    fits, tried = _threshold_probe(0)
    assert largest_fitting_batch(fits, 64) == 0
    assert tried == [1]


@pytest.mark.parametrize(("threshold", "upper"), [(64, 64), (10**6, 100), (7, 7), (1, 1)])
def test_search_stops_at_the_upper_bound(threshold, upper):
    fits, tried = _threshold_probe(threshold)
    assert largest_fitting_batch(fits, upper) == upper
    assert max(tried) == upper


def _fake_measure(max_batches: dict[str, int], tpot_ms: dict[str, float]):
    """Injected timings: `row` fits up to max_batches[row], each step takes tpot_ms[row] at any batch."""

    def measure(row: str, batch: int) -> dict:
        if batch > max_batches[row]:
            return {"row": row, "error": "out of memory: injected"}
        tpot = tpot_ms[row] / 1e3
        return {"row": row, "tpot_ms": tpot_ms[row], "tokens_per_s": batch / tpot, "peak_bytes": int(batch * 1e9),
                "decode_paths": {"graph": 30, "eager: first decode step": 1}}  # fmt: skip

    return measure


def _fake_result(tmp_rows=("hf-dense", "dense", "self-index", "quest")) -> dict:
    measure = _fake_measure({"hf-dense": 12, "dense": 12, "self-index": 50, "quest": 0},
                            {"hf-dense": 40.0, "dense": 30.0, "self-index": 25.0, "quest": 10.0})  # fmt: skip
    found = throughput.throughput_search(tmp_rows, measure, max_batch=256)
    return {"device": "fake GPU", "model": "tiny", "layers": 2, "context": 4096, "memory_limit_bytes": int(80e9),
            "budget": 0.02, **found}  # fmt: skip


def test_search_rows_and_summary_math():
    result = _fake_result()
    rows = {r["row"]: r for r in result["rows"]}
    assert [r["max_batch"] for r in result["rows"]] == [12, 12, 50, 0]
    # dense (30 ms at 12) beats hf-dense (40 ms at 12): it is the reference
    assert result["reference_row"] == "dense"
    assert rows["dense"]["tokens_per_s"] == pytest.approx(12 / 0.030)
    assert rows["dense"]["vs_dense"] == pytest.approx(1.0)
    assert rows["hf-dense"]["vs_dense"] == pytest.approx(30 / 40)
    assert rows["self-index"]["vs_dense"] == pytest.approx((50 / 0.025) / (12 / 0.030))
    assert rows["self-index"]["first_oom_batch"] == 51 and not rows["self-index"]["capped"]
    assert rows["self-index"]["peak_bytes"] == int(50e9)  # the measurement is the run at the largest batch
    assert rows["quest"]["vs_dense"] is None and "batch 1 does not fit" in rows["quest"]["error"]
    assert [t["batch"] for t in rows["dense"]["tries"]] == sorted(t["batch"] for t in rows["dense"]["tries"])


def test_summary_takes_a_compiled_dense_row_as_the_reference():
    reference, rows = summarize([{"row": "self-index@compile", "tokens_per_s": 450.0},
                                 {"row": "dense@compile", "tokens_per_s": 200.0},
                                 {"row": "spotlight", "tokens_per_s": 100.0}])  # fmt: skip
    assert reference == "dense@compile"
    assert [r["vs_dense"] for r in rows] == [pytest.approx(2.25), pytest.approx(1.0), pytest.approx(0.5)]


def test_summary_without_a_dense_row_has_no_ratio():
    reference, rows = summarize([{"row": "self-index", "tokens_per_s": 100.0}, {"row": "dense", "error": "oom"}])
    assert reference is None and rows[0]["vs_dense"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": ("hf-dense", "no-such-method")}, "no-such-method"),
        ({"rows": ("hf-static-compile",)}, "compile again for every batch"),
        ({"rows": ()}, "names no row"),
        ({"context": 1}, "context must be >= 2"),
        ({"memory_gb": 0}, "--memory-gb must be > 0"),
        ({"memory_gb": -3.0}, "--memory-gb must be > 0"),
        ({"max_batch": 0}, "max_batch must be >= 1"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size must be >= 1"),
        ({"rows": ("self-index",), "budget": -1.0}, "budget"),
        ({"model": "no-such-model"}, "unknown model"),
    ],
)
def test_bad_inputs_are_refused_before_any_model(kwargs, message, monkeypatch):
    from sparsekv.bench import e2e

    real_build = e2e.build_model

    def build_on_meta_only(*args, **kw):  # the checks may look at the shape on "meta", never build a real model
        assert kw.get("device") == "meta", "a model was built before the arguments were checked"
        return real_build(*args, **kw)

    monkeypatch.setattr(e2e, "build_model", build_on_meta_only)
    with pytest.raises(ConfigError, match=message):
        run_throughput(**{"model": "tiny-llama", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs")
def test_cpu_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="measures GPU memory: it needs a CUDA device"):
        run_throughput("tiny-llama", context=64, memory_gb=1.0)


def test_memory_limit_checks():
    total, free = int(80e9), int(79e9)
    assert memory_limit_bytes(None, total, free) == free
    assert memory_limit_bytes(40.0, total, free) == int(40e9)
    with pytest.raises(ConfigError, match="above the device's 80.0 GB"):
        memory_limit_bytes(81.0, total, free)
    with pytest.raises(ConfigError, match="above the 79.0 GB free"):
        memory_limit_bytes(79.5, total, free)


def test_cli_help():
    from typer.testing import CliRunner

    from sparsekv.bench.cli import app

    res = CliRunner().invoke(app, ["throughput", "--help"])
    assert res.exit_code == 0, res.output
    for option in ("--memory-gb", "--rows", "--prefill-chunk-size", "--max-batch", "--plot", "--output"):
        assert option in res.output


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from typer.testing import CliRunner

    from sparsekv.bench import cli

    seen = {}

    def fake_run(model, **kwargs):
        seen.update(kwargs, model=model)
        return _fake_result()

    monkeypatch.setattr(throughput, "run_throughput", fake_run)
    monkeypatch.setattr(cli.console, "width", 220)  # the table on one line per row
    out, png = tmp_path / "t.json", tmp_path / "plots" / "t.png"
    res = CliRunner().invoke(cli.app, ["throughput", "--rows", "hf-dense, dense,self-index", "--memory-gb", "40",
                                       "--output", str(out), "--plot", str(png)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert seen["rows"] == ("hf-dense", "dense", "self-index") and seen["memory_gb"] == 40.0
    assert "tokens/s vs dense at its max batch" in res.output and "batch 1 does not fit" in res.output
    assert "5.00x" in res.output  # self-index: 2000 tokens/s at 50 vs dense's 400 at 12
    payload = json.loads(out.read_text())
    assert {r["row"]: r["max_batch"] for r in payload["rows"]}["self-index"] == 50
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails as when not installed
    with pytest.raises(ConfigError, match=r"pip install 'sparsekv\[eval\]'"):
        throughput.plot_throughput(_fake_result(), tmp_path / "t.png")
