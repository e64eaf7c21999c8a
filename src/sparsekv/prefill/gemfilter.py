"""GemFilter (Ming et al., 2024): an early layer picks the prompt tokens that matter, then the whole model runs on
those tokens only.

1. The filter pass runs decoder layers 0..r-1 on the full prompt and stops inside layer r where its attention
   would start: a forward pre-hook on layer r's attention module takes the attention input (normed hidden states
   and rotary cos/sin) and raises a private exception. The layers after r never see the long prompt.
2. Layer r's post-RoPE last `window` queries and all its keys are computed with the model's own modules (q_proj /
   k_proj, optional per-head q_norm / k_norm, the model module's `apply_rotary_pos_emb`). Token score with
   window=1 (the paper) = sum over query heads of q_h . k_j of the last query (each kv head serving its group,
   i.e. after repeat_kv), no softmax; with window=w > 1 (our default, 8) = attention probabilities of the last w
   queries summed over queries and heads. Then a stride-1 average pool (kernel `pool`, zero padded).
3. The top-k tokens are kept (the last prompt token always), in their original order, left-padded for a batch.
   `sparsekv.generate` then runs the full model on them (new positions 0..k-1) and decodes densely.

Our defaults differ from the paper (window=8, pool=31, filter layer at 60% of the depth). The paper's setting is
`window=1, pool=5, filter_layer=0.4` (a float filter_layer is a fraction of the depth: layer 12 of 30 here).
Why: on the default model (SmolLM2-135M-Instruct) the very last prompt query (the "\n" after
"<|im_start|>assistant") looks at no needle token in any layer (needle attention mass <= 2%), so the paper's score
keeps 0-13% of the needle at k=256 whatever the layer. `window=w` scores with the attention probabilities of the last
w queries (with the chat template the last 8 are the question's last word, "?" and the 6 template tokens), and a
wider `pool` keeps whole sentences around the peaks. Chosen out of sample (scripts/gemfilter_eval.py --heldout dev / test, keep=256,
NIAH keyword recall, 1K/2K/3K tokens): on the dev grid (the harness's needle, depths 25/50/75%) dense scored 0.889,
the paper's setting 0.000, window 8 / pool 31 at layers 12 / 14 / 18 0.000 / 0.889 / 1.000 (window 24 at 18: 1.000,
pool 15 at 14: 0.333), so layer 18 = 60% of 30 with window 8 and pool 31 became the default. On the held-out grid
(4 other needles and questions, depths 10/40/65/90%, other haystack offsets, 48 cells;
results/gemfilter/niah_heldout.md) the default scored 0.917 vs dense 0.826 and the paper's setting 0.014 (by length
1K/2K/3K: 0.917/0.896/0.938 vs dense 0.958/0.771/0.750); it is below dense in 3 cells, all on the two-part "when and
where" needle. A small model answers better from 256 filtered tokens than from 3K of essays, hence "above dense".
A later layer costs prefill time: the filter pass runs 60% of the layers on the full prompt instead of 40%. These
settings were chosen on SmolLM2-135M only; for another model `sparsekv gemfilter-scan` recommends its layer.

Padding never counts as a token: it scores -inf and is never kept. When every row keeps its whole prompt the input
is returned unchanged without a filter pass, so the output is exactly dense generation.

The kept tokens of the latest `filter_prompt` call are attached to the model (`last_selection(model)`), which the
`sparsekv gemfilter-generate --show-selected` command prints. `sparsekv gemfilter-scan` probes every layer with
needle prompts (the paper's Fig. 5: distance between the needle and the selected tokens) and recommends r
(`sparsekv.eval.gemfilter_scan`; the commands live in `sparsekv.cli_methods`).
"""

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sparsekv.budget import budget_tokens
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.selectors.base import TokenSelector

__all__ = [
    "PAPER_OPTIONS",
    "FilterResult",
    "GemFilter",
    "decoder_layers",
    "default_filter_layer",
    "gem_filter",
    "kept_counts",
    "last_query_scores",
    "last_selection",
    "layer_scores",
    "render_selection",
    "resolve_filter_layer",
    "select_tokens",
    "window_scores",
]

#: the paper's filter layer as a fraction of the depth (13 of 32 layers for Llama-3.1-8B)
PAPER_DEPTH_FRACTION = 0.4
#: our default (chosen on a NIAH dev grid with window 8 / pool 31, see the module docstring): 18 of 30 layers
DEFAULT_DEPTH_FRACTION = 0.6
#: the paper's scoring: the last query only, average pool 5
PAPER_OPTIONS = {"window": 1, "pool": 5, "filter_layer": PAPER_DEPTH_FRACTION}
_LAST_ATTR = "_sparsekv_gemfilter_last"


class _StopForward(Exception):
    """Raised by the capture hook to end the filter pass at the filter layer."""


# ----------------------------------------------------------------------------------------------- model access


def num_layers_of(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


def default_filter_layer(num_layers: int, fraction: float = DEFAULT_DEPTH_FRACTION) -> int:
    """`fraction` of the depth as a 0-based layer index, rounded half up (60%: 18 of 30; 40%: 12 of 30, 13 of 32)."""
    return max(0, min(num_layers - 1, int(fraction * num_layers + 0.5)))


def resolve_filter_layer(filter_layer: float | None, num_layers: int) -> int:
    """None -> the default layer; a float in (0, 1) -> that fraction of the depth; an int -> itself (checked)."""
    if filter_layer is None:
        return default_filter_layer(num_layers)
    if isinstance(filter_layer, float):
        return default_filter_layer(num_layers, filter_layer)
    if not 0 <= filter_layer < num_layers:
        raise ConfigError(
            f"filter_layer {filter_layer} out of range: the model has {num_layers} layers (0..{num_layers - 1})"
        )
    return filter_layer


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers (the first ModuleList of modules with a `self_attn`)."""
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module)
            and all(hasattr(layer, "self_attn") for layer in module)
        ):
            return module
    raise ConfigError(f"gemfilter cannot find the decoder layers of {type(model).__name__}")


def _rotary(attn: torch.nn.Module) -> Callable:
    module = sys.modules.get(type(attn).__module__)
    rope = getattr(module, "apply_rotary_pos_emb", None)
    if rope is None:
        raise ConfigError(
            f"gemfilter needs `apply_rotary_pos_emb` in {type(attn).__module__} to rebuild post-RoPE q/k; "
            f"{type(attn).__name__} is not supported"
        )
    return rope


def _project(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, queries: int):
    """Post-RoPE queries of the last `queries` positions [B, H, q, d] and all keys [B, Hkv, N, d], computed with the
    attention module's own projections, optional per-head norms (Qwen3-style) and its model's rotary function."""
    batch, length, _ = hidden_states.shape
    head_dim = attn.head_dim
    keys = attn.k_proj(hidden_states).view(batch, length, -1, head_dim)
    query = attn.q_proj(hidden_states[:, -queries:]).view(batch, queries, -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:
        query = attn.q_norm(query)
    if getattr(attn, "k_norm", None) is not None:
        keys = attn.k_norm(keys)
    query, keys = query.transpose(1, 2), keys.transpose(1, 2)
    cos, sin = position_embeddings
    rope = _rotary(attn)
    query, _ = rope(query, query, cos[:, -queries:], sin[:, -queries:])
    _, keys = rope(keys, keys, cos, sin)
    return query, keys


def last_query_scores(
    attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """[B, N] (float32 or wider): sum over query heads of (post-RoPE last query) . (post-RoPE key j) of one
    attention layer: the paper's score.

    hidden_states [B, N, D] is the attention module's input (after the layer's input norm); position_embeddings
    the (cos, sin) the model hands to it. Only the last query is projected.
    """
    batch = hidden_states.shape[0]
    query, keys = _project(attn, hidden_states, position_embeddings, 1)  # [B, H, 1, d], [B, Hkv, N, d]
    heads, kv_heads, head_dim = query.shape[1], keys.shape[1], query.shape[-1]
    dtype = torch.promote_types(keys.dtype, torch.float32)  # at least float32, float64 models stay exact
    # repeat_kv maps query head h to kv head h // group; summing q_h . k over the heads of a group equals
    # (sum of the group's queries) . k, which avoids materialising the repeated keys
    grouped = query.to(dtype).reshape(batch, kv_heads, heads // kv_heads, head_dim).sum(2)
    return torch.einsum("bhd,bhnd->bn", grouped, keys.to(dtype))


def window_scores(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    valid: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """[B, N]: attention probabilities (softmax over each query's causal, unpadded past) of the last `window`
    queries, summed over queries and heads. An extension for models whose very last query does not look at the
    relevant tokens: raw logits of different queries are not on one scale, probabilities are."""
    length = hidden_states.shape[1]
    window = min(window, length)
    query, keys = _project(attn, hidden_states, position_embeddings, window)
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    # repeat_kv maps query head h to kv head h // group: stacking each group's queries against its kv head gives the
    # same logits without materialising the repeated keys ([B, H, N, d], gigabytes at 128K tokens); the product
    # runs in the model's dtype like its attention, the softmax in float32 or wider
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * window, head_dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).view(batch, heads, window, length)
    logits = logits.to(torch.promote_types(keys.dtype, torch.float32)) * attn.scaling  # [B, H, w, N]
    positions = torch.arange(length, device=valid.device)
    causal = positions[None, :] <= positions[-window:, None]  # [w, N]
    visible = causal[None] & valid[:, None, :]  # [B, w, N]
    probs = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    probs = (
        probs.nan_to_num(0.0) * valid[:, None, -window:, None]
    )  # padded queries (short rows) count nothing
    return probs.sum((1, 2))


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def layer_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layers: Iterable[int],
    window: int = 1,
) -> dict[int, torch.Tensor]:
    """Token scores [B, N] of each layer in `layers` (window 1: the last query's raw logits summed over heads; more:
    see `window_scores`), from one forward pass that stops at the last of the layers.

    Layers after max(layers) are not run; layer max(layers) itself only runs its input norm and the q/k projections.
    """
    layers = sorted(set(layers))
    modules = decoder_layers(model)
    if not layers or layers[0] < 0 or layers[-1] >= len(modules):
        raise ConfigError(f"filter layer(s) {layers} out of range: the model has {len(modules)} layers")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    stop_at = layers[-1]
    scores: dict[int, torch.Tensor] = {}

    def capture(layer_idx: int):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            position_embeddings = kwargs.get("position_embeddings")
            if position_embeddings is None:
                raise ConfigError(
                    f"{type(module).__name__} receives no position_embeddings; gemfilter supports models whose "
                    "decoder hands (cos, sin) to the attention module (Llama, Mistral, Qwen2/3, ...)"
                )
            if window == 1:
                scores[layer_idx] = last_query_scores(module, hidden, position_embeddings)
            else:
                scores[layer_idx] = window_scores(
                    module, hidden, position_embeddings, attention_mask.bool(), window
                )
            if layer_idx == stop_at:
                raise _StopForward

        return hook

    handles = [modules[i].self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i in layers]
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=_position_ids(attention_mask),
            use_cache=False,
        )
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in layers if i not in scores]
    if missing:
        raise RuntimeError(f"the filter pass never reached layer(s) {missing}")
    return scores


# --------------------------------------------------------------------------------------------- selection


def pool_scores(scores: torch.Tensor, valid: torch.Tensor, pool: int) -> torch.Tensor:
    """Stride-1 average pool over positions (zeros outside the prompt and on padding); -inf on padding."""
    scores = scores.masked_fill(~valid, 0.0)
    if pool > 1:
        scores = F.avg_pool1d(scores[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    return scores.masked_fill(~valid, float("-inf"))


def kept_counts(keep: float, lengths: Sequence[int]) -> list[int]:
    """Tokens kept per row: `keep` tokens (int) or ceil(keep * length) (float), within [1, length] (the budget
    rule, `sparsekv.budget`)."""
    return [budget_tokens(keep, int(length)) for length in lengths]


def select_tokens(pooled: torch.Tensor, valid: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """Per row: the `count` best positions (the last valid one always), sorted in original order."""
    kept = []
    for row, count in enumerate(counts):
        scores = pooled[row].clone()
        last = int(valid[row].nonzero().max())
        scores[last] = float("inf")
        indices = scores.topk(count).indices
        kept.append(indices.sort().values)
    return kept


@dataclass
class FilterResult:
    """What the filter kept.

    input_ids / attention_mask: the kept tokens, left-padded to the longest row (the input itself when nothing
        was filtered). kept: per row, the kept positions in the original (padded) input, sorted.
    scores: [B, N] pooled scores of the original positions (-inf on padding); None without a filter pass.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    kept: list[torch.Tensor]
    original_ids: torch.Tensor
    original_mask: torch.Tensor
    filter_layer: int
    scores: torch.Tensor | None = None
    filtered: bool = False
    seconds: float = 0.0
    prompt_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "filter_layer": self.filter_layer,
            "filtered": self.filtered,
            "filter_seconds": self.seconds,
            "prompt_tokens": self.prompt_lengths,
            "kept_tokens": [len(k) for k in self.kept],
            "kept_positions": [self._unpadded(row).tolist() for row in range(len(self.kept))],
        }

    def _unpadded(self, row: int) -> torch.Tensor:
        """Kept positions of a row counted from its first real token."""
        return self.kept[row] - int(self.original_mask[row].long().argmax())


@torch.no_grad()
def gem_filter(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    keep: float = 1024,
    filter_layer: float | None = None,
    pool: int = 31,
    window: int = 8,
) -> FilterResult:
    """Runs the filter pass and returns the kept tokens (see the module docstring)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    valid = attention_mask.bool()
    lengths = valid.sum(-1).tolist()
    if min(lengths) < 1:
        raise ConfigError("gemfilter got an empty prompt (a row with no unmasked token)")
    num_layers = num_layers_of(model)
    layer = resolve_filter_layer(filter_layer, num_layers)
    counts = kept_counts(keep, lengths)
    every = [row.nonzero()[:, 0] for row in valid]
    if counts == lengths:  # nothing to drop: no filter pass, the prompt as it is
        return FilterResult(
            input_ids, attention_mask, every, input_ids, attention_mask, layer, prompt_lengths=lengths
        )
    start = time.perf_counter()
    raw = layer_scores(model, input_ids, attention_mask, [layer], window)[layer]
    pooled = pool_scores(raw, valid, pool)
    kept = select_tokens(pooled, valid, counts)
    width = max(counts)
    padded = input_ids[~valid]
    pad_id = int(padded[0]) if padded.numel() else 0
    new_ids = input_ids.new_full((len(kept), width), pad_id)
    new_mask = attention_mask.new_zeros((len(kept), width))
    for row, indices in enumerate(kept):
        new_ids[row, width - len(indices) :] = input_ids[row, indices]
        new_mask[row, width - len(indices) :] = 1
    return FilterResult(
        new_ids,
        new_mask,
        kept,
        input_ids,
        attention_mask,
        layer,
        scores=pooled,
        filtered=True,
        seconds=time.perf_counter() - start,
        prompt_lengths=lengths,
    )


def last_selection(model) -> FilterResult | None:
    """The FilterResult of the latest gemfilter `filter_prompt` on this model (None if there was none)."""
    return getattr(model, _LAST_ATTR, None)


def render_selection(tokenizer, result: FilterResult, row: int = 0, gap: str = " [...] ") -> str:
    """The kept prompt text of one row: contiguous kept runs decoded, `gap` where tokens were dropped."""
    ids = result.original_ids[row]
    valid = result.original_mask[row].bool()
    kept = result.kept[row].tolist()
    first = int(valid.nonzero().min())
    pieces, run = [], []
    previous = first - 1
    for index in kept:
        if run and index != previous + 1:
            pieces.append(tokenizer.decode(ids[run]))
            run = []
        if not run and index != previous + 1:
            pieces.append(gap)
        run.append(index)
        previous = index
    if run:
        pieces.append(tokenizer.decode(ids[run]))
    if previous < valid.shape[0] - 1:
        pieces.append(gap)
    return "".join(pieces).strip()


# ------------------------------------------------------------------------------------------------ the method


def _check_keep(keep) -> None:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise ConfigError(f"gemfilter keep must be an int (tokens) or a fraction in (0, 1], got {keep!r}")
    if isinstance(keep, float) and not (math.isfinite(keep) and 0 < keep <= 1):
        raise ConfigError(
            f"gemfilter keep as a fraction must be in (0, 1], got {keep}; pass an int for tokens"
        )
    if isinstance(keep, int) and keep < 1:
        raise ConfigError(f"gemfilter keep must be >= 1 token, got {keep}")


def _check_options(keep, filter_layer, pool, window=1) -> None:
    _check_keep(keep)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(
            f"gemfilter window must be an int >= 1 (queries scoring the tokens), got {window!r}"
        )
    if filter_layer is not None and (
        isinstance(filter_layer, bool)
        or not isinstance(filter_layer, (int, float))
        or (isinstance(filter_layer, int) and filter_layer < 0)
        or (isinstance(filter_layer, float) and not 0 < filter_layer < 1)
    ):
        raise ConfigError(
            "gemfilter filter_layer must be a layer index >= 0, a fraction of the depth in (0, 1) or None, "
            f"got {filter_layer!r}"
        )
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or pool % 2 == 0:
        raise ConfigError(
            f"gemfilter pool must be an odd int >= 1 (an even kernel shifts positions), got {pool!r}"
        )


@dataclass
class GemFilter(TokenSelector):
    """Prompt filtering by an early layer, then dense decoding over the kept tokens.

    keep: tokens kept per prompt (int) or a fraction of each prompt (float in (0, 1]); the last token always.
    filter_layer: 0-based layer whose queries score the tokens; a float in (0, 1) = that fraction of the depth;
        None = 60% of the depth (the paper: 0.4).
    pool: odd kernel of the average pool over the scores (the paper: 5).
    window: 1 = the paper's score (last query's raw logits summed over heads); w > 1 = attention probabilities of
        the last w queries summed (default 8: the last query of a small model does not look at the answer).
    `PAPER_OPTIONS` holds the paper's window / pool / filter_layer.
    """

    name = "gemfilter"
    dense = True
    rewrites_prompt = True
    budget_option = "keep"

    keep: int | float = 1024
    filter_layer: float | None = None
    pool: int = 31
    window: int = 8

    @classmethod
    def options_of(cls, config: SparseConfig) -> dict:
        shared = {f.name for f in dataclasses.fields(TokenSelector)}
        fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in shared]
        return {f.name: config.options.get(f.name, f.default) for f in fields}

    @classmethod
    def check_config(cls, config: SparseConfig) -> None:
        _check_options(**cls.options_of(config))

    @classmethod
    def filter_prompt(cls, model, input_ids, attention_mask, config):
        result = gem_filter(model, input_ids, attention_mask, **cls.options_of(config))
        setattr(model, _LAST_ATTR, result)
        return result.input_ids, result.attention_mask
