"""Calibration data: text -> token windows -> post-RoPE queries and keys of every layer of a frozen model.

Capture goes through a temporary attention function registered with transformers' AttentionInterface: the
model hands it exactly the post-RoPE query [B, Hq, L, d] and key [B, Hkv, L, d] tensors (before any GQA repeat),
it records them and delegates to SDPA. No model code is copied or patched.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsekv.config import ConfigError

CAPTURE_ATTENTION = "sparsekv-capture"


def haystack_split(holdout_fraction: float = 0.2) -> tuple[str, str]:
    """(train, held-out) text from the embedded Paul Graham essays: the essays in file-name order, the last ones
    (at least `holdout_fraction` of the characters) held out. Never train on the second part."""
    from sparsekv.assets import haystack_dir

    files = sorted(haystack_dir().glob("*.txt"), key=lambda p: p.name)
    essays = [p.read_text(encoding="utf-8").strip() for p in files]
    return split_essays(essays, holdout_fraction)


def split_essays(essays: list[str], holdout_fraction: float) -> tuple[str, str]:
    if not 0 < holdout_fraction < 1:
        raise ConfigError(f"holdout fraction must be in (0, 1), got {holdout_fraction}")
    total = sum(len(e) for e in essays)
    held, size = len(essays), 0
    while held > 1 and size < holdout_fraction * total:
        held -= 1
        size += len(essays[held])
    return "\n\n".join(essays[:held]), "\n\n".join(essays[held:])


def read_texts(paths: list[Path]) -> str:
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"text file(s) not found: {', '.join(missing)}")
    return "\n\n".join(Path(p).read_text(encoding="utf-8").strip() for p in paths)


def token_windows(tokenizer, text: str, window: int, count: int) -> torch.Tensor:
    """[count, window] consecutive non-overlapping token windows from the start of `text`."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < window:
        raise ConfigError(f"the calibration text has {len(ids)} tokens, fewer than one window of {window}")
    available = len(ids) // window
    if count > available:
        raise ConfigError(
            f"the calibration text gives {available} windows of {window} tokens, {count} asked for"
        )
    return torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)


def _shares(count: int, texts: int) -> list[int]:
    """`count` windows split evenly over `texts` texts, the first ones taking one more for the remainder."""
    return [count // texts + (i < count % texts) for i in range(texts)]


def _interleaved(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The windows of each text, taken genre by genre: consecutive training steps see different genres."""
    longest = max((p.shape[0] for p in parts), default=0)
    return [part[i] for i in range(longest) for part in parts if i < part.shape[0]]


def genre_windows(tokenizer, texts: list[str], window: int, count: int) -> torch.Tensor:
    """[count, window] windows drawn evenly from the texts (one text per genre): each gives its share of
    consecutive windows from its start, interleaved genre by genre. A text too short for its share is an error."""
    if not texts:
        raise ConfigError("no calibration text given")
    shares = _shares(count, len(texts))
    return torch.stack(
        _interleaved([token_windows(tokenizer, t, window, c) for t, c in zip(texts, shares) if c])
    )


def held_out_windows(tokenizer, texts: list[str], window: int, count: int) -> torch.Tensor | None:
    """Like `genre_windows`, but each held-out text gives what it has up to its share (None when none has a
    whole window): evaluation works with whatever held-out text there is."""
    parts = []
    for text, share in zip(texts, _shares(count, len(texts))):
        ids = tokenizer.encode(text, add_special_tokens=False)
        usable = min(share, len(ids) // window)
        parts.append(torch.tensor(ids[: usable * window], dtype=torch.long).view(usable, window))
    windows = _interleaved(parts)
    return torch.stack(windows) if windows else None


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    store = getattr(module, "_sparsekv_capture", None)
    if store is not None:
        store.append((query.detach().to("cpu", store.dtype), key.detach().to("cpu", store.dtype)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


class _Store(list):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype


@torch.inference_mode()
def capture_qk(
    model, windows: torch.Tensor, layers: list[int], dtype: torch.dtype = torch.float16, progress=None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Runs the frozen model on each window; returns {layer: (q [W, Hq, L, d], k [W, Hkv, L, d])} on CPU."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)
    modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")}
    missing = [i for i in layers if i not in modules]
    if missing:
        raise ConfigError(f"the model has no attention layer(s) {missing}")
    stores = {i: _Store(dtype) for i in layers}
    previous = model.config._attn_implementation
    device = next(model.parameters()).device
    model.set_attn_implementation(CAPTURE_ATTENTION)
    try:
        for i in layers:
            modules[i]._sparsekv_capture = stores[i]
        for w in range(windows.shape[0]):
            model(input_ids=windows[w : w + 1].to(device), use_cache=False)
            if progress is not None:
                progress(w + 1, windows.shape[0])
    finally:
        for i in layers:
            modules[i].__dict__.pop("_sparsekv_capture", None)
        model.set_attn_implementation(previous)
    return {i: (torch.cat([q for q, _ in s]), torch.cat([k for _, k in s])) for i, s in stores.items()}
