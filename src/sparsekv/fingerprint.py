"""A model fingerprint that checkpoints (Spotlight hashes, Double Sparsity channels) are keyed to."""

from __future__ import annotations

import hashlib

import torch

#: weights sampled: 16 values spread over the first 4,096 of each of 8 tensors (by name, evenly spaced)
SAMPLED_TENSORS, SAMPLED_VALUES, SAMPLE_SPAN = 8, 16, 4096
#: two samples are the same weights when every value agrees within this relative error: bfloat16 keeps 8 bits of
#: mantissa (a relative error below 0.4%), another model's weights differ by far more
RELATIVE_TOLERANCE = 0.01


def _sampled(model) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    names = sorted(params)[:: max(1, len(params) // SAMPLED_TENSORS)][:SAMPLED_TENSORS]
    return {name: params[name].detach().flatten()[:SAMPLE_SPAN].to("cpu", torch.float64) for name in names}


def model_fingerprint(model) -> dict:
    """Architecture numbers plus a sample of the weights, so that two models with the same shapes but different
    weights differ, while the same model in another dtype (float32, bfloat16, float16) or on another device
    matches (`fingerprint_mismatch`)."""
    config = model.config.get_text_config(decoder=True)
    num_heads = config.num_attention_heads
    sample = {
        name: [
            float(f"{v:.6g}")
            for v in values[:: max(1, len(values) // SAMPLED_VALUES)][:SAMPLED_VALUES].tolist()
        ]
        for name, values in _sampled(model).items()
    }
    return {
        "architecture": type(model).__name__,
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(num_heads),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or num_heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
        "weights_sample": sample,
    }


def _weights_sha256(model) -> str:
    """The weights digest of checkpoints written before `weights_sample` (exact only within one dtype)."""
    digest = hashlib.sha256()
    for name, values in _sampled(model).items():
        digest.update(name.encode())
        digest.update(torch.round(values.float() * 1e3).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _same_sample(expected: dict, actual: dict) -> bool:
    if expected.keys() != actual.keys():
        return False
    for name, values in expected.items():
        other = actual[name]
        if len(values) != len(other):
            return False
        if not all(
            abs(a - b) <= RELATIVE_TOLERANCE * max(abs(a), abs(b)) + 1e-6 for a, b in zip(values, other)
        ):
            return False
    return True


def fingerprint_mismatch(expected: dict, model) -> dict[str, tuple]:
    """{field: (file's value, model's value)} for each field of `expected` that `model` does not match; the weights
    field compares its sample within RELATIVE_TOLERANCE (or, in older files, the exact digest)."""
    actual = model_fingerprint(model)
    diff = {
        k: (expected.get(k), v) for k, v in actual.items() if k != "weights_sample" and expected.get(k) != v
    }
    if "weights_sample" in expected:
        if not _same_sample(expected["weights_sample"], actual["weights_sample"]):
            diff["weights"] = ("sampled values", "other values")
    elif expected.get("weights_sha256") != (digest := _weights_sha256(model)):
        diff["weights_sha256"] = (expected.get("weights_sha256"), digest)
    return diff


def check_fingerprint(expected: dict, model, what: str) -> None:
    """Raises ConfigError naming the differing fields when `what` (a checkpoint) was made for another model."""
    from sparsekv.config import ConfigError

    diff = fingerprint_mismatch(expected, model)
    if diff:
        details = ", ".join(f"{k}: file {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"{what} was made for another model ({details})")
