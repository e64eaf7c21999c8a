"""How far Spotlight's top-k threshold moves between consecutive decode steps (real embedded model, CPU).

For each (sparse layer, batch row, kv head) and decode step, T = the k-th largest group-summed Hamming score
(k = the step's budget, sink/local keys at the forced score G*bits + 1). A radix select whose first histogram
uses W bins of width 1 around the previous step's T (the "hint") skips a pass when the new T lands in an exact
bin. With top = G*bits + 1 and half = W/2:

    base = clamp(hint - half, 0, max(top - (W - 1), 0))
    HIT  iff  base + 1 <= T <= base + W - 2                    (exact bins 1 .. W-2)
          or  T <= base and base == 0                          (bin 0 is exact when nothing lies below it)
          or  T >= base + W - 1 and base + W - 1 >= top        (bin W-1 is exact when nothing lies above it)

W = 32 is the scorer's window (`_hamming_triton.WINDOW_BITS` = 5), W = 64 the comparison.

How the scores are read: nothing in the library changes. For the run, `SpotlightSelector.select` is wrapped (in
this process only) so that each decode step also calls the selector's own `score(step)` (its stored key codes,
the hashed decode query, `hamming_scores`): on CPU that is exactly the tensor `hamming_topk` ranks, so T is the
threshold of the selection that is actually used (checked per step: T == the smallest score kept).

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/spotlight_threshold_drift.py

Greedy decoding with the sparse model itself (token by token after a dense prefill of a held-out haystack
window), spotlight's default options (shipped checkpoint, gqa group, dense layers 0-1, sink 0, local 0).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import time
from pathlib import Path
from typing import Self

import torch

import sparsekv
from sparsekv import SparseConfig
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs
from sparsekv.selectors.spotlight import DEFAULT_CHECKPOINT, SpotlightSelector, read_header
from sparsekv.training.capture import haystack_split, token_windows

WINDOWS = (32, 64)


def window_hit(t: torch.Tensor, hint: torch.Tensor, top: int, width: int) -> torch.Tensor:
    half = width // 2
    base = (hint - half).clamp(min=0).minimum(torch.full_like(hint, max(top - (width - 1), 0)))
    exact = (t >= base + 1) & (t <= base + width - 2)
    low = (t <= base) & (base == 0)
    high = (t >= base + width - 1) & (base + width - 1 >= top)
    return exact | low | high


class Recorder:
    """Wraps SpotlightSelector.select: records T per (layer, batch, kv head) for every decode step."""

    def __init__(self) -> None:
        self.trace: dict[int, list[list[list[int]]]] = {}  # layer -> [steps] of [B][S] thresholds
        self.budgets: list[int] = []
        self.top: int | None = None
        self._orig = SpotlightSelector.select

    def __enter__(self) -> Self:
        rec, orig = self, self._orig

        def select(selector: SpotlightSelector, step):
            selection = orig(selector, step)
            rec.record(selector, step, selection)
            return selection

        SpotlightSelector.select = select
        return self

    def __exit__(self, *exc) -> None:
        SpotlightSelector.select = self._orig

    def record(self, selector: SpotlightSelector, step, selection) -> None:
        if step.query.shape[2] != 1:
            raise RuntimeError("expected token-by-token decode steps")
        if step.gqa != "group":
            raise RuntimeError("the hint is per kv head: gqa='group' expected")
        group = selector.layer.group_size
        top = group * selector.code_bits + 1
        self.top = top
        scores = selector.score(step).to(torch.int64)  # [B, S, 1, N] the tensor hamming_topk ranks on CPU
        scores = scores.masked_fill(step.forced[:, None], top).masked_fill(~step.visible[:, None], -1)
        k = step.budgets[:, None, :, None].expand(*scores.shape[:3], 1)  # [B, S, 1, 1]
        ordered = scores.sort(dim=-1, descending=True).values
        t = ordered.gather(-1, k - 1)[..., 0, 0]  # [B, S]
        # sanity: T is the smallest score the used selection keeps
        kept = scores.gather(-1, selection.indices).masked_fill(~selection.valid, top + 1).amin(-1)[..., 0]
        if not torch.equal(kept, t):
            raise RuntimeError(
                f"layer {selector.layer.layer_idx}: threshold {t.tolist()} != kept min {kept.tolist()}"
            )
        self.trace.setdefault(selector.layer.layer_idx, []).append(t.tolist())
        if selector.layer.layer_idx == min(self.trace):
            self.budgets.append(int(step.budgets.max()))


@torch.inference_mode()
def run(
    model, ids: torch.Tensor, config: SparseConfig, steps: int, feed: torch.Tensor | None = None
) -> tuple[Recorder, list[int], float]:
    """Dense prefill of `ids`, then `steps` one-token forwards: the greedy token, or feed[:, i] (teacher forcing)."""
    cache = SparseCache.for_model(model, config)
    t0 = time.perf_counter()
    generated = []
    with Recorder() as rec, sparsekv.enabled(model, config):
        logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps):
            if feed is not None:
                token = feed[:, i : i + 1]
            generated.append(int(token[0, 0]))
            logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
    return rec, generated, time.perf_counter() - t0


def quantiles(x: torch.Tensor) -> dict:
    x = x.double()
    q = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)
    # "lower" quantiles: values that occur (|dT| is an integer)
    med, p90, p99 = (float(v) for v in torch.quantile(x, q, interpolation="lower"))
    return {"mean": float(x.mean()), "median": med, "p90": p90, "p99": p99, "max": float(x.max())}


def misses_above(rec: Recorder, top: int, width: int) -> float | None:
    """Among the misses of a window, the fraction where T rose above it (the rest fell below)."""
    t = torch.cat([torch.tensor(rec.trace[i]).flatten(1) for i in sorted(rec.trace)], dim=1)  # [steps, L*B*S]
    miss = ~window_hit(t[1:], t[:-1], top, width)
    if not miss.any():
        return None
    return float((t[1:] > t[:-1])[miss].double().mean())


def analyse(rec: Recorder) -> dict:
    top = rec.top
    layers = sorted(rec.trace)
    per_layer, all_t, all_d, all_hits = {}, [], [], {w: [] for w in WINDOWS}
    for layer in layers:
        t = torch.tensor(rec.trace[layer])  # [steps, B, S]
        prev, cur = t[:-1], t[1:]
        d = (cur - prev).abs()
        hits = {w: window_hit(cur, prev, top, w) for w in WINDOWS}
        per_layer[str(layer)] = {
            "hit_rate": {str(w): float(h.double().mean()) for w, h in hits.items()},
            "abs_dT_mean": float(d.double().mean()),
            "abs_dT_max": int(d.max()),
            "T_mean": float(cur.double().mean()),
            "T_min": int(cur.min()),
            "T_max": int(cur.max()),
            # [S][steps] thresholds (B = 1), for anyone who wants to replay other windows
            "T_trace": t[:, 0].T.tolist(),
        }
        all_t.append(cur.flatten())
        all_d.append(d.flatten())
        for w in WINDOWS:
            all_hits[w].append(hits[w].flatten())
    d = torch.cat(all_d)
    t = torch.cat(all_t)
    layer_rates = {w: [per_layer[str(i)]["hit_rate"][str(w)] for i in layers] for w in WINDOWS}
    signed = torch.cat(
        [(torch.tensor(rec.trace[i])[1:] - torch.tensor(rec.trace[i])[:-1]).flatten() for i in layers]
    )
    return {
        "samples": int(d.numel()),
        "top": top,
        "budget_tokens_first_last": [rec.budgets[0], rec.budgets[-1]],
        "hit_rate": {
            str(w): {
                "overall": float(torch.cat(all_hits[w]).double().mean()),
                "per_layer_min": min(layer_rates[w]),
                "per_layer_min_layer": layers[layer_rates[w].index(min(layer_rates[w]))],
                "per_layer_mean": sum(layer_rates[w]) / len(layer_rates[w]),
            }
            for w in WINDOWS
        },
        "abs_dT": quantiles(d),
        "abs_dT_zero_fraction": float((d == 0).double().mean()),
        "misses_32_above_window_fraction": misses_above(rec, top, 32),
        "signed_dT_mean": float(signed.double().mean()),
        "T": {"min": int(t.min()), "median": float(t.double().median()), "max": int(t.max())},
        "per_layer": per_layer,
    }


def fixed_mmap_threshold() -> None:
    """glibc's adaptive mmap threshold lets the per-step temporaries (few MB) fragment the heap: RSS grew by
    ~170 MB a decode step at 4K context (OOM after ~100 steps on a 23 GB machine). A fixed threshold (what
    MALLOC_MMAP_THRESHOLD_=131072 does) keeps it flat; no effect on the numbers."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main() -> None:
    fixed_mmap_threshold()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs",
        # a trailing ":text" feeds the held-out text's next tokens instead of the greedy ones (teacher forcing)
        default="4096:0.02,4096:0.1,2048:0.02,2048:0.1,4096:0.02:4:32,4096:0.1:4:32,4096:0.02:text,4096:0.1:text,2048:0.02:text,2048:0.1:text",
        help="comma-separated context:budget[:sink:local] (default options = sink 0, local 0)",
    )
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--output", default="results/spotlight_threshold_drift")
    args = parser.parse_args()

    from sparsekv.models import load_model

    torch.manual_seed(0)
    model, tok = load_model("default")
    header = read_header(DEFAULT_CHECKPOINT)
    _, held = haystack_split(header["training"].get("holdout_fraction", 0.2))
    result: dict = {
        "what": "Spotlight top-k threshold drift between consecutive decode steps (hit rate of a hinted window)",
        "model": "default (SmolLM2-135M-Instruct, embedded)",
        "checkpoint": DEFAULT_CHECKPOINT.name,
        "text": "held-out haystack essays, first window",
        "decode": f"{args.steps} token-by-token steps after a dense prefill (greedy unless the run says text); CPU float32",
        "windows": {
            str(w): f"base = clamp(hint - {w // 2}, 0, max(top - {w - 1}, 0)); exact bins 1..{w - 2}"
            for w in WINDOWS
        },
        "torch": torch.__version__,
        "machine": platform.machine(),
        "runs": {},
    }
    for spec in args.runs.split(","):
        context, budget, *forced = spec.split(":")
        text_fed = bool(forced) and forced[-1] == "text"
        forced = forced[:-1] if text_fed else forced
        context, budget = int(context), float(budget)
        sink, local = (int(forced[0]), int(forced[1])) if forced else (0, 0)
        window = token_windows(tok, held, context + args.steps, 1)  # the prompt is its first `context` tokens
        ids, feed = window[:, :context].contiguous(), (window[:, context:].contiguous() if text_fed else None)
        config = SparseConfig(method="spotlight", budget=budget, sink=sink, local=local)
        rec, generated, seconds = run(model, ids, config, args.steps, feed)
        stats = analyse(rec)
        stats |= {
            "context": context,
            "budget": budget,
            "sink": sink,
            "local": local,
            "decode_tokens": "held-out text (teacher forced)" if text_fed else "greedy",
            "dense_layers": list(config.dense_layers),
            "seconds": round(seconds, 1),
            "generated_text": tok.decode(generated),
        }
        name = (
            f"{context}@{budget:g}"
            + (f"+sink{sink}/local{local}" if forced else "")
            + ("+text" if text_fed else "")
        )
        result["runs"][name] = stats
        h32, h64 = stats["hit_rate"]["32"], stats["hit_rate"]["64"]
        print(
            f"{name}: hit32 {h32['overall']:.3f} (layer min {h32['per_layer_min']:.3f}) "
            f"hit64 {h64['overall']:.3f}  |dT| {stats['abs_dT']}  ({seconds:.0f}s)",
            flush=True,
        )

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


def layer_min(h: dict) -> str:
    return f"{h['per_layer_min']:.1%}" + (f" (L{h['per_layer_min_layer']})" if h["per_layer_min"] < 1 else "")


def markdown(result: dict) -> str:
    lines = [
        "# Spotlight top-k threshold drift between decode steps",
        "",
        (
            f"{result['model']}, shipped spotlight checkpoint, default options (gqa group, dense layers 0-1, "
            f"sink 0, local 0) unless the row says sink/local (forced keys count inside k and score top = G*bits + 1); "
            f"{result['text']}; {result['decode']}. "
            "T = k-th largest group-summed Hamming score per (sparse layer, kv head); a step is a HIT when T falls in "
            "an exact bin of a width-1 window centred on the previous step's T (see the script's docstring). "
            "Samples = (steps - 1) x 28 sparse layers x 3 kv heads."
        ),
        "",
        (
            "| context | budget | sink/local | decode | k | samples | hit 32 | layer min (32) | layer mean (32) | hit 64 | layer min (64) "
            "| abs dT median | p90 | p99 | max | dT = 0 | T range |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"].values():
        h32, h64, d = r["hit_rate"]["32"], r["hit_rate"]["64"], r["abs_dT"]
        k0, k1 = r["budget_tokens_first_last"]
        lines.append(
            f"| {r['context']} | {r['budget']:.0%} | {r['sink']}/{r['local']} | {'text' if r['decode_tokens'] != 'greedy' else 'greedy'} | {k0}-{k1} | {r['samples']} | {h32['overall']:.2%} "
            f"| {layer_min(h32)} | {h32['per_layer_mean']:.1%} | {h64['overall']:.2%} | {layer_min(h64)} "
            f"| {d['median']:g} | {d['p90']:g} | {d['p99']:g} | {d['max']:g} | {r['abs_dT_zero_fraction']:.1%} "
            f"| {r['T']['min']}-{r['T']['max']} |"
        )
    lines += ["", "Per layer hit rate (window 32 / 64):", ""]
    runs = list(result["runs"].items())
    lines.append("| layer | " + " | ".join(name.replace("+", " + ") for name, _ in runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for layer in next(iter(result["runs"].values()))["per_layer"]:
        cells = []
        for _, r in runs:
            h = r["per_layer"][layer]["hit_rate"]
            cells.append(f"{h['32']:.0%} / {h['64']:.0%}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines += ["", "Rerun: `OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/spotlight_threshold_drift.py`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
