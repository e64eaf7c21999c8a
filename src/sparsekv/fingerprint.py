"""A model fingerprint that checkpoints (Spotlight hashes, Double Sparsity channels) are keyed to."""

from __future__ import annotations

import hashlib

import torch


def model_fingerprint(model) -> dict:
    """Architecture numbers plus a hash of a few weight tensors (cheap, stable across dtype/device).

    Two models with the same shapes but different weights get different fingerprints.
    """
    config = model.config.get_text_config(decoder=True)
    num_heads = config.num_attention_heads
    digest = hashlib.sha256()
    params = dict(model.named_parameters())
    for name in sorted(params)[:: max(1, len(params) // 8)][:8]:
        values = params[name].detach().flatten()[:4096].to("cpu", torch.float32)
        digest.update(name.encode())
        digest.update(torch.round(values * 1e3).to(torch.int64).numpy().tobytes())
    return {
        "architecture": type(model).__name__,
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(num_heads),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or num_heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
        "weights_sha256": digest.hexdigest()[:16],
    }


def check_fingerprint(expected: dict, model, what: str) -> None:
    """Raises ConfigError naming the differing fields when `what` (a checkpoint) was made for another model."""
    from sparsekv.config import ConfigError

    actual = model_fingerprint(model)
    diff = {k: (expected.get(k), v) for k, v in actual.items() if expected.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: file {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"{what} was made for another model ({details})")
