"""Evaluation harness, the pure parts: scorers, RULER task generators (exact answers), IoU maths, compare table,
result cache, CLI parsing. No model needed."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import ResultCache, config_key, describe
from sparsekv.eval.haystack import NEEDLE, QUESTION
from sparsekv.eval.ruler import TASKS, Resources, generate_sample
from sparsekv.eval.scoring import (
    default_keywords,
    keyword_recall,
    rougeL_f,
    rougeL_recall,
    string_match_all,
    string_match_part,
)

# ---------------------------------------------------------------------------------------------------- scorers


def test_rougeL_recall_counts_the_needle_tokens_recovered_in_order():
    # the needle has 21 rouge tokens; the answer brings back 8 of them as a common subsequence
    assert rougeL_recall("Eat a sandwich and sit in Dolores Park.", NEEDLE) == pytest.approx(8 / 21)
    assert rougeL_recall(NEEDLE, NEEDLE) == 1.0
    assert rougeL_recall("", NEEDLE) == 0.0


def test_rougeL_f_is_one_for_identical_outputs_and_symmetric():
    assert rougeL_f("the cat sat", "the cat sat") == 1.0
    assert rougeL_f("!!", "!!") == 1.0  # nothing rouge-score can tokenize, but identical
    # LCS 2 of 3 and 2 of 4 tokens: P = 2/3, R = 2/4 -> F = 4/7
    assert rougeL_f("the cat sat", "the dog cat ran") == pytest.approx(4 / 7)
    assert rougeL_f("the dog cat ran", "the cat sat") == pytest.approx(4 / 7)


def test_keyword_recall_is_case_and_punctuation_insensitive_and_matches_word_starts():
    keywords = ["sandwich", "Dolores Park", "sunny"]
    assert keyword_recall("Eat SANDWICHES in dolores-park!", keywords) == pytest.approx(2 / 3)
    assert keyword_recall("a sunny day, a sandwich, Dolores Park", keywords) == 1.0
    assert keyword_recall("unsunny", ["sunny"]) == 0.0  # word starts only
    with pytest.raises(ValueError):
        keyword_recall("x", [])


def test_default_keywords_drop_what_the_question_already_says():
    assert default_keywords(NEEDLE, QUESTION) == ["eat", "sandwich", "sit", "dolores", "park", "sunny", "day"]


def test_string_match_all_and_part():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == 2 / 3
    assert string_match_part("The numbers are 1234567.", ["9999999", "1234567"]) == 1.0
    assert string_match_part("nothing", ["9999999"]) == 0.0
    assert string_match_all("Answer: ABCDE", ["abcde"]) == 1.0


# ---------------------------------------------------------------------------------------------------- RULER


def _resources() -> Resources:
    syllables = (["ka", "lo", "mi", "nu", "po", "ra"], ["be", "di", "fo", "gu", "ha"],
                 ["sk", "tr", "pl", "mn", "zz", "qq", "xv", "wy", "yt", "jj"])  # fmt: skip
    words = tuple(a + b + c for a in syllables[0] for b in syllables[1] for c in syllables[2])
    sentences = tuple(f"Sentence number {i} talks about {words[i % len(words)]} and nothing else." for i in range(400))
    return Resources(sentences, words)


def count_words(text: str) -> int:
    return len(text.split())


def sample(task: str, length: int = 400, index: int = 0, seed: int = 0):
    return generate_sample(task, length, index, seed, count_words, _resources())


# pinned: a change here means previously published RULER numbers can no longer be reproduced
PINNED = {
    "niah_single": ("8881869",),
    "niah_multikey": ("3823121",),
    "niah_multivalue": ("2366244", "4840528", "7892041", "9792762"),
    "variable_tracking": ("JQDAN", "SUERA", "XSVND", "MSZPG", "CGEKC"),
    "common_words": ("radizz", "pofomn", "rahaxv", "nubezz", "mibeyt", "mihask", "lofomn", "poguqq", "mifopl",
                     "rabexv"),
    "freq_words": ("yotc", "vixlf", "ptqlcv"),
}  # fmt: skip


@pytest.mark.parametrize("task", TASKS)
def test_generated_sample_is_reproducible_fits_the_length_and_is_pinned(task):
    first, again = sample(task), sample(task)
    assert first == again
    assert first.answers == PINNED[task]
    assert 400 - 12 <= count_words(first.context) <= 400
    assert sample(task, index=1).answers != first.answers
    assert sample(task, seed=1).answers != first.answers
    assert first.score(" ".join(first.answers)) == 1.0
    assert first.score("no idea") == 0.0


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue"])
def test_niah_answers_are_the_numbers_of_the_asked_key(task):
    s = sample(task)
    needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", s.context)
    key = re.search(r"numbers? for (\S+) mentioned", s.context.splitlines()[-1]).group(1)
    assert key in s.answer_prefix
    assert sorted(v for k, v in needles if k == key) == sorted(s.answers)
    assert len(needles) == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4}[task]
    assert len({k for k, _ in needles}) == (4 if task == "niah_multikey" else 1)


def test_variable_tracking_answers_are_every_variable_holding_the_value():
    s = sample("variable_tracking")
    value = re.search(r"the value (\d+)", s.context.splitlines()[-1]).group(1)
    assignments = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.context)
    holds = set()
    for name, rhs in assignments:  # chain statements appear in order
        if rhs == value or rhs.removeprefix("VAR ") in holds:
            holds.add(name)
    assert holds == set(s.answers) and len(s.answers) == 5


def test_common_words_answers_are_the_ten_most_frequent_list_entries():
    s = sample("common_words", length=600)
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", s.context)).most_common()
    assert {w for w, _ in counts[:10]} == set(s.answers)
    assert counts[9][1] > counts[10][1]


def test_freq_words_answers_are_the_three_most_frequent_coded_words_in_order():
    s = sample("freq_words")
    body = s.context.splitlines()[1]
    counts = Counter(body.split()).most_common(4)
    assert tuple(w for w, _ in counts[:3]) == s.answers
    assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]


def test_ruler_rejects_unknown_tasks_and_too_short_lengths():
    with pytest.raises(ConfigError, match="unknown ruler task"):
        sample("qa_single")
    with pytest.raises(ConfigError, match="too few"):
        sample("common_words", length=30)


# ---------------------------------------------------------------------------------------------------- IoU maths


def test_compare_selection_iou_recall_and_mass_against_the_oracle():
    from sparsekv.eval.iou import compare_selection
    from sparsekv.step import DecodeStep, LayerInfo, Selection

    layer = LayerInfo(layer_idx=2, num_layers=4, num_heads=1, num_kv_heads=1, head_dim=1, scaling=1.0)
    keys = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).view(1, 1, 6, 1)
    query = torch.ones(1, 1, 1, 1)  # weights grow with the key: oracle top-3 = {3, 4, 5}
    step = DecodeStep(query=query, keys=keys, values=keys, visible=torch.ones(1, 1, 6, dtype=torch.bool),
                      forced=torch.zeros(1, 1, 6, dtype=torch.bool), budgets=torch.tensor([[3]]), layer=layer,
                      gqa="group")  # fmt: skip
    selection = Selection(indices=torch.tensor([[[[5, 4, 0]]]]), valid=torch.ones(1, 1, 1, 3, dtype=torch.bool))
    metrics = compare_selection(step, selection)
    weights = torch.softmax(torch.arange(6.0), -1)
    assert metrics["iou"].item() == pytest.approx(2 / 4)
    assert metrics["recall"].item() == pytest.approx(2 / 3)
    assert metrics["mass"].item() == pytest.approx(float(weights[[0, 4, 5]].sum()), rel=1e-5)
    assert metrics["oracle_mass"].item() == pytest.approx(float(weights[3:].sum()), rel=1e-5)


# ---------------------------------------------------------------------------------------------------- compare


def test_markdown_table_lists_values_tokens_errors_and_missing_methods():
    from sparsekv.eval.compare import CompareResult, markdown_table

    result = CompareResult(task="ppl", methods=["dense", "oracle-topk", "quest"], budgets=[0.02, 0.1],
                           missing=["spotlight"], rows=[
        {"method": "dense", "budget": None, "value": 20.0, "avg_budget_tokens": None, "error": None},
        {"method": "oracle-topk", "budget": 0.02, "value": 25.5, "avg_budget_tokens": 40.2, "error": None},
        {"method": "oracle-topk", "budget": 0.1, "value": 21.0, "avg_budget_tokens": 201.0, "error": None},
        {"method": "quest", "budget": 0.02, "value": None, "avg_budget_tokens": None, "error": "ConfigError: x"},
        {"method": "quest", "budget": 0.1, "value": 22.25, "avg_budget_tokens": 200.0, "error": None},
    ])  # fmt: skip
    table = markdown_table(result)
    lines = table.splitlines()
    assert lines[0] == "| method (perplexity, lower is better) | budget 2% | budget 10% |"
    assert lines[2] == "| dense | 20.00 | 20.00 |"
    assert lines[3] == "| oracle-topk | 25.50 (40 tok) | 21.00 (201 tok) |"
    assert lines[4] == "| quest | error | 22.25 (200 tok) |"
    assert "- not registered in this build: spotlight" in table
    assert "- quest @ budget 2%: ConfigError: x" in table


def test_run_compare_runs_dense_once_reports_missing_and_survives_failures():
    from sparsekv.eval.compare import run_compare

    calls = []

    def run(config):
        calls.append(describe(config))
        if config.method == "streaming" and config.budget == 0.02:
            raise RuntimeError("boom")
        return {"ppl": 10.0 if config.method == "dense" else 12.0, "avg_budget_tokens": 5.0}

    result = run_compare("ppl", run, ["dense", "streaming", "not-a-method"], [0.02, 0.1],
                         options={"sink_tokens": 2, "not-a-method:bogus": 1})  # fmt: skip
    assert calls == ["dense", "streaming@0.02 sink_tokens=2", "streaming@0.1 sink_tokens=2"]
    assert result.missing == ["not-a-method"]
    errors = [r for r in result.rows if r["error"]]
    assert len(errors) == 1 and errors[0]["error"] == "RuntimeError: boom"


@pytest.mark.parametrize(("options", "message"), [
    ({"oracle-topk:rescore": 1}, "names 'oracle-topk', which is not among the methods run"),
    ({"rescore": 8}, "option 'rescore': none of dense, streaming has it"),
])  # fmt: skip
def test_run_compare_refuses_an_option_no_method_of_the_run_takes(options, message):
    """An option that would apply to nothing is a typo or a wrong method list: one error before any cell runs."""
    from sparsekv.eval.compare import run_compare

    with pytest.raises(ConfigError, match=message):
        run_compare("ppl", lambda config: pytest.fail("ran a cell"), ["dense", "streaming"], [0.1], options=options)


def test_run_compare_with_no_known_method_is_an_error():
    from sparsekv.eval.compare import run_compare

    with pytest.raises(ConfigError, match="no method to compare: nope not registered; known: .*dense"):
        run_compare("ppl", lambda config: pytest.fail("ran a cell"), ["nope"], [0.02])


# ---------------------------------------------------------------------------------------------------- cache, CLI parsing


def test_result_cache_keys_and_resume(tmp_path):
    cache = ResultCache(tmp_path)
    key = {"model": "m", "config": config_key(SparseConfig(method="oracle-topk", budget=0.1))}
    calls = []
    compute = lambda: calls.append(1) or {"value": 1.5}
    assert cache.cached("ppl", key, compute) == {"value": 1.5}
    assert cache.cached("ppl", key, compute) == {"value": 1.5}
    assert len(calls) == 1 and cache.hits == 1
    other = {**key, "config": config_key(SparseConfig(method="oracle-topk", budget=0.2))}
    cache.cached("ppl", other, compute)
    assert len(calls) == 2
    # a dense config ignores budget/options; a sparse one carries the digest of its method's source
    assert config_key(SparseConfig(method="dense", budget=0.3)) == {"method": "dense"}
    assert len(config_key(SparseConfig(method="oracle-topk"))["source"]) == 12


def test_cli_parsers():
    from sparsekv.eval.cli import parse_budgets, parse_depths, parse_ints

    assert parse_ints("500,1K,2.5k", "--lengths") == (500, 1000, 2500)
    assert parse_depths("0,0.5,1") == (0.0, 0.5, 1.0)
    assert parse_depths("0,50,100") == (0.0, 0.5, 1.0)
    assert parse_budgets("0.02,0.1,256") == [0.02, 0.1, 256]
    with pytest.raises(ConfigError):
        parse_ints("a,b", "--lengths")


def test_only_cached_cache_reports_missing_cells_instead_of_computing(tmp_path):
    from sparsekv.eval.common import CellNotCached
    from sparsekv.eval.compare import markdown_table, run_compare

    ResultCache(tmp_path).put("ppl", {"m": "dense"}, {"ppl": 10.0, "avg_budget_tokens": None})
    reader = ResultCache(tmp_path, only_cached=True)
    with pytest.raises(CellNotCached):
        reader.cached("ppl", {"m": "other"}, lambda: pytest.fail("computed"))

    def run(config):
        return reader.cached("ppl", {"m": config.method}, lambda: pytest.fail("computed"))

    table = markdown_table(run_compare("ppl", run, ["dense", "streaming"], [0.1]))
    assert "| dense | 10.00 |" in table and "| streaming | not run |" in table
    assert "- not run yet: streaming @ budget 10%" in table


def test_stale_ok_accepts_a_cell_of_an_older_method_version(tmp_path):
    from sparsekv.eval.common import CellNotCached

    old = {"m": "x", "config": {"method": "quest", "budget": 0.1, "source": "aaaa", "data": "none"}}
    new = {"m": "x", "config": {"method": "quest", "budget": 0.1, "source": "bbbb", "data": "none"}}
    ResultCache(tmp_path).put("ppl", old, {"ppl": 3.0})
    with pytest.raises(CellNotCached):
        ResultCache(tmp_path, only_cached=True).cached("ppl", new, lambda: pytest.fail("computed"))
    lenient = ResultCache(tmp_path, only_cached=True, stale_ok=True)
    assert lenient.cached("ppl", new, lambda: pytest.fail("computed")) == {"ppl": 3.0} and lenient.stale == 1
    other = {"m": "x", "config": {"method": "quest", "budget": 0.2, "source": "aaaa", "data": "none"}}
    with pytest.raises(CellNotCached):
        lenient.cached("ppl", other, lambda: pytest.fail("computed"))


# ---------------------------------------------------------------------------------------------------- the eval extra

EVAL_EXTRA_LINE = "this needs the eval extra: pip install 'sparsekv[eval]'"


def test_plots_without_matplotlib_raise_the_eval_extra_line(monkeypatch, tmp_path):
    from sparsekv.eval import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on an install without the extra
    with pytest.raises(ConfigError, match=f"^{re.escape(EVAL_EXTRA_LINE)}$"):
        plots.require_plots()
    with pytest.raises(ConfigError, match=f"^{re.escape(EVAL_EXTRA_LINE)}$"):
        plots.budget_curve([{"method": "dense", "budget": None, "value": 1.0}], tmp_path / "c.png", "ppl", "t")
    assert not (tmp_path / "c.png").exists()


def test_rouge_scorers_without_rouge_score_raise_the_eval_extra_line_before_any_cell(monkeypatch):
    from sparsekv.eval import scoring
    from sparsekv.eval.common import ModelHandle
    from sparsekv.eval.fidelity import run_fidelity
    from sparsekv.eval.niah import NiahSettings, run_niah

    monkeypatch.setitem(sys.modules, "rouge_score", None)
    scoring._rouge.cache_clear()  # a scorer built by an earlier test would hide the missing package
    with pytest.raises(ConfigError, match=f"^{re.escape(EVAL_EXTRA_LINE)}$"):
        scoring.rougeL_f("the cat sat", "the dog sat")
    # the tasks that score with Rouge-L check first: loading this model would fail with another error
    nowhere = ModelHandle(spec="/nonexistent/model")
    with pytest.raises(ConfigError, match=re.escape(EVAL_EXTRA_LINE)):
        run_fidelity(nowhere, SparseConfig(method="dense"), prompts=["one two three"])
    with pytest.raises(ConfigError, match=re.escape(EVAL_EXTRA_LINE)):
        run_niah(nowhere, SparseConfig(method="dense"), NiahSettings(lengths=(100,), depths=(0.5,)))
    assert keyword_recall("a sandwich", ["sandwich"]) == 1.0  # the other scorers need no extra


def test_cli_reports_a_missing_eval_extra_as_one_line_before_running(tmp_path):
    # matplotlib blocked in a child process; --output implies a plot, so `eval iou` must stop before loading the
    # model (a model that does not exist) and write nothing
    out = tmp_path / "iou.json"
    code = ("import sys; sys.modules['matplotlib'] = None; from sparsekv.cli import main; "
            "sys.argv = ['sparsekv', 'eval', 'iou', '--model', sys.argv[1], '--no-cache', '-q', '--output', sys.argv[2]]; "
            "main()")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "no-model"), str(out)], check=False,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (proc.stdout + proc.stderr).strip().splitlines() == [f"error: {EVAL_EXTRA_LINE}"]
    assert not out.exists()


@pytest.mark.parametrize("given,used", [(None, 0), (4096, 4096)])
def test_prompt_tasks_measure_the_method_not_its_dense_fallback(monkeypatch, given, used):
    """On CUDA generation attends densely below a method's speed crossover; an evaluation turns that off unless the
    config sets it (what the GPU eval grids need: every context they run lies below lsh's crossover)."""
    from sparsekv.eval import common

    seen = []
    monkeypatch.setattr(common.sparsekv, "generate", lambda model, tok, prompt, config, **kw: seen.append(config))

    class Handle:
        def get(self):
            return None, None

    config = SparseConfig(method="lsh", budget=0.1, dense_below=given)
    common.greedy(Handle(), config, "prompt", max_new_tokens=4, seed=0)
    assert seen[0].dense_below == used and seen[0].method == "lsh" and seen[0].budget == 0.1
