"""Twilight's top-p pruner: shrinks any selector's candidates to the smallest set whose estimated attention mass
reaches p, so that each head (or kv-head group) gets its own, adaptive budget.

Per sparse layer the pruner keeps a low-bit copy of K (asymmetric, per token and kv-head: one scale and one zero
per token, codes packed 8/bits per byte), extended incrementally by `prefill`/`append`. `prune` then

1. estimates q·K of every candidate from the quantized keys (`estimate_qk`),
2. turns them into softmax weights over the candidates, per query head; with gqa="group" the weights of a group's
   query heads are summed so that the group shares one budget,
3. finds, by bisection on a weight threshold (no sort), the smallest set with mass >= p (`top_p_threshold`),
4. returns the kept candidates as a varlen `Selection` (forced sink/local tokens always kept).

The two hot ops (`estimate_qk`, `top_p_threshold`) have plain-PyTorch references here (the CPU path; the threshold
reference also takes forced tokens and the stop gap); on CUDA they dispatch to `kernels.int4_qk.int4_qk` and
`kernels.top_p.top_p_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparsekv.config import ConfigError
from sparsekv.pruners.base import Pruner
from sparsekv.step import DecodeStep, Selection

SUPPORTED_BITS = (2, 4, 8)
#: stop the bisection when the threshold bracket is narrower than this (in weights normalised to sum 1)
DEFAULT_EPS = 1e-5
MAX_BISECTION_STEPS = 64


# ------------------------------------------------------------------------------------------ low-bit keys


def quantize_keys(keys: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-token quantization of keys [..., N, d] to `bits` bits.

    Returns (codes uint8 [..., N, d * bits / 8], scale [..., N], zero [..., N]) with
    key ≈ code * scale + zero, code in [0, 2**bits - 1]; scale and zero are stored in float16.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per_byte = 8 // bits
    head_dim = keys.shape[-1]
    if head_dim % per_byte:
        raise ValueError(
            f"head_dim {head_dim} is not a multiple of {per_byte} ({bits}-bit codes packed per byte)"
        )
    x = keys.float()
    low, high = x.amin(-1), x.amax(-1)
    levels = 2**bits - 1
    scale = ((high - low) / levels).half()
    zero = low.half()
    # quantize against the stored (float16) parameters so that dequantization is consistent with them
    safe = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
    codes = torch.round((x - zero.float()[..., None]) / safe[..., None]).clamp_(0, levels).to(torch.uint8)
    codes = codes.view(*codes.shape[:-1], head_dim // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=keys.device, dtype=torch.uint8) * bits
    packed = (codes << shifts).sum(-1, dtype=torch.uint8) if per_byte > 1 else codes[..., 0]
    return packed, scale, zero


def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 4
) -> torch.Tensor:
    """Inverse of `quantize_keys`: float32 keys [..., N, d]."""
    per_byte = 8 // bits
    if per_byte > 1:
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
        mask = 2**bits - 1
        codes = ((codes[..., None] >> shifts) & mask).flatten(-2)
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]


def estimate_qk_reference(
    query: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    indices: torch.Tensor,
    bits: int = 4,
) -> torch.Tensor:
    """q·K̂ (unscaled) of each query head with the dequantized candidate keys.

    query [B, Hq, Q, d]; codes/scale/zero as stored for keys [B, Hkv, N, d]; indices [B, S, Q, K] with S = Hkv
    (each kv-head's candidates serve its query heads) or S = Hq. Returns float32 [B, Hq, Q, K].

    Reference: dequantizes every key and gathers the candidates' logits from the full q·K̂ product (each query's
    result depends only on its own candidates, the same whatever the chunk size).
    """
    num_heads, num_kv_heads = query.shape[1], codes.shape[1]
    group = num_heads // num_kv_heads
    keys = dequantize_keys(codes, scale, zero, bits)
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
    if indices.shape[1] != num_heads:
        indices = indices.repeat_interleave(num_heads // indices.shape[1], dim=1)
    logits = torch.matmul(query.float(), keys.transpose(-1, -2))
    return logits.gather(-1, indices)


def estimate_qk(query, codes, scale, zero, indices, bits: int = 4) -> torch.Tensor:
    """On CUDA, 4-bit: `kernels.int4_qk.int4_qk` (same packing: element 2i in the low nibble of byte i).
    Elsewhere the reference above, whose full-product path needs no [Q, K, d] gather of dequantized keys
    (much cheaper for the long chunks of a CPU evaluation); both give q·K̂ of the same dequantized keys."""
    if bits == 4 and query.is_cuda:
        try:
            from sparsekv.kernels.int4_qk import int4_qk
        except ImportError:
            pass
        else:
            return int4_qk(query, codes, scale.float(), zero.float(), indices)
    return estimate_qk_reference(query, codes, scale, zero, indices, bits)


# ------------------------------------------------------------------------------------------ top-p by bisection


def top_p_threshold_reference(
    weights: torch.Tensor,
    valid: torch.Tensor,
    p: float,
    forced: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Keep mask [R, K] of the smallest set per row with weight >= p of the row's valid total, by bisection.

    weights [R, K] >= 0 (need not be normalised); valid [R, K] bool; forced [R, K] bool tokens always kept (their
    weight counts toward p). Bisection on a threshold t in [0, max]: lo always satisfies mass(w > lo) >= p, hi never
    does; a row stops when hi - lo < eps (relative to its total). Kept = valid & (w > lo), plus forced tokens and at
    least the row's heaviest token. p >= 1 keeps every valid token.

    The kept set is minimal up to tokens whose weights lie within eps of the threshold.
    """
    if p >= 1:
        return valid.clone()
    w = torch.where(valid, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    forced = valid & forced if forced is not None else torch.zeros_like(valid)
    free = torch.where(forced, torch.zeros((), dtype=w.dtype, device=w.device), w)
    total = w.sum(-1, keepdim=True)
    target = p * total
    forced_mass = (w - free).sum(-1, keepdim=True)
    tolerance = eps * total

    def enough(t: torch.Tensor) -> torch.Tensor:
        return (
            forced_mass + torch.where(free > t, free, torch.zeros((), dtype=w.dtype)).sum(-1, keepdim=True)
            >= target
        )

    lo = torch.zeros_like(total)
    hi = free.amax(-1, keepdim=True)
    lo = torch.where(enough(hi), hi, lo)  # forced tokens alone reach p
    for _ in range(MAX_BISECTION_STEPS):
        active = (hi - lo) >= tolerance
        if not bool(active.any()):
            break
        mid = (lo + hi) / 2
        ok = enough(mid)
        lo = torch.where(active & ok, mid, lo)
        hi = torch.where(active & ~ok, mid, hi)
    keep = forced | (valid & (free > lo))
    # never leave a row empty (p -> 0, or weights that all underflowed): keep its heaviest valid token
    heaviest = torch.zeros_like(keep).scatter_(-1, w.masked_fill(~valid, -1).argmax(-1, keepdim=True), True)
    empty = ~keep.any(-1, keepdim=True)
    return keep | (empty & heaviest & valid)


def top_p_threshold(
    weights: torch.Tensor,
    valid: torch.Tensor,
    p: float,
    forced: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """On CUDA: `kernels.top_p.top_p_threshold` (fixed gap 1e-5; forced tokens are added after the threshold,
    their mass counted like any other token's). Elsewhere the reference above."""
    if weights.is_cuda and p < 1 and eps == DEFAULT_EPS:
        try:
            from sparsekv.kernels.top_p import top_p_threshold as kernel
        except ImportError:
            pass
        else:
            keep = kernel(weights, valid, p)
            return keep | (forced & valid) if forced is not None else keep
    return top_p_threshold_reference(weights, valid, p, forced, eps)


# ------------------------------------------------------------------------------------------ selections


def compact(selection: Selection, keep: torch.Tensor) -> Selection:
    """The kept entries of a selection moved to the front of each row (order preserved), width = max kept.

    A stable permutation of each row (kept, then dropped), cut to the width: padding entries keep their own,
    distinct candidate indices, so no padding index can collide with a kept one (scatters of `valid` into masks
    would otherwise depend on write order)."""
    keep = keep & selection.valid
    width = max(int(keep.sum(-1).max()) if keep.numel() else 1, 1)
    kept_slot = keep.long().cumsum(-1) - 1
    dropped_slot = keep.sum(-1, keepdim=True) + (~keep).long().cumsum(-1) - 1
    slot = torch.where(keep, kept_slot, dropped_slot)
    indices = torch.empty_like(selection.indices).scatter_(-1, slot, selection.indices)
    valid = torch.empty_like(keep).scatter_(-1, slot, keep)
    return Selection(indices=indices[..., :width], valid=valid[..., :width])


def candidate_weights(
    logits: torch.Tensor, selection: Selection, step: DecodeStep, scaling: float
) -> torch.Tensor:
    """Softmax over each query head's candidates of q·k logits [B, Hq, Q, K], brought to the selection heads
    ([B, S, Q, K]; a group sums its heads' weights) and normalised to sum 1 per row."""
    layer = step.layer
    valid = selection.valid
    if valid.shape[1] != layer.num_heads:
        valid = valid.repeat_interleave(layer.num_heads // valid.shape[1], dim=1)
    logits = (logits * scaling).masked_fill(~valid, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if selection.valid.shape[1] != layer.num_heads:
        b, _, q, k = probs.shape
        probs = probs.view(b, selection.valid.shape[1], -1, q, k).sum(2)
    return probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)


def forced_candidates(step: DecodeStep, selection: Selection) -> torch.Tensor:
    """[B, S, Q, K] which candidates are forced (sink/local) tokens."""
    b, s, q, _ = selection.indices.shape
    forced = step.forced[:, None].expand(b, s, q, step.forced.shape[-1])
    return forced.gather(-1, selection.indices) & selection.valid


@dataclass
class TopPPruner(Pruner):
    """Twilight pruner of one sparse layer (created by SparseCache when config.top_p is set).

    p: mass to keep (default: config.top_p); bits: precision of the key copy used for the estimate (2, 4, 8);
    exact: estimate from the full-precision keys instead (an oracle pruner, for measurements);
    eps: bisection stop gap. `kept_log` / `candidate_log` hold the [B, S, Q] counts of every prune call.
    """

    p: float | None = None
    bits: int = 4
    exact: bool = False
    eps: float = DEFAULT_EPS
    log: bool = True
    codes: torch.Tensor | None = field(default=None, repr=False)
    scale: torch.Tensor | None = field(default=None, repr=False)
    zero: torch.Tensor | None = field(default=None, repr=False)
    length: int = 0
    kept_log: list[torch.Tensor] = field(default_factory=list, repr=False)
    candidate_log: list[torch.Tensor] = field(default_factory=list, repr=False)
    #: fixed-shape decoding: the key copy spans the whole capacity and new tokens land at the step's position
    fixed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.p is None:
            self.p = self.config.top_p if self.config.top_p is not None else 1.0
        if not 0 < self.p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.p}")
        if self.bits not in SUPPORTED_BITS:
            raise ConfigError(f"the top-p estimator supports {SUPPORTED_BITS} bits, got {self.bits}")
        if self.layer.head_dim % (8 // self.bits):
            raise ConfigError(f"head_dim {self.layer.head_dim} cannot pack {self.bits}-bit codes")

    # ---- state: the quantized key copy, grown by doubling like the cache's K/V buffers

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        self.codes = self.scale = self.zero = None
        self.length = 0
        self.append(keys, values)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)  # quantized per token

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.exact:
            return
        codes, scale, zero = quantize_keys(keys, self.bits)
        new = keys.shape[-2]
        needed = self.length + new
        if self.codes is None or needed > self.codes.shape[-2]:
            capacity = max(needed, 2 * self.length)
            self.codes = _grow(self.codes, codes, capacity, self.length)
            self.scale = _grow(self.scale, scale, capacity, self.length)
            self.zero = _grow(self.zero, zero, capacity, self.length)
        self.codes[..., self.length : needed, :] = codes
        self.scale[..., self.length : needed] = scale
        self.zero[..., self.length : needed] = zero
        self.length = needed

    def begin_fixed_shape(self, capacity: int) -> None:
        if not self.exact and self.codes.shape[-2] < capacity:
            self.codes = _grow(self.codes, self.codes, capacity, self.length)
            self.scale = _grow(self.scale, self.scale, capacity, self.length)
            self.zero = _grow(self.zero, self.zero, capacity, self.length)
        self.fixed = True

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        if self.exact:
            return
        codes, scale, zero = quantize_keys(keys, self.bits)
        self.codes.index_copy_(-2, position, codes)
        self.scale.index_copy_(-1, position, scale)
        self.zero.index_copy_(-1, position, zero)

    def end_fixed_shape(self, length: int) -> None:
        self.length = length
        self.fixed = False

    def quantized(self, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key copy's first `tokens` (default: the cached ones)."""
        n = self.length if tokens is None else tokens
        return self.codes[..., :n, :], self.scale[..., :n], self.zero[..., :n]

    def state_bytes(self) -> int:
        """Bytes of the quantized key copy (codes + scale + zero) for the cached tokens."""
        if self.codes is None:
            return 0
        return sum(t.element_size() * t.numel() for t in self.quantized())

    # ---- pruning

    def estimate_logits(self, step: DecodeStep, selection: Selection) -> torch.Tensor:
        """Unscaled q·k of each query head with its candidates, [B, Hq, Q, K]."""
        if self.exact:
            return estimate_qk_exact(step, selection)
        if self.fixed:  # the candidates lie among the written slots of the whole capacity
            return estimate_qk(step.query, *self.quantized(step.keys.shape[-2]), selection.indices, self.bits)
        if self.length != step.keys.shape[-2]:
            raise RuntimeError(f"pruner holds {self.length} quantized keys, the cache {step.keys.shape[-2]}")
        return estimate_qk(step.query, *self.quantized(), selection.indices, self.bits)

    def keep_mask(self, step: DecodeStep, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B, S, Q, K] among the candidates, estimated normalised weights [B, S, Q, K])."""
        weights = candidate_weights(
            self.estimate_logits(step, selection), selection, step, step.layer.scaling
        )
        shape = weights.shape
        keep = top_p_threshold(
            weights.reshape(-1, shape[-1]),
            selection.valid.reshape(-1, shape[-1]),
            self.p,
            forced_candidates(step, selection).reshape(-1, shape[-1]),
            self.eps,
        )
        return keep.view(shape), weights

    def prune(self, step: DecodeStep, selection: Selection) -> Selection:
        if self.fixed:
            # no compaction (its width is a host read): the dropped candidates become invalid entries; the
            # cache's stats count the kept ones (the logs below are host copies, so fixed-shape steps skip them)
            if self.p >= 1:
                return selection
            keep, _ = self.keep_mask(step, selection)
            return Selection(indices=selection.indices, valid=keep & selection.valid)
        if self.p >= 1:
            pruned = selection
        else:
            keep, _ = self.keep_mask(step, selection)
            pruned = compact(selection, keep)
        if self.log:
            self.candidate_log.append(selection.counts().to("cpu", torch.int32))
            self.kept_log.append(pruned.counts().to("cpu", torch.int32))
        return pruned


def estimate_qk_exact(step: DecodeStep, selection: Selection) -> torch.Tensor:
    """Full-precision q·k of each query head with its candidates, [B, Hq, Q, K]."""
    layer = step.layer
    keys = step.keys.float().repeat_interleave(layer.group_size, dim=1)
    logits = torch.matmul(step.query.float(), keys.transpose(-1, -2))
    indices = selection.indices
    if indices.shape[1] != layer.num_heads:
        indices = indices.repeat_interleave(layer.num_heads // indices.shape[1], dim=1)
    return logits.gather(-1, indices)


def _grow(buffer: torch.Tensor | None, like: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    token_dim = like.dim() - (2 if like.dim() == 4 else 1)
    shape = list(like.shape)
    shape[token_dim] = capacity
    grown = torch.empty(shape, dtype=like.dtype, device=like.device)
    if buffer is not None:
        grown.narrow(token_dim, 0, length).copy_(buffer.narrow(token_dim, 0, length))
    return grown


# ------------------------------------------------------------------------------------------ budget accounting


def budget_report(cache, quantiles: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)) -> dict:
    """Tokens kept per layer / selection head / decode step by the top-p pruners of a SparseCache.

    Uses each sparse layer's pruner (config.top_p on a plain method) or the `pruner` attribute of a selector that
    prunes itself (twilight). Returns {"layers": {layer: {"mean_kept", "mean_candidates", "mean_fraction",
    "per_head_mean_kept": [...], "quantiles_kept": {q: v}}}, "mean_kept", "mean_candidates", "mean_fraction",
    "quantiles_kept", "per_step_mean_kept": [...] (averaged over layers and heads, per query position)}.
    Fractions are kept / visible tokens of each query.
    """
    layers: dict[int, dict] = {}
    all_kept, all_cand, all_frac, per_step = [], [], [], []
    for idx, layer in enumerate(cache.layers):
        pruner = _layer_pruner(layer)
        if pruner is None or not pruner.kept_log:
            continue
        kept = _rows(pruner.kept_log)  # [S, T] (T = query rows over batch and calls)
        cand = _rows(pruner.candidate_log)
        heads = kept.shape[0]
        seen = _visible_rows(cache.stats.visible_counts[idx], pruner.kept_log, heads)
        frac = kept.double() / seen.clamp(min=1).double()
        layers[idx] = {
            "mean_kept": float(kept.double().mean()),
            "mean_candidates": float(cand.double().mean()),
            "mean_fraction": float(frac.mean()),
            "per_head_mean_kept": [float(v) for v in kept.double().mean(1)],
            "per_head_mean_fraction": [float(v) for v in frac.mean(1)],
            "quantiles_kept": _quantiles(kept, quantiles),
        }
        all_kept.append(kept.flatten())
        all_cand.append(cand.flatten())
        all_frac.append(frac.flatten())
        per_step.append(kept.double().mean(0))
    if not layers:
        return {
            "layers": {},
            "mean_kept": None,
            "mean_candidates": None,
            "mean_fraction": None,
            "quantiles_kept": {},
            "per_step_mean_kept": [],
        }
    kept = torch.cat(all_kept)
    steps = torch.stack(per_step).mean(0) if len({len(s) for s in per_step}) == 1 else torch.zeros(0)
    return {
        "layers": layers,
        "mean_kept": float(kept.double().mean()),
        "mean_candidates": float(torch.cat(all_cand).double().mean()),
        "mean_fraction": float(torch.cat(all_frac).mean()),
        "quantiles_kept": _quantiles(kept, quantiles),
        "per_step_mean_kept": [float(v) for v in steps],
    }


def _layer_pruner(layer) -> TopPPruner | None:
    pruner = getattr(layer, "pruner", None)
    if pruner is None and getattr(layer, "selector", None) is not None:
        pruner = getattr(layer.selector, "pruner", None)
    return pruner if isinstance(pruner, TopPPruner) else None


def _rows(log: list[torch.Tensor]) -> torch.Tensor:
    """[B, S, Q] counts per call -> [S, rows] with rows ordered call by call, batch-major within a call."""
    return torch.cat([c.permute(1, 0, 2).reshape(c.shape[1], -1) for c in log], dim=1)


def _visible_rows(visible_log: list[torch.Tensor], kept_log: list[torch.Tensor], heads: int) -> torch.Tensor:
    """BudgetStats' flat visible counts ([B, S, Q] flattened per call) in the layout of `_rows`."""
    out = []
    for flat, counts in zip(visible_log, kept_log):
        out.append(flat.view(counts.shape).permute(1, 0, 2).reshape(heads, -1))
    return torch.cat(out, dim=1)


def _quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> dict[str, float]:
    v = values.double().flatten()
    return {str(q): float(torch.quantile(v, q)) for q in qs} if v.numel() else {}
