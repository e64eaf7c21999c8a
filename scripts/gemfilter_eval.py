"""GemFilter measurements on the default model (CPU): NIAH grid vs dense, prefill time and peak memory.

    PYTHONPATH=src python scripts/gemfilter_eval.py --skip-niah --reps 2 --output results/gemfilter/prefill_8k_cpu.json

Parts (both on by default; --skip-niah / --skip-prefill):
  niah     lengths x depths needle prompts (sparsekv.eval.haystack.needle_prompt + models.chat_prompt), greedy
           `sparsekv.generate` with dense and with gemfilter (keep, filter_layer); score = keyword recall of the
           needle's answer in the output.
  prefill  time to the first token at --prefill-tokens, dense vs gemfilter, each method in a fresh subprocess.
           Both compute the logits of the last position only (`logits_to_keep=1`), so the comparison is about the
           attention/MLP work, not about the [N, vocab] logits that a full-logits forward would add.
           Wall and process CPU seconds are both reported (the CPU is shared: CPU seconds are the steadier figure).
           Peak memory = peak RSS during the call minus RSS just before it, sampled every 2 ms from /proc/self/statm
           in a background thread (torch CPU allocations are invisible to tracemalloc; RSS sees them; a fresh
           process per method keeps one method's freed-but-retained heap from hiding the other's peak).
The per-layer needle probe that chooses a filter layer is `sparsekv gemfilter-scan`.

The out-of-sample NIAH protocol (--heldout dev, then --heldout test; results/gemfilter/niah_dev.json,
niah_heldout.json/.md) goes through the harness (sparsekv.eval.niah.run_niah) with its result cache, so an
interrupted run resumes: dev scores a handful of (filter_layer, window, pool) candidates on the harness's needle
and picks one by a fixed rule; test runs dense, the method default and the paper's setting on other needles,
depths and haystack offsets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ANSWER_KEYWORDS = ("eat", "sandwich", "sit", "dolores", "park", "sunny", "day")


def keyword_recall(text: str) -> float:
    words = set(re.findall(r"[a-z]+", text.lower()))
    return sum(k in words for k in ANSWER_KEYWORDS) / len(ANSWER_KEYWORDS)


class PeakRSS:
    """Peak resident set size above the level at entry, sampled from /proc/self/statm."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.base = 0

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def load():
    from sparsekv.models import load_model

    torch.manual_seed(0)
    return load_model("default", dtype=torch.float32)


def needle_ids(tokenizer, context: int, depth: float) -> tuple[str, torch.Tensor]:
    from sparsekv.eval.haystack import needle_prompt
    from sparsekv.models import chat_prompt

    prompt = chat_prompt(tokenizer, needle_prompt(tokenizer, context_tokens=context, depth=depth))
    return prompt, tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]


def run_niah(args) -> dict:
    import sparsekv
    from sparsekv import SparseConfig
    from sparsekv.prefill.gemfilter import last_selection

    model, tokenizer = load()
    configs = {} if args.skip_dense else {"dense": SparseConfig(method="dense")}
    for layer, window, pool in args.variants:
        options = {"keep": args.keep, "filter_layer": layer, "window": window, "pool": pool}
        name = f"gemfilter-{args.keep}-L{'default' if layer is None else layer}-w{window}-p{pool}"
        configs[name] = SparseConfig("gemfilter", options=options)
    rows = []
    for context in args.lengths:
        for depth in args.depths:
            prompt, ids = needle_ids(tokenizer, context, depth)
            row = {"context": context, "depth": depth, "prompt_tokens": ids.shape[1]}
            for name, config in configs.items():
                result = sparsekv.generate(
                    model, tokenizer, prompt, config, max_new_tokens=args.max_new_tokens
                )
                row[name] = {
                    "text": result.texts[0],
                    "score": keyword_recall(result.texts[0]),
                    "prefill_seconds": result.prefill_seconds,
                }
                if config.method == "gemfilter":
                    row[name]["filter_layer"] = last_selection(model).filter_layer
                print(
                    f"[niah] {context}@{depth} {name}: {row[name]['score']:.2f} "
                    f"({result.prefill_seconds:.2f}s) {result.texts[0].strip()[:90]!r}",
                    flush=True,
                )
            rows.append(row)
    means = {name: statistics.mean(r[name]["score"] for r in rows) for name in configs}
    return {"configs": {name: c.options for name, c in configs.items()}, "rows": rows, "mean_score": means}


def prefill_one(
    method: str, tokens: int, reps: int, keep: int, filter_layer: int | None, window: int = 1, pool: int = 5
) -> dict:
    """In this (fresh) process: warm up, then time/measure `reps` prefills of a `tokens`-token needle prompt."""
    from sparsekv.prefill.gemfilter import gem_filter

    model, tokenizer = load()
    _, ids = needle_ids(tokenizer, tokens, 0.5)

    @torch.inference_mode()
    def prefill(input_ids):
        mask = torch.ones_like(input_ids)
        if method == "gemfilter":
            result = gem_filter(
                model, input_ids, mask, keep=keep, filter_layer=filter_layer, window=window, pool=pool
            )
            input_ids, mask = result.input_ids, result.attention_mask
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            use_cache=False,
            logits_to_keep=1,
        )
        return int(out.logits[0, -1].argmax())

    prefill(ids[:, -512:])  # warm-up
    runs = []
    for _ in range(reps):
        with PeakRSS() as peak:
            start, cpu_start = time.perf_counter(), time.process_time()
            token = prefill(ids)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        runs.append(
            {
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "peak_rss_delta_mb": peak.delta_mb,
                "first_token": token,
            }
        )
        print(
            f"[prefill] {method} {ids.shape[1]} tokens: {seconds:.2f}s wall, {cpu_seconds:.2f}s cpu, "
            f"peak +{peak.delta_mb:.0f} MB",
            flush=True,
        )
    return {
        "method": method,
        "filter_layer": filter_layer,
        "window": window,
        "pool": pool,
        "prompt_tokens": ids.shape[1],
        "threads": torch.get_num_threads(),
        "runs": runs,
    }


def run_prefill(args) -> dict:
    results = {}
    for method in ("gemfilter", "dense"):
        command = [
            sys.executable,
            __file__,
            "--prefill-one",
            method,
            "--prefill-tokens",
            str(args.prefill_tokens),
            "--reps",
            str(args.reps),
            "--keep",
            str(args.keep),
        ]
        if args.filter_layer is not None:
            command += ["--filter-layer", str(args.filter_layer)]
        command += ["--window", str(args.window), "--pool", str(args.pool)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"prefill run of {method} failed")
        lines = done.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith("@@JSON@@")), flush=True)
        results[method] = json.loads(next(line for line in lines if line.startswith("@@JSON@@"))[8:])
    dense_s = min(r["seconds"] for r in results["dense"]["runs"])
    gem_s = min(r["seconds"] for r in results["gemfilter"]["runs"])
    dense_cpu = min(r["cpu_seconds"] for r in results["dense"]["runs"])
    gem_cpu = min(r["cpu_seconds"] for r in results["gemfilter"]["runs"])
    dense_mb = max(r["peak_rss_delta_mb"] for r in results["dense"]["runs"])
    gem_mb = max(r["peak_rss_delta_mb"] for r in results["gemfilter"]["runs"])
    results["summary"] = {
        "dense_seconds": dense_s,
        "gemfilter_seconds": gem_s,
        "speedup": dense_s / gem_s,
        "dense_cpu_seconds": dense_cpu,
        "gemfilter_cpu_seconds": gem_cpu,
        "cpu_speedup": dense_cpu / gem_cpu,
        "dense_peak_mb": dense_mb,
        "gemfilter_peak_mb": gem_mb,
    }
    return results


# ----------------------------------------------------------------------------------- held-out NIAH protocol
#
# The NIAH result (gemfilter k=256 >= dense on 1K-3K) is checked out of sample: the scoring settings
# (window, pool, filter_layer) are chosen on a dev grid, then the chosen method default is run once on a test
# grid whose needles, questions, depths and haystack offsets the dev step never saw. Both grids go through the
# harness (sparsekv.eval.niah.run_niah: needle placement, chat template, greedy decoding, keyword recall).

HELDOUT_LENGTHS = (1000, 2000, 3000)
HELDOUT_KEEP = 256

#: dev grid: the harness's default needle, haystack from the start of the essays
DEV_DEPTHS = (0.25, 0.5, 0.75)
#: candidates scored on the dev grid (a handful: the CPU is shared); the paper's setting is the first. 0.4 = 40% of
#: the depth = layer 12 (the recorded dev run named these "Ldefault": 40% was the default then)
DEV_CANDIDATES = (
    {"filter_layer": 0.4, "window": 1, "pool": 5},
    {"filter_layer": 0.4, "window": 8, "pool": 31},
    {"filter_layer": 14, "window": 8, "pool": 31},
    {"filter_layer": 18, "window": 8, "pool": 31},
    {"filter_layer": 18, "window": 24, "pool": 31},
    {"filter_layer": 14, "window": 8, "pool": 15},
)

#: test grid: other needles (fact, question, answer keywords), other depths, each needle in another part of the
#: essays (haystack starts at the first paragraph after `offset` characters). Written before any test run.
TEST_DEPTHS = (0.1, 0.4, 0.65, 0.9)
TEST_NEEDLES = (
    {
        "needle": "The secret ingredient in Grandma Rosa's famous lasagna is a spoonful of cinnamon and smoked paprika.",
        "question": "What is the secret ingredient in Grandma Rosa's famous lasagna?",
        "keywords": ("cinnamon", "paprika"),
        "offset": 100_000,
    },
    {
        "needle": "The password to the old lighthouse on Cape Morrow is silver pelican.",
        "question": "What is the password to the old lighthouse on Cape Morrow?",
        "keywords": ("silver", "pelican"),
        "offset": 250_000,
    },
    {
        "needle": "Marcus hid the spare house key under the blue ceramic frog next to the garden shed.",
        "question": "Where did Marcus hide the spare house key?",
        "keywords": ("blue", "frog", "shed"),
        "offset": 400_000,
    },
    {
        "needle": "The Riverton kite festival is held every April on the hills north of the old mill.",
        "question": "When and where is the Riverton kite festival held?",
        "keywords": ("April", "hills", "mill"),
        "offset": 550_000,
    },
)


def dev_choice(scores: dict[str, float], candidates: dict[str, dict]) -> str:
    """The selection rule, fixed before the test run: best mean dev score; ties go to the cheaper filter pass
    (earlier layer; a fraction counts as that share of 30 layers), then the smaller window and pool."""

    def cost(name):
        options = candidates[name]
        layer = options["filter_layer"]
        layer = round(layer * 30) if isinstance(layer, float) else layer
        return (-round(scores[name], 6), layer, options["window"], options["pool"])

    return min(candidates, key=cost)


def haystack_from(offset: int) -> str:
    from sparsekv.assets import haystack_text

    text = haystack_text()
    if offset == 0:
        return text
    start = text.find("\n\n", offset)
    if start < 0:
        raise SystemExit(f"no paragraph break after offset {offset}")
    return text[start + 2 :]


def niah_grid(handle, cache, config, needle: dict | None, depths, haystack: str) -> dict:
    from sparsekv.eval.niah import NiahSettings, run_niah

    extra = {} if needle is None else {"needle": needle["needle"], "question": needle["question"],
                                       "keywords": tuple(needle["keywords"])}  # fmt: skip
    settings = NiahSettings(lengths=HELDOUT_LENGTHS, depths=tuple(depths), max_new_tokens=32, **extra)
    return run_niah(handle, config, settings, haystack=haystack, cache=cache)


def cell_rows(payload: dict) -> list[dict]:
    return [{"length": c["length"], "depth": c["depth"], "prompt_tokens": c["prompt_tokens"], "score": c["score"],
             "answer": c["answer"]} for c in payload["cells"]]  # fmt: skip


def run_heldout(args) -> None:
    from sparsekv import SparseConfig
    from sparsekv.eval.common import ModelHandle, ResultCache, default_cache_dir
    from sparsekv.prefill.gemfilter import GemFilter

    handle = ModelHandle("default")
    cache = ResultCache(default_cache_dir())
    out = args.output or Path(f"results/gemfilter/niah_{'dev' if args.heldout == 'dev' else 'heldout'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"protocol": "dev grid chooses (window, pool, filter_layer); test grid checks the method default",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
              "threads": torch.get_num_threads(), "keep": HELDOUT_KEEP, "lengths": list(HELDOUT_LENGTHS),
              "scorer": "keyword-recall (sparsekv.eval.scoring)", "max_new_tokens": 32}  # fmt: skip

    report["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()

    def save():
        out.write_text(json.dumps(report, indent=2) + "\n")

    if args.heldout == "dev":
        haystack = haystack_from(0)
        report.update(
            depths=list(DEV_DEPTHS), needle="harness default (San Francisco sandwich)", haystack_offset=0
        )
        configs = {"dense": SparseConfig("dense")}
        candidates = {}
        for options in DEV_CANDIDATES:
            name = "L{}-w{}-p{}".format(options["filter_layer"],
                                        options["window"], options["pool"])  # fmt: skip
            candidates[name] = options
            configs[name] = SparseConfig("gemfilter", options={"keep": HELDOUT_KEEP, **options})
        report["candidates"] = candidates
        report["grids"] = {}
        for name, config in configs.items():
            payload = niah_grid(handle, cache, config, None, DEV_DEPTHS, haystack)
            report["grids"][name] = {"score": payload["score"], "score_by_length": payload["score_by_length"],
                                     "cells": cell_rows(payload)}  # fmt: skip
            print(f"[dev] {name}: {payload['score']:.3f} {payload['score_by_length']}", flush=True)
            save()
        scores = {name: report["grids"][name]["score"] for name in candidates}
        report["choice"] = dev_choice(scores, candidates)
        report["choice_options"] = candidates[report["choice"]]
        save()
        print(f"[dev] choice: {report['choice']} {report['choice_options']}", flush=True)
        return

    # test: dense, the method's default (keep only) and the paper's setting, on every held-out needle
    from sparsekv.prefill.gemfilter import PAPER_OPTIONS as paper

    configs = {
        "dense": SparseConfig("dense"),
        "gemfilter-default": SparseConfig("gemfilter", options={"keep": HELDOUT_KEEP}),
        "gemfilter-paper": SparseConfig("gemfilter", options={"keep": HELDOUT_KEEP, **paper}),
    }
    report.update(depths=list(TEST_DEPTHS), needles=[dict(n, keywords=list(n["keywords"])) for n in TEST_NEEDLES],
                  default_options=GemFilter.options_of(configs["gemfilter-default"]),
                  paper_options=GemFilter.options_of(configs["gemfilter-paper"]), grids={})  # fmt: skip
    for index, needle in enumerate(TEST_NEEDLES):
        haystack = haystack_from(needle["offset"])
        for name, config in configs.items():
            payload = niah_grid(handle, cache, config, needle, TEST_DEPTHS, haystack)
            report["grids"].setdefault(name, {})[str(index)] = {"score": payload["score"],
                                                                "cells": cell_rows(payload)}  # fmt: skip
            print(
                f"[test] needle {index} {name}: {payload['score']:.3f} {payload['score_by_length']}",
                flush=True,
            )
            save()
    summary = {}
    for name in configs:
        cells = [c for grid in report["grids"][name].values() for c in grid["cells"]]
        summary[name] = {"mean": statistics.mean(c["score"] for c in cells),
                         "by_length": {str(n): statistics.mean(c["score"] for c in cells if c["length"] == n)
                                       for n in HELDOUT_LENGTHS},
                         "by_needle": {i: g["score"] for i, g in report["grids"][name].items()}}  # fmt: skip
    report["summary"] = summary
    dense_cells = [c for g in report["grids"]["dense"].values() for c in g["cells"]]
    default_cells = [c for g in report["grids"]["gemfilter-default"].values() for c in g["cells"]]
    report["default_cells_below_dense"] = sum(
        g["score"] < d["score"] for g, d in zip(default_cells, dense_cells)
    )
    report["default_ge_dense"] = summary["gemfilter-default"]["mean"] >= summary["dense"]["mean"]
    add_dev_choice(report, out.with_name("niah_dev.json"))
    save()
    out.with_suffix(".md").write_text(heldout_markdown(report))
    print(f"[test] {json.dumps(summary)}", flush=True)


def add_dev_choice(report: dict, dev_path: Path) -> None:
    """Records the dev step's choice and scores next to the test results (the default must be that choice)."""
    from sparsekv.prefill.gemfilter import default_filter_layer

    layers = 30  # SmolLM2-135M
    options = dict(report["default_options"])
    options["filter_layer"] = (
        default_filter_layer(layers) if options["filter_layer"] is None else options["filter_layer"]
    )
    report["chosen_settings"] = {**options, "resolved_for": f"{layers} layers"}
    if dev_path.is_file():
        dev = json.loads(dev_path.read_text())
        report["dev"] = {"file": str(dev_path), "choice": dev.get("choice"), "choice_options": dev.get("choice_options"),
                         "scores": {name: grid["score"] for name, grid in dev["grids"].items()}}  # fmt: skip


def heldout_markdown(report: dict) -> str:
    names = list(report["grids"])
    lines = [
        "# GemFilter NIAH, held-out grid (SmolLM2-135M-Instruct, CPU float32)",
        "",
        f"Command: `{report['command']}` ({report['date']}). keep={report['keep']} tokens; greedy, 32 new tokens; "
        + f"score = {report['scorer']}.",
        f"gemfilter-default options: `{report['default_options']}`; gemfilter-paper: `{report['paper_options']}`.",
        "",
        f"Chosen settings (default, resolved): `{report.get('chosen_settings')}`; dev choice: "
        + f"`{report.get('dev', {}).get('choice')}`, dev scores `{report.get('dev', {}).get('scores')}` "
        + "(results/gemfilter/niah_dev.json; harness needle, depths 0.25/0.5/0.75; Ldefault / L0.4 = layer 12).",
        "",
        "| needle | length | depth | prompt tokens | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for index in report["grids"]["dense"]:
        for row, cell in enumerate(report["grids"]["dense"][index]["cells"]):
            scores = [report["grids"][name][index]["cells"][row]["score"] for name in names]
            lines.append(f"| {index} | {cell['length']} | {cell['depth']} | {cell['prompt_tokens']} | "
                         + " | ".join(f"{s:.2f}" for s in scores) + " |")  # fmt: skip
    lines += ["", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    summary = report["summary"]
    lines.append("| mean | " + " | ".join(f"**{summary[n]['mean']:.3f}**" for n in names) + " |")
    for length in report["lengths"]:
        lines.append(f"| {length} tokens | " + " | ".join(f"{summary[n]['by_length'][str(length)]:.3f}"
                                                          for n in names) + " |")  # fmt: skip
    for index, needle in enumerate(report["needles"]):
        lines.append(f"| needle {index} | " + " | ".join(f"{summary[n]['by_needle'][str(index)]:.3f}"
                                                        for n in names) + " |")  # fmt: skip
    lines += ["", "Needles (keywords; haystack offset in characters):", ""]
    for index, needle in enumerate(report["needles"]):
        lines.append(f"{index}. {needle['needle']} Q: {needle['question']} ({', '.join(needle['keywords'])}; "
                     f"{needle['offset']})")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_variant(text: str) -> tuple[int | None, int, int]:
    parts = text.split(":") + ["1", "5"][len(text.split(":")) - 1 :]
    return None if parts[0] == "default" else int(parts[0]), int(parts[1]), int(parts[2])


def main() -> None:
    from sparsekv.prefill.gemfilter import GemFilter

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="1000,2000,3000")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--keep", type=int, default=256)
    parser.add_argument("--filter-layer", type=int, default=None, help="prefill bench filter layer")
    parser.add_argument(
        "--variants",
        default="default:8:31",
        help="NIAH gemfilter variants, comma-separated layer:window[:pool] ('default' = the method's default layer)",
    )
    parser.add_argument("--skip-dense", action="store_true", help="NIAH without the dense reference")
    parser.add_argument("--window", type=int, default=GemFilter.window, help="prefill bench gemfilter window")
    parser.add_argument("--pool", type=int, default=GemFilter.pool, help="prefill bench gemfilter pool")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-niah", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--prefill-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--heldout",
        choices=("dev", "test"),
        default=None,
        help="the out-of-sample NIAH protocol: dev (choose settings) or test (check the default)",
    )
    args = parser.parse_args()
    if args.heldout:
        run_heldout(args)
        return
    if args.prefill_one:
        result = prefill_one(
            args.prefill_one,
            args.prefill_tokens,
            args.reps,
            args.keep,
            args.filter_layer,
            args.window,
            args.pool,
        )
        print("@@JSON@@" + json.dumps(result))
        return
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.depths = [float(x) for x in args.depths.split(",")]
    args.variants = [parse_variant(v) for v in args.variants.split(",")]
    report = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "keep": args.keep,
    }
    if not args.skip_niah:
        report["niah"] = run_niah(args)
        print(f"[niah] mean keyword recall: {report['niah']['mean_score']}", flush=True)
    if not args.skip_prefill:
        report["prefill"] = run_prefill(args)
        print(f"[prefill] {report['prefill']['summary']}", flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
