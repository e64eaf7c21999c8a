"""`SelfIndexSelector`: the method's options, its storage hooks (the layer's K/V live in a `CompressedStore`), the
two-stage selection (LUT top-k, re-rank by q . K as attention reads K) and attention over the gathered tokens."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.kernels.lut_score import (
    LUT_SCORE_RANK_MAX,
    MAX_LISTED,
    group_query,
    lut_topk_fixed,
    quantized_lut,
)
from sparsekv.kernels.lut_score import lut_scores as kernel_lut_scores
from sparsekv.kernels.select_within import select_within
from sparsekv.kernels.sparse_attention import sparse_attention
from sparsekv.selectors.base import (
    TokenSelector,
    _force,
    every_index,
    maybe_compiled,
    row_counts,
    to_selection_heads,
)
from sparsekv.selectors.self_index import device
from sparsekv.selectors.self_index.codes import GROUP_DIMS, bitrev4, codes_from_sign_bits
from sparsekv.selectors.self_index.scoring import (
    SENTINEL,
    SINK_BASE,
    SNAP_WINDOW,
    boost_sinks,
    lut_scores,
    rank_sink_pool,
    sink_boost,
    snap_sinks,
)
from sparsekv.selectors.self_index.store import (
    FP_DTYPES,
    QUANT_GROUP,
    CompressedStore,
    quant_group_size,
)
from sparsekv.step import DecodeStep, Selection

KV_BITS = (2, 4, 16)
#: `rescore_group`'s rules (the first is the default)
RESCORE_GROUP_RULES = ("softmax", "sum")


@dataclass
class SelfIndexSelector(TokenSelector):
    """Self-Indexing KV cache (1-bit sign VQ index + token-wise low-bit K/V). Options:

    kv_bits: 2 (default) or 4 = compressed V (and K magnitudes, see k_bits); 16 = full-precision K/V, only the
        1-bit index (the paper's "16,16,1").
    sink_tokens: prompt tokens per kv-head kept at 16-bit and selected first, inside the budget (SnapKV-style
        choice; 0 = none; the paper: 64). 32 by default: their bytes pay for a 64-token residual block, which
        measured better at 4K (ppl 27.10 vs 27.57 with 64 sinks and a 32-token block).
    sink_share: at most this share of a query's budget goes to forced sinks (best SnapKV rank first; 1 = all,
        the paper). 64 sinks would otherwise take most of a 10% budget below ~2K tokens.
    residual: decode tokens of the current block read at 16-bit (block size, 64; 0 = read every token compressed).
    fp_dtype: storage of the 16-bit parts of a compressed cache ("bfloat16", "float16" or "input"; "input" keeps
        a float64 test exact).
    rescore: candidates per budget token that the LUT passes to a second stage ranking them by q.K as attention
        reads K (sign bits x dequantized |K|, 16-bit sinks and residual block); 0 = the paper's LUT-only top-k.
    rescore_group: how the second stage ranks a kv head's candidates for the query heads of its GQA group (gqa
        "group"): "softmax" (default) by each head's attention over the row's candidates, summed (oracle-topk's
        group rule), so that a token one head attends to keeps its rank whatever the others' logits (each
        candidate key is still read once); "sum" by the summed query's q.K, the sum of the heads' logits, in one
        pass (about 27 us a selecting layer less at 128K x B4 on an H200; held-out perplexity at 10% 1.034x
        dense's against "softmax"'s 1.028x, BENCHMARKS.md).
    k_bits: bits of the |K| magnitudes (2, 3, 4; 0 = auto: 3 when kv_bits=2, else kv_bits).
    k_axis: "channel": one fp16 |K| scale per channel per block of k_group tokens (KIVI-style; K is compressed
        when its block fills, so `residual` must be a positive multiple of k_group); "token": one fp16 scale (and
        zero with k_zero) per k_group channels of one token (the paper's axis); "auto" (default): "channel" when
        residual is a positive multiple of k_group and k_zero is false (the defaults), else "token". The
        selector's `k_axis` attribute holds the resolved axis.
    k_group: tokens per scale row (k_axis="channel", 32) or channels per scale (k_axis="token").
    v_group: elements (channels of one token) per fp16 scale and zero of V (64).
    k_zero: store a zero point for the K magnitudes too (k_axis="token" only; the paper's layout).
    v_clip: V range per group shrunk to the least squared error among V_CLIP_RATIOS (same format). On by default
        since it was measured with k_rotate over nine 4K windows x three rotation seeds (alone it had been judged
        on one window, where it does not help).
    v_rotate: store V' = V R with a fixed orthogonal R per layer (`value_rotation`: +-1 signs seeded by the layer
        index times the normalised Hadamard matrix; a seeded QR rotation when head_dim is not a power of two), so
        that an outlier channel no longer sets the 2-bit range of its whole group. Every stored V row is in the
        rotated domain (quantized rows, 16-bit sinks and residual block, and kv_bits=16's full V); `attend`
        un-rotates the attention output (out = out' R^T, exact since softmax . (V R) = (softmax . V) R). No bytes:
        the layer holds its d signs (counted), the base matrix is a shared constant regenerated from head_dim.
        `compressed_kv.dequantized_rows` returns V in the stored (rotated) domain.
    k_rotate: store keys as K R (the same R as V's) and rotate each query by R before scoring and attention: q . k
        and so attention are unchanged, but the sign index, mu / alpha and the |K| scales all see rotated keys,
        whose energy is spread over the channels. Measured better both for the index (kv_bits=16) and for the
        compressed cache (results/self_index.md). Every stored K row (sign bits, |K| codes, sinks, residual
        block, kv_bits=16's full K) is in the rotated domain; `compressed_kv.dequantized_rows` returns it so.

    prompt_stats_tokens: a prompt that arrives in chunks (transformers' `prefill_chunk_size`) is held at 16-bit
        only until every row has this many real tokens (4096); the statistics (mu, alpha, codebook) come from
        them, and every later chunk is compressed as it arrives, its attention reading the earlier ones
        dequantized, so a long prompt never lies in the cache at 16-bit. The sinks are chosen when the prompt
        ends, among each chunk's own SnapKV candidates. 0: hold the whole prompt, compress it when it ends
        (statistics from all of it; the 16-bit prompt then sets the peak memory). A prompt in one forward is
        compressed when it ends either way.

    The paper's configuration is rescore=0, sink_share=1, k_bits=2, k_axis="token", k_group=32, v_group=32,
    k_zero=true, v_clip=false, v_rotate=false, k_rotate=false (`PAPER` in scripts/self_index_eval.py); the
    defaults keep the same bytes per token (24.8% of bf16 at 4K) and were chosen by decode-faithful perplexity
    (results/self_index.md).
    """

    name = "self-index"
    stores_kv = True
    fixed_shape = True
    #: the dense fallback's default (H200, Llama-3-8B shapes, 32 layers, 2%, captured steps: 0.81-0.85x the
    #: captured dense step at 128K cached tokens over the batch, 0.92x at 256K, 1.09x at 384K, 1.09-1.14x at 512K);
    #: decided before the prompt is cached, its layers then keep 16-bit K/V (`SparseCache.settle_fallback`)
    dense_below = 393_216
    #: a 2-bit cache cannot reproduce dense logits tightly (kv_bits=16 can)
    lossy: ClassVar[bool] = True

    kv_bits: int = 2
    sink_tokens: int = 32
    residual: int = 64
    fp_dtype: str = "bfloat16"
    rescore: int = 3
    rescore_group: str = "softmax"
    k_bits: int = 0
    k_group: int = 32
    v_group: int = 64
    k_zero: bool = False
    sink_share: float = 0.25
    k_axis: str = "auto"
    v_clip: bool = True
    v_rotate: bool = True
    k_rotate: bool = True
    prompt_stats_tokens: int = 4096

    @classmethod
    def check_config(cls, config: SparseConfig) -> None:
        options = config.options
        bits = options.get("kv_bits", 2)
        if isinstance(bits, bool) or bits not in KV_BITS:
            raise ConfigError(f"self-index kv_bits must be one of {KV_BITS}, got {bits!r}")
        k_bits = options.get("k_bits", 0)
        if isinstance(k_bits, bool) or k_bits not in (0, 2, 3, 4):
            raise ConfigError(f"self-index k_bits must be 0 (= kv_bits), 2, 3 or 4, got {k_bits!r}")
        for name in ("k_group", "v_group"):
            value = options.get(name, QUANT_GROUP)
            if isinstance(value, bool) or value not in (4, 8, 16, 32, 64, 128):
                raise ConfigError(f"self-index {name} must be one of 4, 8, 16, 32, 64, 128, got {value!r}")
        share = options.get("sink_share", 0.25)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"self-index sink_share must be a number in (0, 1], got {share!r}")
        for name in ("k_zero", "v_clip", "v_rotate", "k_rotate"):
            if not isinstance(options.get(name, False), bool):
                raise ConfigError(f"self-index {name} must be true or false, got {options[name]!r}")
        axis = options.get("k_axis", "auto")
        if axis not in ("auto", "token", "channel"):
            raise ConfigError(f"self-index k_axis must be 'auto', 'token' or 'channel', got {axis!r}")
        if axis == "channel":
            if options.get("k_zero", False):
                raise ConfigError("self-index k_axis=channel stores no zero points: set k_zero=false")
            group, residual = options.get("k_group", QUANT_GROUP), options.get("residual", 64)
            if (
                isinstance(residual, int)
                and not isinstance(residual, bool)
                and (residual <= 0 or residual % group)
            ):
                raise ConfigError(
                    "self-index k_axis=channel compresses K a block of k_group tokens at a time once the block is "
                    f"full, so residual must be a positive multiple of k_group; got residual={residual}, "
                    f"k_group={group}"
                )
        for name in ("sink_tokens", "residual", "rescore", "prompt_stats_tokens"):
            value = options.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"self-index {name} must be an int >= 0, got {value!r}")
        stats_tokens = options.get("prompt_stats_tokens", 4096)
        if 0 < stats_tokens < SNAP_WINDOW:  # the sinks' voters, the prompt's last queries, must all be real tokens
            raise ConfigError(f"self-index prompt_stats_tokens must be 0 or >= {SNAP_WINDOW}, got {stats_tokens}")
        if options.get("rescore_group", RESCORE_GROUP_RULES[0]) not in RESCORE_GROUP_RULES:
            raise ConfigError(
                f"self-index rescore_group must be one of {', '.join(RESCORE_GROUP_RULES)}, "
                f"got {options['rescore_group']!r}"
            )
        if options.get("fp_dtype", "bfloat16") not in FP_DTYPES:
            raise ConfigError(f"self-index fp_dtype must be one of {', '.join(FP_DTYPES)}")
        if config.top_p is not None:
            raise ConfigError(
                "self-index keeps its own compressed K/V, which the top-p pruner cannot read; leave top_p unset"
            )

    def __post_init__(self) -> None:
        d = self.layer.head_dim
        if d % GROUP_DIMS:
            raise ConfigError(f"self-index needs a head_dim divisible by {GROUP_DIMS}, got {d}")
        if self.k_axis == "auto":  # channel wherever it can be (scale-only |K|, full blocks read compressed)
            fits = self.residual > 0 and self.residual % self.k_group == 0
            self.k_axis = "channel" if fits and not self.k_zero else "token"
        if self.k_axis == "token":
            self.k_group = quant_group_size(d, self.k_group)
        self.v_group = quant_group_size(d, self.v_group)
        # k_bits auto: the 2-bit cache spends the bytes saved on V's and K's zeros on a 3rd K bit
        if self.k_bits == 0:
            self.k_bits = 3 if self.kv_bits == 2 else self.kv_bits
        if self.compressed and self.k_bits == 3 and d % 8:
            raise ConfigError(f"self-index k_bits=3 needs a head_dim divisible by 8, got {d}")
        self.kv = CompressedStore(
            layer_idx=self.layer.layer_idx, num_kv_heads=self.layer.num_kv_heads, kv_bits=self.kv_bits,
            k_bits=self.k_bits, k_axis=self.k_axis, k_group=self.k_group, v_group=self.v_group, k_zero=self.k_zero,
            v_clip=self.v_clip, residual=self.residual, fp_dtype=self.fp_dtype, v_rotate=self.v_rotate,
            k_rotate=self.k_rotate,
        )  # fmt: skip
        self._prefilled = False
        #: what `_per_prompt` remembers: name -> (key, value)
        self._derived: dict[str, tuple[tuple, object]] = {}
        #: a prompt stored chunk by chunk (`open_prompt`): each chunk's sink candidates, (keys, values, positions)
        self._sink_pool: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # (query, query R) of the last step
        self._rotated_for: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the last fused selection's (indices, per-head re-rank scores [B, Hkv, G, Q, C], picks into them)
        self._scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def compressed(self) -> bool:
        return self.kv_bits < 16

    @property
    def mu(self) -> torch.Tensor | None:
        """[B, Hkv, 1, d] mean prompt key (None before the prefill)."""
        return self.kv.mu

    @property
    def num_tokens(self) -> int:
        return self.kv.rows.length

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds (buffer capacity included), by component."""
        return self.kv.memory_breakdown()

    # --- storage hooks ----------------------------------------------------------------------------------------

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self._prefilled:  # the prompt is compressed by `prefill`, from the whole prompt's statistics
            raise RuntimeError("self-index stores tokens after its prefill")
        self.kv.append(key_states, value_states)

    def crop(self, length: int) -> None:
        raise ConfigError(
            "self-index keeps only its compressed K/V, so it rolls back only where the cache keeps the 16-bit K/V "
            "beside it: in lossless decoding (`lossless=True`), not in assisted generation or prompt lookup"
        )

    def crop_stored(self, length: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.kv.crop(length, keys, values)

    def begin_fixed_shape(self, capacity: int) -> None:
        self.kv.begin_fixed(capacity)

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        self.kv.append_fixed(keys, values, position, compiled=self.compiled_step)

    def end_fixed_shape(self, length: int) -> None:
        self.kv.end_fixed(length)

    def prompt_query_window(self) -> int | None:
        # the sinks are the tokens these queries attend most
        return SNAP_WINDOW if self.sink_tokens > 0 else 0

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        """Chooses the sinks (on the unrotated keys: q . k is rotation invariant), then `CompressedStore.prefill`
        builds mu/alpha/codebook and compresses the prompt."""
        sinks = None
        if self.sink_tokens > 0:
            sinks = snap_sinks(keys, query, self.sink_tokens, self.layer.scaling, key_mask)
        self.kv.prefill(keys, values, key_mask, sinks)
        self._prefilled = True

    # --- a prompt stored chunk by chunk ----------------------------------------------------------------------

    def opens_prompt(self, held: int, key_mask: torch.Tensor | None) -> bool:
        """Whether the prompt held so far (`held` tokens, key_mask [B, held] or None) gives every row
        `prompt_stats_tokens` real tokens: its statistics are then built and the prompt is compressed chunk by
        chunk from here on (`open_prompt`)."""
        if self.prompt_stats_tokens == 0:
            return False
        real = held if key_mask is None else int(key_mask.sum(-1).min())
        return real >= self.prompt_stats_tokens

    def open_prompt(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    key_mask: torch.Tensor | None, capacity: int = 0) -> None:  # fmt: skip
        """The first chunks of a prompt (keys / values [B, Hkv, N, d], its last queries, key_mask [B, N]):
        the statistics from them, their rows compressed (room for `capacity` rows at once: the later chunks are
        not copied into ever larger buffers); no sinks until the prompt ends (`close_prompt`)."""
        self.kv.reserve(capacity)
        self.kv.prefill(keys, values, key_mask, None)
        self._prefilled = True
        self._sink_pool = []
        self._add_sink_candidates(keys, values, query, key_mask, 0)

    def store_prompt_chunk(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        """A later chunk of a prompt stored chunk by chunk, compressed with the statistics of its first tokens."""
        first = self.kv.rows.length
        self.kv.append(keys, values)
        self.kv.trim_tail()
        self._add_sink_candidates(keys, values, query, None, first)

    def close_prompt(self, query: torch.Tensor) -> None:
        """The prompt stored chunk by chunk has ended; its last queries choose the sinks among the candidates."""
        pool, self._sink_pool = self._sink_pool, []
        if not pool:
            return
        keys, values, positions = (torch.cat(part, dim=2) for part in zip(*pool, strict=True))
        chosen, rank, index = rank_sink_pool(
            keys, positions, query, self.sink_tokens, self.layer.scaling, self.kv.rows.length
        )
        gather = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.kv.set_sinks(chosen, rank, keys.gather(2, gather), values.gather(2, gather))

    def read_stored_into(self, keys: torch.Tensor, values: torch.Tensor, row: int | None = None) -> None:
        """The tokens stored so far, dequantized, as the model gave them, into keys / values [B, Hkv, N, d] (of
        batch row `row` only, [1, Hkv, N, d], when given)."""
        (self.kv if row is None else self.kv.row(row)).read_all_into(keys, values)

    def _add_sink_candidates(self, keys, values, query, key_mask, first: int) -> None:
        """A chunk's own sink candidates: the tokens its last queries attend most (`snap_sinks` over the chunk),
        with their 16-bit K/V and absolute positions."""
        if self.sink_tokens == 0:
            return
        positions, _ = snap_sinks(keys, query, self.sink_tokens, self.layer.scaling, key_mask)
        index = positions.clamp(max=keys.shape[2] - 1)[..., None].expand(-1, -1, -1, keys.shape[-1])
        fp = self.kv.storage_dtype(keys)
        absolute = torch.where(positions < SENTINEL, positions + first, positions)
        self._sink_pool.append((keys.gather(2, index).to(fp), values.gather(2, index).to(fp), absolute))

    def _rotated_query(self, step: DecodeStep) -> DecodeStep:
        """The step with its query rotated (k_rotate), once per step: select and attend see the same query."""
        if self.kv.k_signs is None:
            return step
        if self._rotated_for is None or self._rotated_for[0] is not step.query:
            rotate = maybe_compiled(CompressedStore.rotate_keys, self._compiles(step))
            self._rotated_for = (step.query, rotate(self.kv, step.query))
        return step.replace(query=self._rotated_for[1])

    def _compiles(self, step: DecodeStep) -> bool:
        """Whether the step's tensor code runs through torch.compile: fixed-shape steps under `compile_step`."""
        return self.compiled_step and step.hints is not None and step.hints.fixed

    # --- selection ----------------------------------------------------------------------------------------------

    def codes(self) -> torch.Tensor:
        """[B, Hkv, N, G] uint8 sign-pattern codes of every cached token (decoded from the stored sign bits)."""
        return codes_from_sign_bits(self.kv.rows.view("sign_bits"), self.layer.head_dim)

    def _per_prompt(self, name: str, key: tuple, make):
        """`make()`, remembered while `key` (tensors compared by identity, then values) stays the same: what
        a decode loop would otherwise rebuild at every step from state fixed since the prefill."""
        held = self._derived.get(name)
        if held is None or not all(map(_same, held[0], key)):
            held = self._derived[name] = (key, make())
        return held[1]

    def _by_nibble(self) -> torch.Tensor:
        """The centroids indexed by the raw nibble of the packed sign bits, as the kernels' ops read them."""
        centroids = self.kv.centroids
        return self._per_prompt(
            "by_nibble", (centroids,), lambda: centroids.index_select(3, bitrev4(centroids.device).long())
        )

    def score(self, step: DecodeStep) -> torch.Tensor:
        layer, centroids = step.layer, self.kv.centroids
        if step.gqa == "group" and step.query.dtype != torch.float64:
            # the kernels' op (group-summed, its table quantized, Triton on CUDA)
            scores = kernel_lut_scores(step.query, self._by_nibble(), self.kv.rows.view("sign_bits"))
        else:
            work = torch.float64 if centroids.dtype == torch.float64 else torch.float32
            query = step.query.to(work)
            if step.gqa == "group" and layer.group_size > 1:
                b, _, q, d = query.shape
                query = query.view(b, layer.num_kv_heads, layer.group_size, q, d).sum(2)
            scores = lut_scores(query, centroids.to(work), self.codes())
        scores = scores.float()
        kv = self.kv
        if kv.sink_positions is not None:
            heads, keys = scores.shape[1], scores.shape[-1]
            sinks = self._per_prompt("sinks", (kv.sink_positions, heads, keys),
                                     lambda: sink_boost(kv.sink_positions, kv.sink_rank, heads, keys, scores.dtype))  # fmt: skip
            scores = boost_sinks(scores, step.budgets, sinks, self.sink_share)
        return scores

    def select(self, step: DecodeStep) -> Selection:
        """Top-budget by LUT score with sinks first; a stable sort breaks ties by position, so a row's selection
        does not depend on the other rows or on the row length (chunked == token-by-token)."""
        step = self._rotated_query(step)
        k_max = step.max_budget()
        if step.hints is not None and step.hints.fixed and self._fuses(step):
            return self._select_fused(step, k_max)
        scores = to_selection_heads(self.score(step), step).float()
        if step.uniform and scores.device.type != "cpu":
            # every key visible, forced keys are two index ranges: set in place, no [B, H, Q, N] masks
            forced = _force(scores, step.hints.sink, step.hints.local, float("inf"))
            return self._select_uniform_device(step, forced, k_max)
        if step.hints is not None and step.hints.fixed and _device_rule(scores):
            return self._select_fixed_device(step, scores, k_max)
        visible = step.visible[:, None]
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(step.forced[:, None], float("inf"))
        if self.rescore > 0:
            scores = self._rescored(step, scores, k_max)
        ranked = scores.sort(dim=-1, descending=True, stable=True)
        values, indices = ranked.values[..., :k_max], ranked.indices[..., :k_max]
        ranks = torch.arange(k_max, device=scores.device)
        valid = (ranks < step.budgets[:, None, :, None]) & (values > float("-inf"))
        return Selection(indices=indices, valid=valid)

    def _select_uniform_device(self, step: DecodeStep, scores: torch.Tensor, k_max: int) -> Selection:
        """`select` on a uniform device step (every row keeps k_max of all N keys): top-k instead of a full stable
        sort of the N scores (twice with the re-rank), and the re-rank ranks its candidate list directly. The set
        equals the CPU rule's up to how torch.topk orders equal scores; no host sync, so the step can be captured
        in a CUDA graph."""
        if self.rescore > 0:
            first, index = scores.topk(min(scores.shape[-1], self.rescore * k_max), dim=-1, sorted=False)
            fine = self._candidate_scores(step, index, ranked=first > float("-inf"))
            second = torch.where(first >= SINK_BASE, first, fine).masked_fill(
                first == float("-inf"), float("-inf")
            )
            values, pick = second.topk(k_max, dim=-1, sorted=False)
            indices = index.gather(-1, pick)
        else:
            values, indices = scores.topk(k_max, dim=-1, sorted=False)
        return Selection(indices=indices, valid=values > float("-inf"))

    def _select_fixed_device(self, step: DecodeStep, scores: torch.Tensor, k_max: int) -> Selection:
        """`select` on a fixed-shape device step (the whole preallocated buffer, unwritten slots masked, budgets
        on the device under the host bound k_max): the uniform step's two top-k, after each of which a row drops
        its surplus over its own budget, so the set equals the CPU rule's up to how torch.topk orders equal
        scores. No host sync: the step is captured in a CUDA graph. With `compiled_step` the two stages around
        the re-rank run through torch.compile."""
        min_budget = step.hints.min_budget if step.hints.min_budget is not None else 0
        budgets = step.budgets[:, None, :, None]
        visible, forced = step.visible[:, None], step.forced[:, None]
        if self.rescore == 0:
            pick = maybe_compiled(_fixed_pick, self.compiled_step)
            return Selection(*pick(scores, visible, forced, budgets, k_max, min_budget))
        first, index, keep = maybe_compiled(_fixed_candidates, self.compiled_step)(
            scores, visible, forced, budgets, self.rescore, k_max, min_budget
        )
        fine = self._candidate_scores(step, index, ranked=keep)
        rerank = maybe_compiled(_fixed_rerank, self.compiled_step)
        indices, valid = rerank(first, fine, index, keep, budgets, k_max, min_budget)
        return Selection(indices=indices, valid=valid)

    def _fuses(self, step: DecodeStep) -> bool:
        """Whether a fixed-shape step takes the fused first stage (`_select_fused`): GQA "group" rows (or one query
        head per kv head), not float64, one query per row, fewer kept than cached keys, at most MAX_LISTED sinks, on
        the kernels' device."""
        kv = self.kv
        return (
            (step.gqa == "group" or step.layer.group_size == 1)
            and kv.centroids is not None
            and torch.float64 not in (kv.centroids.dtype, step.query.dtype)
            and step.query.shape[2] == 1
            and step.hints.max_budget < kv.rows.view("sign_bits").shape[2]
            and (kv.sink_positions is None or kv.sink_positions.shape[-1] <= MAX_LISTED)
            and _fused_rule(step.query)
        )

    def _select_fused(self, step: DecodeStep, k_max: int) -> Selection:
        """A fixed-shape step's selection with the first stage in one op (`kernels.lut_score.lut_topk_fixed`):
        the LUT scores of the whole buffer, the forced keys (sinks, sink/local hints) and the unwritten slots
        ranked in the same pass, and the rescore x k_max best picked by the sort-free histogram select. Then each
        row's own rescore x budget of them, the re-rank by q . K over those candidates only, and each row's budget
        of them (`kernels.select_within`: ties to the lower position, the CPU rule's stable sort). The same set as
        the CPU rule, whose scores are the same quantized LUT's.

        Where the picks are all held keys (`StepHints.picks_held`), the select itself keeps each row's own
        rescore x budget (a device count per row), and each row keeps exactly its budget: the stats are counted
        on the host (`Selection.exact_budgets`).

        With the "softmax" group rule the re-rank's per-head q . K of the picks are their attention logits too:
        `attend` reads them (`device.attend_scored`, V alone) instead of the keys again. H200, 128K x B4 (kernel
        graph replays): 51.9 us against 69.9 us for the attention that reads K and V."""
        hints = step.hints
        sign_bits = self.kv.rows.view("sign_bits")
        b, hkv = sign_bits.shape[:2]
        budgets = _row_budgets(step, b, hkv)
        table, summed = maybe_compiled(_first_stage_inputs, self.compiled_step)(step.query, self._by_nibble())
        scale = max(1, self.rescore)
        wide = min(sign_bits.shape[2], scale * k_max)
        held = hints.min_written is not None and wide <= hints.min_written
        every = held and hints.min_budget == hints.max_budget and wide == scale * k_max  # every row keeps all
        counts = keep = None
        if held and not every:
            counts, keep = row_counts(step, b, hkv, 1, wide, scale=scale)
        picked, ranks = lut_topk_fixed(table, sign_bits, wide, hints.written, self._forced_sinks(step),
                                       sink=hints.sink, local=hints.local, counts=counts)  # fmt: skip
        if self.rescore == 0 and held:
            return every_index(picked, exact_budgets=True) if every else Selection(picked, keep, exact_budgets=True)
        if not held:  # each row's own rescore x budget of the picks (equal ranks: the lower position first)
            first = torch.where(ranks > 0, ranks.float(), float("-inf"))
            pick, keep = select_within(first, scale * budgets, wide if self.rescore else k_max)
            if self.rescore == 0:
                return Selection(indices=picked.gather(-1, pick), valid=keep)
            picked, ranks = picked.gather(-1, pick), ranks.gather(-1, pick)
        per_head = self._ranks_per_head(step)
        scores = self._key_scores(step, picked, summed, per_head)
        group_scaling = step.layer.scaling if per_head else None
        second = maybe_compiled(_second_stage, self.compiled_step)(ranks, scores, keep, group_scaling)
        pick, valid = select_within(second, budgets, k_max)
        selection = Selection(indices=picked.gather(-1, pick), valid=valid, exact_budgets=held)
        if per_head and self.compressed:  # `attend` takes the picks' logits from the scores: no key read again
            self._scored = (selection.indices, scores, pick)
        return selection

    def _forced_sinks(self, step: DecodeStep) -> torch.Tensor | None:
        """[B, Hkv, S] positions of the sinks that this step's rows force, best SnapKV rank first (`boost_sinks`:
        the best share x budget of them; SENTINEL = not forced), or None without sinks. Where every row's budget forces
        all of them, the prompt's positions themselves (no per-step work)."""
        kv = self.kv
        if kv.sink_positions is None:
            return None
        by_rank = self._per_prompt("sinks_by_rank", (kv.sink_positions,),
                                   lambda: kv.sink_positions.long().gather(-1, kv.sink_rank.long().argsort(-1)))  # fmt: skip
        count = by_rank.shape[-1]
        if step.hints.min_budget is not None and int(step.hints.min_budget * self.sink_share) >= count:
            return by_rank
        cap = torch.floor(step.budgets.to(torch.float64) * self.sink_share).long()  # [B, Q=1]
        return torch.where(torch.arange(count, device=cap.device) < cap[:, :, None], by_rank, SENTINEL)

    def _rescored(self, step: DecodeStep, scores: torch.Tensor, k_max: int) -> torch.Tensor:
        """Second stage: the LUT's best `rescore` x budget tokens of each row are re-ranked by q . K read from the
        cache itself (sign bits x 2-bit magnitudes, or the 16-bit keys); every other token drops out. The 1-bit
        LUT alone loses the magnitudes, so it misses outlier keys that carry most of the attention mass.

        Forced and sink tokens keep their first-stage priority. A row's result depends only on its own scores
        and budget (chunked == token-by-token)."""
        c_max = min(scores.shape[-1], self.rescore * k_max)
        ranked = scores.sort(dim=-1, descending=True, stable=True)
        first, index = ranked.values[..., :c_max], ranked.indices[..., :c_max]
        ranks = torch.arange(c_max, device=scores.device)
        keep = (ranks < self.rescore * step.budgets[:, None, :, None]) & (first > float("-inf"))
        fine = self._candidate_scores(step, index, ranked=keep)
        priority = first >= SINK_BASE  # forced (+inf) and sinks
        second = torch.where(priority, first, fine).masked_fill(~keep, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter(-1, index, second)

    def _ranks_per_head(self, step: DecodeStep) -> bool:
        """The re-rank weighs each query head of a GQA group by its own attention (`rescore_group="softmax"`)."""
        return self.rescore_group == "softmax" and step.gqa == "group" and step.layer.group_size > 1

    def _candidate_scores(self, step: DecodeStep, index: torch.Tensor, summed: torch.Tensor | None = None,
                          ranked: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The re-rank's score of the tokens `index` [B, S, Q, C] of each row, from q . (K - mu) with the keys as the
        row's query reads them in attention (compressed tokens dequantized, sinks and the query's residual block at
        16-bit: `device.candidate_scores`); q . mu is the same for every key of a row and is left out. For
        gqa="group" the query is summed over the group (exact by linearity; `summed`: already summed, by
        `group_query`), or with `rescore_group="softmax"` each head's softmax over the row's `ranked` candidates
        [B, S, Q, C] is summed."""
        per_head = self._ranks_per_head(step)
        scores = self._key_scores(step, index, summed, per_head)
        return _group_rank(scores, step.layer.scaling if per_head else None, ranked)

    def _key_scores(self, step: DecodeStep, index: torch.Tensor, summed: torch.Tensor | None,
                    per_head: bool) -> torch.Tensor:  # fmt: skip
        """q . (K - mu) of the candidates `index` as `_candidate_scores` ranks them, before the group's rule."""
        if self.compressed:
            return device.candidate_scores(self.kv, step, index, summed, per_head)
        return self._full_key_scores(step, index, per_head)  # kv_bits=16: the keys as stored

    def _full_key_scores(self, step: DecodeStep, index: torch.Tensor, per_head: bool) -> torch.Tensor:
        """q . (K - mu) of an uncompressed store's (kv_bits=16) rows `index` [B, S, Q, C] -> [B, S, Q, C] (with
        `per_head` [B, S, G, Q, C]), in the work dtype."""
        layer = step.layer
        work = self.kv.mu.dtype
        query = step.query.to(work)
        b, _, q_len, d = query.shape
        if step.gqa == "group" and layer.group_size > 1:
            query = query.view(b, layer.num_kv_heads, layer.group_size, q_len, d)
            query = query if per_head else query.sum(2)
        s = index.shape[1]
        mu = self.kv.per_head(self.kv.mu, s)[:, :, None]  # [B, S, 1, 1, d]
        keys = self.kv.gather(self.kv.rows, "k_full", index).to(work) - mu  # [B, S, Q, C, d]
        pattern = "bsgqd,bsqcd->bsgqc" if per_head else "bsqd,bsqcd->bsqc"
        return torch.einsum(pattern, query, keys)

    # --- attention over the gathered tokens -------------------------------------------------------------------

    def attend(self, step: DecodeStep, selection: Selection, scaling: float) -> torch.Tensor:
        """Attention of step.query over the selected tokens. The stored V is V R with v_rotate: both paths attend
        over it and the output is un-rotated here (out = out' R^T)."""
        model_dtype = step.query.dtype
        step = self._rotated_query(step)
        kv = self.kv
        unrotate = functools.partial(maybe_compiled(_output_rows, self._compiles(step)), kv)
        if self.compressed:  # dequantizes only the selected tokens' bytes (in registers on the kernels)
            scored, self._scored = self._scored, None
            if scored is not None and scored[0] is selection.indices:  # this step's fused selection
                return unrotate(device.attend_scored(kv, step, selection, scored[1], scored[2], scaling))
            return unrotate(device.attend(kv, step, selection, scaling, model_dtype))
        keys, values = kv.rows.view("k_full"), kv.rows.view("v_full")
        out = sparse_attention(step.query, keys, values, selection.indices, selection.valid, scaling,
                               tickets=self.attention_tickets(selection, step.query.device))  # fmt: skip
        return unrotate(out)


def _row_budgets(step: DecodeStep, b: int, hkv: int) -> torch.Tensor:
    """Each kv head row's budget, int64 [B, Hkv, 1], shared by the layers of a fixed-shape step."""
    shared = step.hints.shared if step.hints.shared is not None else {}
    key = ("row budgets", b, hkv)
    if key not in shared:
        shared[key] = step.budgets[:, None, :].expand(b, hkv, 1).contiguous()
    return shared[key]


def _output_rows(kv: CompressedStore, out: torch.Tensor) -> torch.Tensor:
    """An attention output [B, Hq, Q, d] in the stored V domain -> out R^T (`unrotate_values`), laid out as
    [B, Q, Hq, d]: the attention function's transpose to that layout then copies nothing (compiled, one kernel
    does both)."""
    return kv.unrotate_values(out).transpose(1, 2).contiguous().transpose(1, 2)


def _first_stage_inputs(query: torch.Tensor, by_nibble: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused step's query-side work in one piece (one compiled graph under `compile_step`): the first stage's
    integer LUT (`quantized_lut`) and the re-rank's group-summed query (`group_query`)."""
    table, _ = quantized_lut(query, by_nibble)
    return table, group_query(query, by_nibble.shape[1])


def _group_rank(scores: torch.Tensor, scaling: float | None, ranked: torch.Tensor | None) -> torch.Tensor:
    """The re-rank's score of each candidate: with `scaling` (`rescore_group="softmax"`), scores [B, S, G, Q, C]
    are each query head's logits, and a candidate's score is the group's summed attention over the row's `ranked`
    candidates [B, S, Q, C]; without, scores [B, S, Q, C] already rank them (the summed query's q . K)."""
    if scaling is None:
        return scores.float()
    logits = scores.float() * scaling
    if ranked is not None:
        logits = logits.masked_fill(~ranked[:, :, None], float("-inf"))
    return torch.nan_to_num(logits.softmax(-1), nan=0.0).sum(2)


def _second_stage(ranks: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor | None,
                  scaling: float | None) -> torch.Tensor:  # fmt: skip
    """The fused step's second-stage scores from the re-rank's q . K (one compiled graph under `compile_step`):
    `_group_rank`, then `_rerank_scores`."""
    return _rerank_scores(ranks, _group_rank(scores, scaling, keep), keep)


def _rerank_scores(ranks: torch.Tensor, fine: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The re-rank's scores of the candidates: q . K (`fine`), except the forced candidates, which keep their
    first-stage order above every re-ranked one (as the CPU rule's sink boosts); -inf where `keep` is false."""
    second = torch.where(ranks > LUT_SCORE_RANK_MAX, SINK_BASE + ranks.float(), fine)
    return second if keep is None else second.masked_fill(~keep, float("-inf"))


def _fixed_pick(scores, visible, forced, budgets, k_max: int, min_budget: int):
    """A fixed-shape step without the re-rank: (indices, valid) of each row's best `budgets` of the visible keys,
    forced ones first."""
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(forced, float("inf"))
    values, indices = scores.topk(k_max, dim=-1, sorted=False)
    return indices, _best_within(values, budgets, min_budget)


def _fixed_candidates(scores, visible, forced, budgets, rescore: int, k_max: int, min_budget: int):
    """The re-rank's first stage in a fixed-shape step: each row's best rescore x `budgets` keys by LUT score
    (first scores, their positions, and which of the rescore x k_max picks the row keeps)."""
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(forced, float("inf"))
    first, index = scores.topk(min(scores.shape[-1], rescore * k_max), dim=-1, sorted=False)
    return first, index, _best_within(first, rescore * budgets, rescore * min_budget)


def _fixed_rerank(first, fine, index, keep, budgets, k_max: int, min_budget: int):
    """The second stage: forced and sink candidates keep their first-stage priority, the others rank by q . K as
    attention reads K (`fine`); each row keeps its `budgets` best."""
    second = torch.where(first >= SINK_BASE, first, fine).masked_fill(~keep, float("-inf"))
    values, pick = second.topk(k_max, dim=-1, sorted=False)
    return index.gather(-1, pick), _best_within(values, budgets, min_budget)


def _same(a, b) -> bool:
    """Tensors are the same state when they are the same object (held, so never a reused id); others by value."""
    return a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b


def _device_rule(scores: torch.Tensor) -> bool:
    """Whether a fixed-shape step selects with the device rule (`_select_fixed_device`): off the CPU, which ranks
    whole rows with a stable sort instead (tests substitute the device rule there)."""
    return scores.device.type != "cpu"


def _fused_rule(query: torch.Tensor) -> bool:
    """Whether a fixed-shape step takes `_select_fused`: where the fused op runs its kernel (tests substitute it
    on CPU, where the op runs its reference)."""
    from sparsekv.kernels._triton import use_triton

    return query.device.type != "cpu" and use_triton(query)


def _best_within(values: torch.Tensor, budgets: torch.Tensor, min_budget: int) -> torch.Tensor:
    """[..., k] bool: the `budgets` best of each row's k unsorted `values` (budgets broadcast over the rows and
    >= min_budget; -inf entries never count). Only the k - min_budget lowest can drop out, so only those are
    ranked."""
    k = values.shape[-1]
    valid = values > float("-inf")
    surplus = k - min_budget
    if surplus <= 0:
        return valid
    lowest = values.topk(min(surplus, k), dim=-1, largest=False, sorted=True).indices
    dropped = torch.arange(lowest.shape[-1], device=values.device) < (k - budgets)
    return valid.scatter(-1, lowest, valid.gather(-1, lowest) & ~dropped)
