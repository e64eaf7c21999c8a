"""Spotlight measurements on held-out text (the haystack essays the trainer never sees).

1. IoU(predicted top-k, oracle top-k) at a budget, per sparse layer, for: the trained MLP checkpoint, an
   optional trained-linear checkpoint, angular LSH (128 random-rotation bits, raw and with the calibration key
   centring = the untrained init of both trained hashes) and the paper's untrained MLP (N(0, 1e-3), no
   residual); GQA policies "group" (sum of the group's scores, one selection per kv head) and "head".
2. Decode-faithful perplexity on held-out windows: dense prefill of `--prefix` tokens, then the rest in chunks
   through a SparseCache (each query selects from its own causal past: equal to token-by-token decoding).

    PYTHONPATH=src python scripts/spotlight_eval.py --linear-checkpoint lin.safetensors --output spot.json

Part 1 compares hash variants on the same queries (`sparsekv eval iou` scores one method's selection at a time);
part 2 gives the README's held-out Spotlight perplexity rows.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from sparsekv import SparseConfig
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs
from sparsekv.selectors.spotlight import DEFAULT_CHECKPOINT, LayerHash, load_checkpoint
from sparsekv.training.capture import capture_qk, haystack_split, token_windows
from sparsekv.training.metrics import layer_iou, query_positions


def paper_init_mlp(fn: LayerHash, seed: int) -> LayerHash:
    """The paper's untrained MLP: W2·SiLU(W1·x + b1) with N(0, 1e-3) weights, no linear part."""
    g = torch.Generator().manual_seed(seed)
    out = LayerHash(fn.num_heads, fn.head_dim, fn.bits, "mlp", fn.head_dim)
    with torch.no_grad():
        out.w.zero_()
        out.w1.copy_(torch.randn(out.w1.shape, generator=g) * 1e-3)
        out.w2.copy_(torch.randn(out.w2.shape, generator=g) * 1e-3)
        out.set_normalisation(fn.key_mean, fn.key_scale, fn.query_scale)
    return out


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, config: SparseConfig, prefix: int, chunk: int) -> tuple[float, float]:
    import sparsekv

    cache = SparseCache.for_model(model, config)
    nll, count = 0.0, 0
    with sparsekv.enabled(model, config):
        model(input_ids=ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
        for lo in range(prefix, ids.shape[1] - 1, chunk):
            hi = min(lo + chunk, ids.shape[1] - 1)
            logits = model(input_ids=ids[:, lo:hi], **cache_kwargs(model, cache), use_cache=True).logits.float()
            nll += float(torch.nn.functional.cross_entropy(logits[0], ids[0, lo + 1 : hi + 1], reduction="sum"))
            count += hi - lo
    stats = cache.stats.summary()
    return math.exp(nll / count), stats["avg_budget_fraction"] or 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--linear-checkpoint", default=None)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--iou-window", type=int, default=4096)
    parser.add_argument("--iou-queries", type=int, default=96)
    parser.add_argument("--ppl-windows", type=int, default=1)
    parser.add_argument("--ppl-context", type=int, default=4096)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--ppl-configs", default="0.1:group,0.02:group,0.02:head",
                        help="comma-separated budget:gqa[:sink:local] (sink/local tokens count inside the budget)")
    parser.add_argument("--ppl-split", choices=("held", "train"), default="held")
    parser.add_argument("--skip-iou", action="store_true")
    parser.add_argument("--skip-ppl", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    from sparsekv.models import load_model

    torch.manual_seed(0)
    model, tok = load_model("default")
    ckpt = load_checkpoint(args.checkpoint)
    linear = load_checkpoint(args.linear_checkpoint) if args.linear_checkpoint else None
    layers = sorted(ckpt.layers)
    train_text, held = haystack_split(ckpt.header["training"].get("holdout_fraction", 0.2))
    result: dict = {"checkpoint": args.checkpoint, "budget": args.budget, "layers": layers}

    if not args.skip_iou:
        t0 = time.perf_counter()
        eval_ids = token_windows(tok, held, args.iou_window, 1)
        qk = capture_qk(model, eval_ids, layers)
        positions = query_positions(args.iou_window, args.iou_queries, 256, seed=4242)
        per_layer: dict[str, dict] = {}
        for layer in layers:
            q, k = qk.pop(layer)
            trained = ckpt.layers[layer]
            raw_lsh = LayerHash(trained.num_heads, trained.head_dim, trained.bits, "linear")
            centred_lsh = LayerHash(trained.num_heads, trained.head_dim, trained.bits, "linear")
            with torch.no_grad():
                # the trained MLP's hyperplanes started as these rotations; regenerate them from the seed
                from sparsekv.training.trainer import TrainConfig, new_hash

                cfg = TrainConfig(**{**ckpt.header["training"], "betas": tuple(ckpt.header["training"]["betas"]),
                                     "dense_layers": tuple(ckpt.header["training"]["dense_layers"])})
                init = new_hash(cfg, trained.num_heads, trained.head_dim, layer)
                raw_lsh.w.copy_(init.w)
                centred_lsh.w.copy_(init.w)
                centred_lsh.set_normalisation(trained.key_mean, trained.key_scale, trained.query_scale)
            hashes = {"trained_mlp": trained, "lsh": raw_lsh, "lsh_centred_untrained": centred_lsh,
                      "untrained_mlp_paper_init": paper_init_mlp(trained, seed=layer)}
            if linear is not None and layer in linear.layers:
                hashes["trained_linear"] = linear.layers[layer]
            per_layer[str(layer)] = {
                name: {p: float(v.mean()) for p, v in layer_iou(fn, q, k, args.budget, positions).items()}
                for name, fn in hashes.items()
            }
            print(layer, json.dumps(per_layer[str(layer)]), flush=True)
        names = per_layer[str(layers[0])].keys()
        mean = {}
        for n in names:
            having = [per_layer[str(i)][n] for i in layers if n in per_layer[str(i)]]
            mean[n] = {p: sum(h[p] for h in having) / len(having) for p in ("group", "head")} | {"layers": len(having)}
        result["iou"] = {"mean": mean, "per_layer": per_layer, "seconds": time.perf_counter() - t0,
                         "window": args.iou_window, "queries_per_window": len(positions)}
        print("IoU mean", json.dumps(mean, indent=1), flush=True)

    if not args.skip_ppl:
        # --ppl-split train: a window of the hash's training text, for choosing settings without the held-out text
        ids = token_windows(tok, held if args.ppl_split == "held" else train_text, args.ppl_context, args.ppl_windows)
        runs = [("dense", SparseConfig(method="dense"))]
        for item in args.ppl_configs.split(","):
            budget, gqa, *forced = item.split(":")  # budget:gqa[:sink:local]
            sink, local = (int(forced[0]), int(forced[1])) if forced else (0, 0)
            runs.append((f"spotlight@{item}", SparseConfig(
                method="spotlight", budget=float(budget), gqa=gqa, sink=sink, local=local,
                options={"checkpoint": args.checkpoint})))
        ppl = {}
        for name, config in runs:
            t0 = time.perf_counter()
            values = [perplexity(model, ids[w : w + 1], config, args.prefix, args.chunk) for w in range(len(ids))]
            ppl[name] = {"ppl": sum(v[0] for v in values) / len(values),
                         "avg_budget_fraction": sum(v[1] for v in values) / len(values),
                         "seconds": time.perf_counter() - t0}
            print(name, json.dumps(ppl[name]), flush=True)
        dense = ppl["dense"]["ppl"]
        for entry in ppl.values():
            entry["ratio_to_dense"] = entry["ppl"] / dense
        result["ppl"] = {"windows": len(ids), "context": args.ppl_context, "prefix": args.prefix, "runs": ppl}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
