"""One measurement run of the self-index cache on the default model (CPU), sections written as they finish.

    PYTHONPATH=src python scripts/self_index_eval.py --output runs/self_index_eval.json [--quick] [--sections ...]

* memory: `measure_cache_memory` (bytes of the tensors held) after a 4K haystack prefill + 8 decode steps, vs a
  bf16 dense cache (per component; the compressed layers' ratio does not depend on which layers stay dense);
* ppl: `sparsekv.eval.ppl.run_ppl` on one 4K window of the haystack (token offset --ppl-start, 0 by default):
  dense prefill of 3072 tokens, then the other 1024 in chunks of 256 through the enabled model (each query
  selects from its own causal past: decode-faithful), dense vs self-index (default options) at 10% (ppl16: the
  16-bit variant; ppl_paper: the paper's layout, LUT-only top-k, 64 sinks always forced, 2-bit |K| (token-wise)
  and V with scale+zero per 32);
* niah: `sparsekv.eval.niah.run_niah`, 1K/2K/3K tokens at depth 0.5, dense vs self-index 2-bit at 10% (niah16);
* iou: post-RoPE q/k captured from one dense pass over 2K tokens; prompt = first half (mu, codebook, lsh centring),
  24 queries in the second half; top-10% of each scorer vs oracle top-10% (group-summed softmax weights), IoU
  averaged over the sparse layers and kv-heads, and the exact attention mass each selection keeps. Scorers:
  self-index LUT (1 bit/dim + 16 centroids per 4 dims), the LUT's 3 x k re-ranked by q . (sign x 3-bit |K|) (the
  cache's selection, sinks aside; token-wise |K| scales here), both again on rotated keys (k_rotate, the default),
  lsh simhash with head_dim bits (1 bit/dim, keys centred) and with 1024 bits (lsh's default), sign-only Hamming
  (the paper's ablation). No sinks are forced in this section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from sparsekv import SparseConfig


def memory_section(model, tokenizer, quick: bool) -> dict:
    from sparsekv.eval.cache_memory import measure_cache_memory

    out = {}
    # the compressed layers' ratio does not depend on which layers stay dense
    runs = [(4096, "0,1", dict(EXTRA_OPTIONS))]
    for context, dense, options in runs:
        layers = tuple(int(x) for x in dense.split(",") if x)
        config = SparseConfig(method="self-index", budget=0.1, dense_layers=layers, options=options)
        report = measure_cache_memory(model, tokenizer, config, context, decode_tokens=8)
        key = f"ctx{context}_dense[{dense}]_{options.get('kv_bits', 2)}bit"
        out[key] = report
        print(
            f"memory {key}: {report['bytes_per_token']:.0f} B/token, overall {100 * report['ratio_vs_bf16']:.1f}% "
            f"of bf16; compressed layers {100 * (report['compressed_layers_ratio_vs_bf16'] or 0):.1f}%",
            flush=True,
        )
    return out


SI2 = SparseConfig(method="self-index", budget=0.1)
SI16 = SparseConfig(method="self-index", budget=0.1, options={"kv_bits": 16})
PAPER = {
    "rescore": 0,
    "sink_tokens": 64,
    "sink_share": 1.0,
    "k_bits": 2,
    "k_axis": "token",
    "k_group": 32,
    "v_group": 32,
    "k_zero": True,
    "v_clip": False,
    "v_rotate": False,
    "k_rotate": False,
}
SI_PAPER = SparseConfig(method="self-index", budget=0.1, options=PAPER)
DENSE = SparseConfig(method="dense")


DENSE_RUNS = True  # --no-dense: only the self-index runs
EXTRA_OPTIONS: dict = {}  # --options: applied to SI2 and the memory section
PPL_START = 0  # token offset of the ppl window in the haystack (--ppl-start; the reported window is 0)


def ppl_section(model, tokenizer, quick: bool, configs: dict | None = None) -> dict:
    from sparsekv.eval.common import ModelHandle
    from sparsekv.eval.ppl import PplSettings, run_ppl

    handle = ModelHandle(model=model, tokenizer=tokenizer, name="default")
    settings = PplSettings(
        context=1024 if quick else 4096,
        prefix=768 if quick else 3072,
        chunk=256,
        windows=1,
        start=PPL_START,
    )
    configs = configs or ({"dense": DENSE} if DENSE_RUNS else {}) | {"self-index-2bit": SI2}
    out = {}
    for name, config in configs.items():
        start = time.perf_counter()
        out[name] = run_ppl(handle, config, settings)
        print(
            f"ppl {name}: {out[name]['ppl']:.3f} (budget {out[name].get('avg_budget_fraction')}) "
            f"{time.perf_counter() - start:.0f}s",
            flush=True,
        )
    return out


def capture_qk(model, ids: torch.Tensor) -> tuple[dict, dict]:
    """Post-RoPE queries and keys of every layer from one dense forward."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    queries, keys = {}, {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        queries[module.layer_idx], keys[module.layer_idx] = query.detach(), key.detach()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("si-capture", capture)
    AttentionMaskInterface.register("si-capture", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("si-capture")
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return queries, keys


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[..., N] -> bool mask of the k best (ties towards later positions, as a stable descending sort of the
    reversed row would do)."""
    order = scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, scores.shape[-1] - 1 - order, True)
    return mask


def iou_section(model, tokenizer, quick: bool) -> dict:
    from sparsekv.assets import haystack_text
    from sparsekv.kernels.bits import pack_sign_bits
    from sparsekv.kernels.compressed_format import dequantize, quantize
    from sparsekv.kernels.hamming import hamming_scores
    from sparsekv.selectors.lsh import hash_codes, projection_matrix
    from sparsekv.selectors.self_index import lut_scores, one_pass_centroids, sign_codes, value_rotation

    def lut_and_rerank(q_group, k):
        """The LUT scores of q_group over k (mu, codebook and alpha from the prompt) and q . (sign x 3-bit |K|)."""
        centred = k - k[:, :, :prompt].mean(2, keepdim=True)
        cents = one_pass_centroids(centred[:, :, :prompt], sign_codes(centred[:, :, :prompt]))
        lut = lut_scores(q_group, cents, sign_codes(centred))  # [1, Hkv, P, N]
        alpha = centred[:, :, :prompt].abs().amax(2, keepdim=True)
        mag = dequantize(*quantize(centred.abs() / alpha, 3, 64), 3, torch.float32)
        k_read = torch.where(centred > 0, 1.0, -1.0) * mag * alpha
        return lut, torch.matmul(q_group, k_read.transpose(-1, -2))

    context = 1024 if quick else 2048
    prompt = context // 2
    ids = tokenizer(haystack_text()[: context * 8], add_special_tokens=False, return_tensors="pt").input_ids[
        :, :context
    ]
    queries, keys = capture_qk(model, ids)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    g = hq // hkv
    positions = torch.linspace(prompt, context - 1, 16 if quick else 24).round().long().unique()
    results = {
        "context": context,
        "prompt": prompt,
        "queries": len(positions),
        "budget": 0.1,
        "per_layer": {},
    }
    names = (
        "self_index_lut",
        "self_index_lut_rescore3",
        "self_index_lut_k_rotate",
        "self_index_lut_k_rotate_rescore3",
        "lsh_simhash_same_bits",
        "lsh_simhash_1024_bits",
        "sign_only_hamming",
    )
    sums = {name: [] for name in names}
    mass_sums = {name: [] for name in ("oracle", *names)}
    for layer in sorted(queries):
        if layer in (0, 1):
            continue  # dense layers
        q = queries[layer].float()  # [1, Hq, N, d]
        k = keys[layer].float()  # [1, Hkv, N, d]
        d = k.shape[-1]
        centred = k - k[:, :, :prompt].mean(2, keepdim=True)
        qs = q[:, :, positions]  # [1, Hq, P, d]
        q_group = qs.view(1, hkv, g, len(positions), d).sum(2)
        # the cache's second stage: the LUT's best 3 x k re-ranked by q . (sign x 3-bit |K| x alpha)
        lut, fine = lut_and_rerank(q_group, k)
        rotation = value_rotation(d, layer, torch.float32)  # k_rotate: q R . K R
        lut_rot, fine_rot = lut_and_rerank(q_group @ rotation, k @ rotation)
        proj = projection_matrix(d, d, "simhash", seed=0)
        lsh = hamming_scores(hash_codes(qs, proj), hash_codes(centred, proj), bits=d).float()
        proj_wide = projection_matrix(d, 1024, "simhash", seed=0)
        lsh_wide = hamming_scores(
            hash_codes(qs, proj_wide), hash_codes(centred, proj_wide), bits=1024
        ).float()
        sign_only = hamming_scores(pack_sign_bits(qs), pack_sign_bits(centred), bits=d).float()
        logits = torch.matmul(qs, k.repeat_interleave(g, dim=1).transpose(-1, -2)) / math.sqrt(d)
        n = k.shape[2]
        causal = torch.arange(n)[None, :] <= positions[:, None]  # [P, N]
        weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).view(1, hkv, g, -1, n).sum(2)
        row, mass_row = {}, {}
        scorers = {
            "oracle": weights,
            "self_index_lut": lut,
            "self_index_lut_rescore3": (lut, fine),
            "self_index_lut_k_rotate": lut_rot,
            "self_index_lut_k_rotate_rescore3": (lut_rot, fine_rot),
            "lsh_simhash_same_bits": lsh,
            "lsh_simhash_1024_bits": lsh_wide,
            "sign_only_hamming": sign_only,
        }
        for name, scores in scorers.items():
            ious, masses = [], []
            for i, p in enumerate(positions.tolist()):
                visible = p + 1
                kk = max(1, math.ceil(0.1 * visible))
                truth = topk_mask(weights[..., i, :visible], kk)
                if isinstance(scores, tuple):  # LUT candidates, then the re-rank
                    candidates = topk_mask(scores[0][..., i, :visible], min(visible, 3 * kk))
                    guess = topk_mask(scores[1][..., i, :visible].masked_fill(~candidates, -math.inf), kk)
                else:
                    guess = topk_mask(scores[..., i, :visible], kk)
                ious.append((truth & guess).sum(-1).float() / (truth | guess).sum(-1).float())  # [1, Hkv]
                # exact attention mass the selection keeps, per query head, averaged over the group
                kept = weights[..., i, :visible] * guess
                masses.append(kept.sum(-1) / weights[..., i, :visible].sum(-1))
            mass_row[name] = torch.stack(masses).mean().item()
            mass_sums[name].append(mass_row[name])
            if name == "oracle":
                continue
            per_head = torch.stack(ious).mean(0)[0]
            row[name] = per_head.tolist()
            sums[name].append(per_head.mean().item())
        results["per_layer"][layer] = {"iou": row, "mass": mass_row}
        print(
            f"iou layer {layer}: " + ", ".join(f"{k_}={sum(v) / len(v):.3f}" for k_, v in row.items()),
            flush=True,
        )
    results["mean"] = {name: sum(v) / len(v) for name, v in sums.items()}
    results["mean_mass"] = {name: sum(v) / len(v) for name, v in mass_sums.items()}
    print("iou mean:", results["mean"], flush=True)
    print("attention mass kept (group-summed weights):", results["mean_mass"], flush=True)
    return results


def niah_section(model, tokenizer, quick: bool, configs: dict | None = None) -> dict:
    from sparsekv.eval.common import ModelHandle
    from sparsekv.eval.niah import NiahSettings, run_niah

    handle = ModelHandle(model=model, tokenizer=tokenizer, name="default")
    settings = NiahSettings(
        lengths=(1000,) if quick else (1000, 2000, 3000), depths=(0.5,), max_new_tokens=24
    )
    configs = configs or ({"dense": DENSE} if DENSE_RUNS else {}) | {"self-index-2bit": SI2}
    out = {}
    for name, config in configs.items():
        start = time.perf_counter()
        out[name] = run_niah(handle, config, settings)
        grid = {f"{c['length']}/{c['depth']}": round(c["score"], 2) for c in out[name]["cells"]}
        print(
            f"niah {name}: mean {out[name]['score']:.3f} {grid} {time.perf_counter() - start:.0f}s",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, default=Path("runs/self_index_eval.json"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="memory,ppl,niah,iou,ppl16,niah16")
    parser.add_argument(
        "--options",
        default="",
        help="JSON object of self-index options applied on top of the defaults in the memory, ppl and niah "
        "sections (e.g. '{\"v_rotate\": false}')",
    )
    parser.add_argument(
        "--no-dense", action="store_true", help="skip the dense runs of the ppl / niah sections"
    )
    parser.add_argument(
        "--ppl-start",
        type=int,
        default=0,
        help="haystack token offset of the ppl window (0 = the reported window; the defaults of 2026-11 were "
        "chosen on 65536)",
    )
    args = parser.parse_args()
    global PPL_START, SI2, DENSE_RUNS, EXTRA_OPTIONS
    PPL_START = args.ppl_start
    EXTRA_OPTIONS = json.loads(args.options) if args.options else {}
    SI2 = SparseConfig(method="self-index", budget=0.1, options=EXTRA_OPTIONS)
    DENSE_RUNS = not args.no_dense
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from sparsekv.models import load_model

    model, tokenizer = load_model("default", dtype=torch.float32)
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    results["quick"] = args.quick
    results["ppl_start"] = args.ppl_start
    results["options"] = EXTRA_OPTIONS
    sections = {
        "memory": memory_section,
        "iou": iou_section,
        "ppl": ppl_section,
        "niah": niah_section,
        "ppl16": lambda m, t, q: ppl_section(m, t, q, {"self-index-16bit": SI16}),
        "ppl_paper": lambda m, t, q: ppl_section(m, t, q, {"self-index-paper-layout": SI_PAPER}),
        "niah16": lambda m, t, q: niah_section(m, t, q, {"self-index-16bit": SI16}),
    }
    for name in args.sections.split(","):
        start = time.perf_counter()
        results[name] = sections[name](model, tokenizer, args.quick)
        results[name + "_seconds"] = time.perf_counter() - start
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
