"""Twilight measurements on the default model: decode-faithful perplexity and the estimator's kept mass.

Per window of the embedded haystack: dense prefill of `prefix` tokens, then the rest in chunks through the enabled
model with one SparseCache (each query selects from its own causal past, so chunked = token-by-token). Runs

  dense | quest@C for each candidate budget C | quest@C + top-p P (INT4 estimator) for each C and P, each followed
  by quest@F with F = the mean fraction top-p kept | optionally: oracle-page@C (Quest's pages ranked by their
  exact attention mass: what any page-level score can reach), oracle-topk@C, oracle-topk@F, and all tokens + top-p
  P (the paper's PG-19 setting: the pruner over full attention)

With --measure-every N > 0 every N-th prune call of the first quest@C + top-p run is also scored with exact
attention weights: kept mass relative to the candidates (exact softmax over the candidates per query head,
group-summed: what the estimator approximates) and as a share of the whole attention (softmax over all visible
tokens) of the INT4 keep set and, as shadows that do not affect the run, of the 2-bit, 8-bit and exact-weight keep
sets (the paper's Fig. 6), both over the quest candidates and over all visible tokens. This is ~5x slower.

Every run is written to --output as it finishes; rerunning with the same output skips the runs already there
(same windows), so an interrupted evaluation resumes.

    PYTHONPATH=src python scripts/twilight_eval.py --windows 3 --start 16384 --top-p 0.95 0.98 0.99 \
        --measure-every 0 --oracle-page --full-top-p --output results/twilight_ppl_4k.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import sparsekv
from sparsekv import SparseCache, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.pruners.top_p import TopPPruner, budget_report, compact
from sparsekv.selectors.base import to_selection_heads
from sparsekv.selectors.lsh import unique_ranks
from sparsekv.selectors.oracle import exact_weights
from sparsekv.selectors.quest import QuestSelector
from sparsekv.step import DecodeStep, Selection

ESTIMATORS = ("2", "4", "8", "exact")
MEASURE_EVERY = 1  # score every n-th prune call of a layer with exact weights (--measure-every)


class MeasuredPruner(TopPPruner):
    """The 4-bit pruner of the run, plus exact-weight scoring of its keep set and of shadow estimators."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.shadows = {
            "2": TopPPruner(self.config, self.layer, p=self.p, bits=2, log=False),
            "8": TopPPruner(self.config, self.layer, p=self.p, bits=8, log=False),
            "exact": TopPPruner(self.config, self.layer, p=self.p, exact=True, log=False),
        }
        self.sums: dict[str, float] = defaultdict(float)
        self.samples: dict[str, list[torch.Tensor]] = defaultdict(list)

    def prefill(self, keys, values, query) -> None:
        super().prefill(keys, values, query)
        for shadow in self.shadows.values():
            shadow.prefill(keys, values, query)

    def append(self, keys, values) -> None:
        super().append(keys, values)
        for shadow in self.shadows.values():
            shadow.append(keys, values)

    def _score(self, scope: str, step: DecodeStep, selection: Selection, exact: torch.Tensor) -> torch.Tensor:
        """Scores every estimator on one candidate set; returns the 4-bit keep mask."""
        cand = exact.gather(-1, selection.indices) * selection.valid  # exact weights of the candidates
        cand_mass = cand.sum(-1)
        rows = cand_mass.numel()
        self.sums[f"{scope}/rows"] += rows
        self.sums[f"{scope}/candidate_mass_of_total"] += float(cand_mass.sum())
        keep4 = None
        # exact weights the way the pruner sees them: softmax over the candidates per query head, group-summed
        exact_keep, exact_cand = self.shadows["exact"].keep_mask(step, selection)
        for name in ESTIMATORS:
            pruner = self if name == "4" else self.shadows[name]
            keep, estimated = (
                (exact_keep, exact_cand) if name == "exact" else pruner.keep_mask(step, selection)
            )
            kept = (cand * keep).sum(-1)
            rel = (exact_cand * keep).sum(-1)
            key = f"{scope}/{name}"
            self.sums[f"{key}/kept_mass_rel"] += float(rel.sum())
            self.sums[f"{key}/kept_mass_total"] += float(kept.sum())
            self.sums[f"{key}/kept_tokens"] += float(keep.sum())
            self.sums[f"{key}/below_p"] += float((rel < self.p).sum())
            self.samples[f"{key}/kept_mass_rel"].append(rel.flatten().half())
            if name == "4":
                keep4 = keep
                est = (estimated * keep).sum(-1)
                self.sums[f"{key}/estimated_mass_min"] = min(
                    self.sums.get(f"{key}/estimated_mass_min", 1.0), float(est.min())
                )
            if name == "exact":  # minimality: the sort-based smallest set on the same exact weights
                ranked = exact_cand.sort(-1, descending=True).values
                before = ranked.cumsum(-1) - ranked
                minimal = (before < self.p).sum(-1).clamp(min=1)
                self.sums[f"{scope}/minimal_tokens"] += float(minimal.sum())
        self.sums[f"{scope}/candidate_tokens"] += float(selection.valid.sum())
        return keep4

    def prune(self, step: DecodeStep, selection: Selection) -> Selection:
        self.calls = getattr(self, "calls", 0) + 1
        if (self.calls - 1) % MEASURE_EVERY:
            return super().prune(step, selection)
        exact = exact_weights(step).float()
        exact = exact / exact.sum(-1, keepdim=True)
        keep = self._score("quest", step, selection, exact)
        b, s, q, n = exact.shape
        everything = Selection(
            indices=torch.arange(n).expand(b, s, q, n), valid=step.visible[:, None].expand(b, s, q, n)
        )
        self._score("all", step, everything, exact)
        pruned = compact(selection, keep)
        self.candidate_log.append(selection.counts().to("cpu", torch.int32))
        self.kept_log.append(pruned.counts().to("cpu", torch.int32))
        return pruned


class OraclePage(QuestSelector):
    """Diagnostic, not a method: Quest's page layout and budget rule (own page first, then whole pages best-first,
    the most recent tokens of the last page), with each page scored by its exact attention mass (group-summed)
    instead of the min/max bound. Its perplexity is the best any page-level score can do at that budget."""

    name = "oracle-page"

    def score(self, step: DecodeStep) -> torch.Tensor:
        self._sync(step)
        n, q_len, size = step.keys.shape[-2], step.query.shape[2], self.page_size
        rel = torch.arange(n, device=step.keys.device)[None, :] - self.start[:, None]
        token_page, offset = rel.clamp(min=0) // size, rel.clamp(min=0) % size
        pages = int(token_page.max()) + 1
        weights = exact_weights(step).float()  # [B, S, Q, N], zero where not visible
        scores = weights.new_zeros(*weights.shape[:3], pages)
        scores.scatter_add_(-1, token_page[:, None, None, :].expand_as(weights), weights)
        scores = to_selection_heads(scores, step)
        query_page = token_page[:, n - q_len :]
        earlier = torch.arange(pages, device=scores.device)[None, None, :] < query_page[:, :, None]
        ranks = unique_ranks(scores.masked_fill(~earlier[:, None], float("-inf")))
        shape = (*scores.shape[:3], n)
        key = ranks.gather(-1, token_page[:, None, None, :].expand(shape)) * size + offset[:, None, None, :]
        own = token_page[:, None, None, :] == query_page[:, None, :, None]
        return torch.where(own, float((pages + 1) * size) + offset[:, None, None, :], key)


# a diagnostic registered for this script only (the selector is built by name inside SparseCache)
sparsekv.registry.METHODS.setdefault(OraclePage.name, f"{__name__}:OraclePage")


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor, config: SparseConfig, prefix: int, chunk: int, measured: bool):
    cache = SparseCache.for_model(model, config)
    if measured:
        for layer in cache.layers:
            if layer.pruner is not None:
                layer.pruner = MeasuredPruner(layer.pruner.config, layer.pruner.layer)
    total = ids.shape[1]
    nll = 0.0
    start = time.perf_counter()
    with sparsekv.enabled(model, config):
        out = model(input_ids=ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        nll += float(
            F.cross_entropy(out.logits[0, -1:].float(), ids[0, prefix : prefix + 1], reduction="sum")
        )
        for lo in range(prefix, total - 1, chunk):
            hi = min(lo + chunk, total - 1)
            logits = model(input_ids=ids[:, lo:hi], **cache_kwargs(model, cache), use_cache=True).logits[0].float()
            nll += float(F.cross_entropy(logits, ids[0, lo + 1 : hi + 1], reduction="sum"))
    return nll, total - prefix, time.perf_counter() - start, cache


def run(model, windows, config, args, measured=False, label=None) -> dict:
    nll = tokens = seconds = 0.0
    stats_rows, fraction_sum, kept_sum = 0, 0.0, 0.0
    reports, sums, samples = [], defaultdict(float), defaultdict(list)
    per_window = []
    for ids in windows:
        w_nll, w_tokens, w_seconds, cache = window_nll(model, ids, config, args.prefix, args.chunk, measured)
        nll, tokens, seconds = nll + w_nll, tokens + w_tokens, seconds + w_seconds
        per_window.append(math.exp(w_nll / w_tokens))
        for i in range(len(cache.layers)):
            kept, seen = cache.stats.layer_counts(i)
            if kept.numel():
                stats_rows += kept.numel()
                kept_sum += float(kept.double().sum())
                fraction_sum += float((kept.double() / seen.clamp(min=1).double()).sum())
        if config.top_p is not None or config.method == "twilight":
            reports.append(budget_report(cache))
        if measured:
            for layer in cache.layers:
                if isinstance(layer.pruner, MeasuredPruner):
                    for k, v in layer.pruner.sums.items():
                        if k.endswith("_min"):
                            sums[k] = min(sums.get(k, 1.0), v)
                        else:
                            sums[k] += v
                    for k, v in layer.pruner.samples.items():
                        samples[k].extend(v)
        print(f"  {label}: window ppl {per_window[-1]:.4f} ({w_seconds:.0f}s)", file=sys.stderr, flush=True)
    result = {
        "label": label,
        "method": config.method,
        "budget": config.budget,
        "top_p": config.top_p,
        "ppl": math.exp(nll / tokens),
        "per_window_ppl": per_window,
        "tokens": tokens,
        "seconds": seconds,
        "mean_kept_tokens": kept_sum / stats_rows if stats_rows else None,
        "mean_kept_fraction": fraction_sum / stats_rows if stats_rows else None,
    }
    if reports:
        result["budget_report"] = merge_reports(reports)
    if measured:
        result["estimator"] = estimator_table(sums, samples, config.top_p)
    return result


def merge_reports(reports: list[dict]) -> dict:
    """Window reports -> per layer / head means (windows have equal lengths, so plain means)."""
    layers = sorted(reports[0]["layers"])
    out = {"mean_kept": sum(r["mean_kept"] for r in reports) / len(reports),
           "mean_candidates": sum(r["mean_candidates"] for r in reports) / len(reports),
           "mean_fraction": sum(r["mean_fraction"] for r in reports) / len(reports),
           "quantiles_kept_first_window": reports[0]["quantiles_kept"], "layers": {}}  # fmt: skip
    for layer in layers:
        rows = [r["layers"][layer] for r in reports]
        heads = len(rows[0]["per_head_mean_kept"])
        out["layers"][layer] = {
            "mean_kept": sum(r["mean_kept"] for r in rows) / len(rows),
            "mean_fraction": sum(r["mean_fraction"] for r in rows) / len(rows),
            "per_head_mean_kept": [
                sum(r["per_head_mean_kept"][h] for r in rows) / len(rows) for h in range(heads)
            ],
            "quantiles_kept": rows[0]["quantiles_kept"],
        }
    steps = [r["per_step_mean_kept"] for r in reports if r["per_step_mean_kept"]]
    if steps:
        width = min(len(s) for s in steps)
        mean = [sum(s[i] for s in steps) / len(steps) for i in range(width)]
        out["per_step_mean_kept_every_256"] = mean[::256]
    return out


def estimator_table(sums: dict, samples: dict, p: float) -> dict:
    table = {}
    for scope in ("quest", "all"):
        rows = sums[f"{scope}/rows"]
        entry = {
            "rows": int(rows),
            "mean_candidates": sums[f"{scope}/candidate_tokens"] / rows,
            "candidate_mass_of_total": sums[f"{scope}/candidate_mass_of_total"] / rows,
            "mean_minimal_tokens_exact": sums[f"{scope}/minimal_tokens"] / rows,
        }
        for name in ESTIMATORS:
            key = f"{scope}/{name}"
            rel = torch.cat(samples[f"{key}/kept_mass_rel"]).float()
            entry[name + "bit" if name != "exact" else "exact"] = {
                "mean_kept_mass_rel_candidates": sums[f"{key}/kept_mass_rel"] / rows,
                "mean_kept_mass_of_total": sums[f"{key}/kept_mass_total"] / rows,
                "fraction_rows_below_p": sums[f"{key}/below_p"] / rows,
                "p10_kept_mass_rel": float(torch.quantile(rel[:: max(1, len(rel) // 1_000_000)], 0.1)),
                "mean_kept_tokens": sums[f"{key}/kept_tokens"] / rows,
            }
        entry["4bit"]["min_estimated_mass"] = sums.get(f"{scope}/4/estimated_mass_min")
        table[scope] = entry
    table["p"] = p
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--start", type=int, default=0, help="token offset of the first window")
    parser.add_argument("--candidates", type=float, nargs="+", default=[0.25], help="quest candidate budgets")
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.95])
    parser.add_argument(
        "--oracle", action="store_true", help="also oracle-topk at each matched budget and at C"
    )
    parser.add_argument("--oracle-page", action="store_true", help="also oracle-page@C (exact page masses)")
    parser.add_argument(
        "--full-top-p", action="store_true", help="also top-p P over all tokens (paper's PG-19)"
    )
    parser.add_argument(
        "--measure-every", type=int, default=0, help="score every n-th prune call exactly (0: off)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="quest / oracle-page page size")
    parser.add_argument("--gqa", choices=("group", "head"), default="group")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    global MEASURE_EVERY
    MEASURE_EVERY = max(args.measure_every, 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from sparsekv.assets import haystack_text
    from sparsekv.eval.ppl import PplSettings, text_windows
    from sparsekv.models import load_model

    model, tokenizer = load_model("default", dtype=torch.float32)
    settings = PplSettings(args.context, args.prefix, args.chunk, args.windows, args.start)
    windows = text_windows(tokenizer, haystack_text(), settings)
    shape = {k: getattr(args, k) for k in ("windows", "context", "prefix", "start", "page_size", "gqa")}
    results = {"settings": vars(args) | {"output": str(args.output)}, "runs": []}
    if args.output and args.output.exists():
        previous = json.loads(args.output.read_text())
        defaults = {"page_size": 16, "gqa": "group"}  # outputs written before these options existed
        if {k: previous["settings"].get(k, defaults.get(k)) for k in shape} == shape:
            results["runs"] = [r for r in previous["runs"] if r.get("label")]

    def record(label: str, config: SparseConfig, measured: bool = False) -> dict:
        for done in results["runs"]:
            if done["label"] == label:
                return done
        result = run(model, windows, config, args, measured, label)
        results["runs"].append(result)
        if args.output:
            args.output.write_text(json.dumps(results, indent=1))
        return result

    def config(method: str, budget, top_p=None) -> SparseConfig:
        paged = method in ("quest", OraclePage.name)
        options = {"page_size": args.page_size} if paged and args.page_size != 16 else {}
        return SparseConfig(method=method, budget=budget, top_p=top_p, gqa=args.gqa, options=options)

    dense = record("dense", SparseConfig(method="dense"))
    measured = args.measure_every > 0
    for c in args.candidates:
        record(f"quest@{c}", config("quest", c))
        if args.oracle_page:
            record(f"oracle-page@{c}", config(OraclePage.name, c))
        if args.oracle:
            record(f"oracle-topk@{c}", config("oracle-topk", c))
        for p in args.top_p:
            twilight = record(f"quest@{c}+top-p{p}", config("quest", c, p), measured=measured)
            measured = False
            matched = twilight["mean_kept_fraction"]
            record(f"quest@{c}:matched-top-p{p}", config("quest", matched))
            if args.oracle:
                record(f"oracle-topk@{c}:matched-top-p{p}", config("oracle-topk", matched))
    if args.full_top_p:
        for p in args.top_p:
            # an int budget of the whole window: the candidates are all visible tokens
            record(f"all+top-p{p}", config("oracle-topk", args.context, p))
    report(results, dense)


def report(results: dict, dense: dict) -> None:
    print(f"\n{'run':<34}{'ppl':>9}{'x dense':>9}{'kept %':>9}  per window x dense")
    for r in results["runs"]:
        frac = r["mean_kept_fraction"]
        ratios = " ".join(f"{a / b:.4f}" for a, b in zip(r["per_window_ppl"], dense["per_window_ppl"]))
        print(f"{r['label']:<34}{r['ppl']:>9.4f}{r['ppl'] / dense['ppl']:>9.4f}"
              f"{(100 * frac if frac is not None else 100):>9.2f}  {ratios}")  # fmt: skip
    for r in results["runs"]:
        if "estimator" not in r:
            continue
        est = r["estimator"]
        for scope in ("quest", "all"):
            e = est[scope]
            print(f"\n{r['label']}: kept mass with exact weights, candidates = {scope} (p = {est['p']}, "
                  f"candidates hold {e['candidate_mass_of_total']:.4f} of the attention, "
                  f"{e['mean_candidates']:.0f} tokens, exact minimal set {e['mean_minimal_tokens_exact']:.1f})")  # fmt: skip
            for name in ("2bit", "4bit", "8bit", "exact"):
                v = e[name]
                print(f"  {name:<6} mean {v['mean_kept_mass_rel_candidates']:.4f}  p10 {v['p10_kept_mass_rel']:.4f}  "
                      f"rows<p {100 * v['fraction_rows_below_p']:.1f}%  of total {v['mean_kept_mass_of_total']:.4f}  "
                      f"tokens {v['mean_kept_tokens']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
