"""Double Sparsity: score keys with q·k over a few "label" channels, kept in a small low-precision cache.

Per layer and kv-head, channels are ranked by how much they contribute to q·k: the mean over query/key pairs
of |q_c * k_c| (post-RoPE), which factorises into mean|q_c| * mean|k_c|, summed over the kv-head's query
group. The ranking comes from `sparsekv calibrate-ds` (a safetensors file keyed to the model's fingerprint)
or, without a file, from the prompt itself at the first decode step (per sequence: no offline step, but a
short prompt gives a noisier ranking; the keys of the whole prompt, the queries of its last 4,096 tokens). The label cache holds the top `channels` (default head_dim/8) channels
of every key at `precision` (int8 with a per-token scale, fp8 e4m3, bf16, fp16 or fp32); queries are scored on
the same channels.
"""

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from sparsekv.config import ConfigError
from sparsekv.selectors.base import TokenSelector, to_selection_heads, topk_selection
from sparsekv.selectors.lsh import unique_ranks
from sparsekv.step import DecodeStep, Selection

FORMAT = "sparsekv-double-sparsity-channels"
PRECISIONS = ("int8", "fp8", "bf16", "fp16", "fp32")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
CAPTURE_ATTENTION = "sparsekv-ds-capture"
#: calibration on the prompt (no channels file) reads the mean |q| of the prompt's last queries, at most this many:
#: all of a long prompt's queries, kept for every layer until its first decode step, would outgrow the K/V cache
CALIBRATION_QUERIES = 4096
#: tokens per block of the key magnitudes summed in float64 (bounds the temporary of a long prompt)
_CALIBRATION_BLOCK = 8192


def channel_scores(query_abs_mean: torch.Tensor, key_abs_mean: torch.Tensor) -> torch.Tensor:
    """[..., Hq, d] and [..., Hkv, d] mean magnitudes -> [..., Hkv, d] mean |q_c k_c| summed over each
    group."""
    hq, hkv = query_abs_mean.shape[-2], key_abs_mean.shape[-2]
    grouped = query_abs_mean.reshape(*query_abs_mean.shape[:-2], hkv, hq // hkv, query_abs_mean.shape[-1])
    return grouped.sum(-2) * key_abs_mean


def rank_channels(scores: torch.Tensor) -> torch.Tensor:
    """Channel indices by descending score (ties: lower channel first), int64 with the shape of `scores`."""
    return torch.argsort(scores, dim=-1, descending=True, stable=True)


def quantize_labels(labels: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., r] -> (stored labels, per-token scale [..., 1] for int8 else None)."""
    if precision == "int8":
        scale = labels.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
        return torch.round(labels / scale).clamp(-127, 127).to(torch.int8), scale.float()
    if precision == "fp8":
        return labels.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), None
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return labels.to(dtypes[precision]), None


def dequantize_labels(labels: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    values = labels.to(dtype)
    return values * scale.to(dtype) if scale is not None else values


# ------------------------------------------------------------------------------------------------------------
# --- channel files


def save_channels(path: str | Path, scores: torch.Tensor, metadata: dict) -> None:
    """scores [layers, kv_heads, head_dim] -> safetensors with the ranking, the scores and JSON metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scores = scores.detach().to("cpu", torch.float32).contiguous()
    tensors = {"ranking": rank_channels(scores).contiguous(), "scores": scores}
    save_file(
        tensors, str(path), metadata={"sparsekv": json.dumps({"format": FORMAT, "version": 1, **metadata})}
    )


@lru_cache(maxsize=8)
def _load_channels_cached(path: str, mtime_ns: int) -> tuple[torch.Tensor, dict]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            metadata = json.loads((handle.metadata() or {}).get("sparsekv", "{}"))
            if metadata.get("format") != FORMAT or "ranking" not in handle.keys():  # noqa: SIM118
                raise ConfigError(
                    f"{path} is not a Double Sparsity channels file (make one with `sparsekv calibrate-ds`)"
                )
            ranking = handle.get_tensor("ranking")
    except ConfigError:
        raise
    except Exception as error:  # safetensors raises several types for a bad file
        raise ConfigError(f"cannot read Double Sparsity channels file {path}: {error}") from error
    return ranking, metadata


def load_channels(path: str | Path) -> tuple[torch.Tensor, dict]:
    """(ranking int64 [layers, kv_heads, head_dim], metadata incl. 'fingerprint'); cached per file version."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"Double Sparsity channels file {file} not found (make one with `sparsekv calibrate-ds`)"
        )
    return _load_channels_cached(str(file.resolve()), file.stat().st_mtime_ns)


# ------------------------------------------------------------------------------------------------------------
# --- calibration


@torch.inference_mode()
def calibrate_channels(model, segments: list[torch.Tensor], progress=None) -> torch.Tensor:
    """Runs the model densely on token segments ([1, n] ids each) and returns channel scores [L, Hkv, d].

    q and k are read post-RoPE inside an attention function registered with transformers (it then runs SDPA),
    so no model code is copied and any model the registry can drive works.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    sums: dict[int, list] = {}

    def capture(module, query, key, value, attention_mask, *args, **kwargs):
        q_sum = query.detach().abs().to(torch.float64).sum(dim=(0, 2))  # [Hq, d]
        k_sum = key.detach().abs().to(torch.float64).sum(dim=(0, 2))  # [Hkv, d]
        count = query.shape[0] * query.shape[2]
        entry = sums.setdefault(module.layer_idx, [0.0, 0.0, 0])
        entry[0], entry[1], entry[2] = entry[0] + q_sum, entry[1] + k_sum, entry[2] + count
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(CAPTURE_ATTENTION, capture)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    device = next(model.parameters()).device
    try:
        for index, ids in enumerate(segments):
            model(input_ids=ids.to(device), use_cache=False)
            if progress is not None:
                progress(index + 1, len(segments))
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(sums)
    if not layers:
        raise ConfigError(
            "calibration captured no attention call; is this a decoder-only transformers model?"
        )
    return torch.stack(
        [channel_scores(sums[i][0] / sums[i][2], sums[i][1] / sums[i][2]) for i in layers]
    ).float()


# ------------------------------------------------------------------------------------------------------------
# --- the selector


def _write_slot(buffer: torch.Tensor, position: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[:, :, position] = values for a device position [1] (no host read)."""
    if buffer.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: copy the bytes
        buffer, values = buffer.view(torch.uint8), values.view(torch.uint8)
    buffer.index_copy_(2, position, values)


@dataclass
class DoubleSparsitySelector(TokenSelector):
    """Options: channels_file (from `sparsekv calibrate-ds`; without it each sequence calibrates on its own
    prompt), channels (label channels per kv-head, default head_dim/8), precision of the label cache."""

    name = "double-sparsity"
    fixed_shape = True
    slot_state = True
    #: the dense fallback's default (H200, Llama-3-8B shapes, B4, budget 2%: 0.54x at 64K and 0.52x at 128K
    #: cached tokens over the batch)
    dense_below = 1_048_576
    channels_file: str | None = None
    channels: int | None = None
    precision: str = "int8"

    @classmethod
    def check_config(cls, config) -> None:
        options = config.options
        if options.get("precision", cls.precision) not in PRECISIONS:
            raise ConfigError(f"double-sparsity precision must be one of {', '.join(PRECISIONS)}")
        channels = options.get("channels")
        if channels is not None and (
            isinstance(channels, bool) or not isinstance(channels, int) or channels < 1
        ):
            raise ConfigError(f"double-sparsity channels must be an int >= 1, got {channels!r}")
        if options.get("channels_file"):
            load_channels(options["channels_file"])  # a missing or foreign file fails at once, not mid-run

    @classmethod
    def check_model(cls, model, config):
        path = config.options.get("channels_file")
        if path:
            from sparsekv.fingerprint import check_fingerprint

            _, metadata = load_channels(path)
            check_fingerprint(metadata.get("fingerprint", {}), model, f"Double Sparsity channels file {path}")

    def __post_init__(self) -> None:
        layer = self.layer
        self.rank = self.channels if self.channels is not None else max(1, layer.head_dim // 8)
        if not 1 <= self.rank <= layer.head_dim:
            raise ConfigError(f"double-sparsity channels must be in 1..{layer.head_dim}, got {self.rank}")
        self.selected: torch.Tensor | None = None  # [1 or B, Hkv, r] label channel indices
        if self.channels_file:
            ranking, _ = load_channels(self.channels_file)
            expected = (layer.num_layers, layer.num_kv_heads * layer.shards, layer.head_dim)  # the model's heads
            if tuple(ranking.shape) != expected:
                raise ConfigError(
                    f"Double Sparsity channels file {self.channels_file} has shape {tuple(ranking.shape)} "
                    f"(layers, kv heads, head dim) but the model has {expected}: "
                    "it was made for another model"
                )
            self.selected = ranking[layer.layer_idx, layer.kv_heads, : self.rank][None].clone()
        self.prompt_length = 0
        self.prompt_query: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None  # [B, Hkv, capacity, r]
        self.scales: torch.Tensor | None = None  # [B, Hkv, capacity, 1] for int8
        self.built = 0

    def prompt_query_window(self) -> int | None:
        return CALIBRATION_QUERIES if self.selected is None else 0  # calibration on the prompt reads them

    def prefill(
        self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> None:
        self.prompt_length = keys.shape[-2]
        if self.selected is None:
            # calibration on the prompt waits for the first decode step, which tells the padding apart
            self.prompt_query = query

    def _calibrate_on_prompt(self, step: DecodeStep) -> None:
        prompt = self.prompt_length
        real = step.visible[:, 0, :prompt][:, None, :, None].to(torch.float64)  # [B, 1, P, 1]
        queried = real[:, :, prompt - self.prompt_query.shape[2] :]  # the prompt's last queries
        q_mean = (self.prompt_query.abs().to(torch.float64) * queried).sum(2) / queried.sum(2).clamp(min=1)
        k_sum = 0
        for lo in range(0, prompt, _CALIBRATION_BLOCK):
            block = step.keys[..., lo : min(lo + _CALIBRATION_BLOCK, prompt), :].abs().to(torch.float64)
            k_sum = k_sum + (block * real[:, :, lo : lo + block.shape[2]]).sum(2)
        k_mean = k_sum / real.sum(2).clamp(min=1)
        self.selected = rank_channels(channel_scores(q_mean, k_mean))[..., : self.rank]
        self.prompt_query = None

    def crop(self, length: int) -> None:
        self.built = min(self.built, length)  # labels are per token; the calibrated channels stay

    def begin_fixed_shape(self, capacity: int) -> None:
        # the channels and labels exist: a fixed-shape step always follows at least one ordinary decode step
        if self.labels.shape[2] < capacity:
            self._grow(capacity)

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        index = self.selected[:, :, None, :].expand(keys.shape[0], -1, keys.shape[2], -1)
        labels, scale = quantize_labels(keys.gather(-1, index), self.precision)
        _write_slot(self.labels, position, labels)
        if scale is not None:
            _write_slot(self.scales, position, scale)

    def end_fixed_shape(self, length: int) -> None:
        self.built = length

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` tokens' labels, the first `built` kept."""
        labels, scales = self.labels, self.scales
        self.labels = labels.new_zeros(*labels.shape[:2], capacity, labels.shape[-1])
        self.labels[:, :, : self.built] = labels[:, :, : self.built]
        if scales is not None:
            self.scales = scales.new_ones(*scales.shape[:2], capacity, 1)
            self.scales[:, :, : self.built] = scales[:, :, : self.built]

    def _sync(self, step: DecodeStep) -> None:
        keys = step.keys
        if self.selected is None:
            self._calibrate_on_prompt(step)
        if self.selected.device != keys.device:
            self.selected = self.selected.to(keys.device)
        n = keys.shape[-2]
        if self.built >= n:
            return
        new = keys[..., self.built :, :]
        index = self.selected[:, :, None, :].expand(new.shape[0], -1, new.shape[2], -1)
        labels, scale = quantize_labels(new.gather(-1, index), self.precision)
        if self.labels is None:
            self.labels = labels.new_zeros(*labels.shape[:2], 0, labels.shape[-1])
            self.scales = None if scale is None else scale.new_ones(*scale.shape[:2], 0, 1)
        if n > self.labels.shape[2]:
            self._grow(max(n, 2 * self.built))
        self.labels[:, :, self.built : n] = labels
        if scale is not None:
            self.scales[:, :, self.built : n] = scale
        self.built = n

    def score(self, step: DecodeStep) -> torch.Tensor:
        """[B, Hq, Q, N] approximate q·k on the label channels."""
        if step.hints is None or not step.hints.fixed:
            self._sync(step)  # a fixed-shape step's labels are already written (`append_fixed_shape`)
        n = step.keys.shape[-2]
        batch, heads, q_len, _ = step.query.shape
        kv_heads, group = self.layer.num_kv_heads, self.layer.group_size
        dtype = torch.promote_types(step.keys.dtype, torch.float32)
        index = self.selected.repeat_interleave(group, dim=1)[:, :, None, :].expand(batch, -1, q_len, -1)
        query = step.query.gather(-1, index).to(dtype)  # [B, Hq, Q, r]
        scales = None if self.scales is None else self.scales[:, :, :n]
        labels = dequantize_labels(self.labels[:, :, :n], scales, dtype)  # [B, Hkv, N, r]
        query = query.reshape(batch, kv_heads, group * q_len, self.rank)
        scores = torch.matmul(query, labels.transpose(-1, -2))
        return scores.view(batch, heads, q_len, n)

    def select(self, step: DecodeStep) -> Selection:
        # quantized labels can tie exactly; rank ties towards recent keys so the choice never depends on k or
        # shape
        return topk_selection(unique_ranks(to_selection_heads(self.score(step), step)), step)
