"""A property of the user's path: whatever configuration, model family, prompt lengths (left-padded batches) and
prefill chunking a user picks, `model.generate()` under `sparsekv.enabled` gives finite logits of the right shape,
or the configuration is refused with a `ConfigError` — never a traceback from inside, never NaNs."""

from __future__ import annotations

import random

import pytest
import torch

import sparsekv
from sparsekv import ConfigError, SparseConfig
from sparsekv.registry import available_methods, get_method_class

CASES = 48
SHAPES = ["tiny-llama", "tiny-llama-mha", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3", "tiny-phi3"]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def models():
    from sparsekv.models import random_model

    return {shape: random_model(shape, dtype=torch.float32, seed=0) for shape in SHAPES}


def random_case(rng: random.Random) -> dict:
    methods = [m for m in available_methods() if not get_method_class(m).rewrites_prompt]
    budget = rng.choice([rng.randint(1, 48), round(rng.uniform(0.01, 0.95), 3)])
    return {
        "shape": rng.choice(SHAPES),
        "lengths": [rng.randint(1, 70) for _ in range(rng.randint(1, 3))],
        "chunk": rng.choice([None, None, rng.randint(1, 32)]),
        "config": {
            "method": rng.choice(methods),
            "budget": budget,
            "top_p": rng.choice([None, None, round(rng.uniform(0.3, 1.0), 2)]),
            "dense_layers": rng.choice([(), (0,), (1,), (0, 1)]),
            "sink": rng.choice([0, 0, rng.randint(1, 4)]),
            "local": rng.choice([0, 0, rng.randint(1, 8)]),
            "gqa": rng.choice(["group", "head"]),
        },
    }


@pytest.mark.parametrize("seed", range(CASES))
def test_generate_gives_finite_logits_or_a_config_error(models, seed):
    case = random_case(random.Random(seed))
    try:
        config = SparseConfig(**case["config"])
    except ConfigError:
        return
    model = models[case["shape"]]
    lengths = case["lengths"]
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : width - length] = 0
        mask[row, width - length :] = 1
    try:
        with sparsekv.enabled(model, config):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0, prefill_chunk_size=case["chunk"],
                                 return_dict_in_generate=True, output_logits=True)
    except ConfigError:
        return
    logits = torch.stack(out.logits, dim=1)
    assert out.sequences.shape == (len(lengths), width + NEW_TOKENS), case
    assert logits.shape[:2] == (len(lengths), NEW_TOKENS), case
    assert torch.isfinite(logits).all(), case
