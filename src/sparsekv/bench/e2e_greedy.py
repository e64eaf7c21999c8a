"""Greedy outputs of the GPU kernels against the CPU reference path: one model, float32, the same weights."""

from __future__ import annotations

import copy

import torch

from sparsekv.bench.e2e_model import build_model
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.hf_compat import cache_kwargs


def greedy_ids(
    model, config: SparseConfig, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int
) -> list[list[int]]:
    """Greedy tokens (no EOS stop) with sparse decoding; `mask` = left padding (None: no padding)."""
    from sparsekv.api import enabled
    from sparsekv.cache import SparseCache

    device = next(model.parameters()).device
    ids = ids.to(device)
    mask = mask.to(device) if mask is not None else None
    position = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    out = []
    with torch.inference_mode(), enabled(model, config):
        cache = SparseCache.for_model(model, config, initial_capacity=ids.shape[1] + new_tokens)
        for _ in range(new_tokens):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position,
                           **cache_kwargs(model, cache), use_cache=True).logits[:, -1]  # fmt: skip
            tok = logits.argmax(-1, keepdim=True)
            out.append(tok)
            ids = tok
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                position = position[:, -1:] + 1
    return torch.cat(out, dim=1).tolist()


GREEDY_METHODS = ("dense", "spotlight", "lsh", "quest", "self-index", "streaming")
# prompts of greedy_match(weights="real"): prefixes of this text (repeated to the longest prompt length)
GREEDY_TEXT = (
    "The lighthouse keeper wrote in his log every evening. He noted the wind, the colour of the sea, the ships "
    "that passed and the birds that rested on the rail. In winter the entries grew short: ice on the glass, oil "
    "for the lamp, a storm from the north. In spring they grew long again, full of the boats of the fishermen, "
    "the first swallows and the smell of the tar on the harbour wall. Years later his granddaughter found the "
    "books in a chest and read them aloud, one evening at a time."
)


def greedy_match(
    methods=GREEDY_METHODS,
    *,
    prompt_lengths=(96, 160, 257),
    new_tokens: int = 16,
    budget: float = 0.25,
    device: str = "cuda",
    model_name: str = "default",
    layers: int | None = None,
    seed: int = 0,
    weights: str = "random",
) -> dict:
    """Greedy tokens of one model (float32, the same weights) on CPU vs `device`: each prompt alone (no padding:
    the uniform fast path) and all of them as one left-padded batch (general path). weights="random": a
    random-weight model of `model_name`'s shape and random prompt ids; "real": the embedded default model
    (SmolLM2-135M-Instruct, its assets fetched or cached) and prefixes of an English text as prompts."""
    if weights not in ("random", "real"):
        raise ConfigError(f"weights must be random or real, got {weights!r}")
    gen = torch.Generator().manual_seed(seed + 1)
    if weights == "real":
        from sparsekv.models import load_model

        cpu_model, tokenizer = load_model("default", dtype=torch.float32, device="cpu")
        text = " ".join([GREEDY_TEXT] * 4)
        ids = tokenizer(text, return_tensors="pt").input_ids
        prompts = [ids[:, :n] for n in prompt_lengths]
        report_model = "default (SmolLM2-135M-Instruct, embedded weights), float32"
    else:
        cpu_model = build_model(model_name, layers=layers, dtype=torch.float32, device="cpu", seed=seed)
        vocab = cpu_model.config.vocab_size
        prompts = [torch.randint(3, vocab, (1, n), generator=gen) for n in prompt_lengths]
        report_model = f"{model_name} shape, random weights (seed {seed}), float32"
    dev_model = copy.deepcopy(cpu_model).to(device)
    width = max(prompt_lengths)
    batch_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    batch_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        batch_ids[row, width - p.shape[1] :] = p[0]
        batch_mask[row, width - p.shape[1] :] = 1
    cases = [(f"prompt{n}", p, None) for n, p in zip(prompt_lengths, prompts)] + [
        ("padded-batch", batch_ids, batch_mask)
    ]
    report: dict = {"model": report_model, "budget": budget, "new_tokens": new_tokens, "methods": {}}
    for method in methods:
        config = (
            SparseConfig(method=method, budget=budget, sink=1, local=4)
            if method != "dense"
            else SparseConfig()
        )
        rows = []
        for name, ids, mask in cases:
            ref = greedy_ids(cpu_model, config, ids, mask, new_tokens)
            got = greedy_ids(dev_model, config, ids, mask, new_tokens)
            for r, (a, b) in enumerate(zip(ref, got)):
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                rows.append({"case": name, "row": r, "match": first is None, "first_diff": first})
        report["methods"][method] = {
            "rows": rows,
            "matched": sum(r["match"] for r in rows),
            "total": len(rows),
        }
    return report
