"""Self-Indexing KV cache: the compressed keys are their own retrieval index.

Per layer and kv-head, at the prefill:

* by default (`k_rotate`) keys are rotated first, K R with the layer's fixed orthogonal R (random +-1 signs x the
  normalised Hadamard matrix, the same R as V's below), and every query is rotated by R before scoring and
  attention: q . k is unchanged, but everything below sees keys whose energy is spread over all channels rather
  than piled in a few RoPE channels (the LUT alone then keeps 86% of the attention mass instead of 66%; decode
  perplexity at 10% 1.028x dense instead of 1.046x over 9 windows x 3 seeds, with `v_clip`);
* keys are centred per channel (mu = mean over the prompt) so that every sign bit carries ~1 bit of entropy;
* each key is split into groups of 4 channels; the sign pattern of a group is a 4-bit code (first channel of the
  group = most significant bit, +1 -> 1, -1/0 -> 0);
* the codebook is built in one pass: per group, the 16 centroids are the means of the centred prompt keys having
  that sign pattern (an empty pattern falls back to the pattern's signs times the group's mean magnitudes);
* scoring a query is a table lookup: table[g, c] = q_g . centroid[g, c], score(key) = sum_g table[g, code_g(key)];
  the top-k of these scores (GQA "group": the group's queries are summed first, which is exact by linearity) is
  the selection, with the method's sink tokens always in front;
* second stage (`rescore`, default 3; 0 = the paper's LUT-only top-k): the LUT's best 3 x budget tokens of a row
  are re-ranked by q . K as that row's query reads K in attention (`compressed_kv.dequantized_rows`: compressed
  tokens dequantized, sinks and the query's residual block from their 16-bit copies) and the best `budget` kept. Measured on SmolLM2
  (2K window, 10%): the LUT alone keeps 65% of the exact attention mass (81% with token 0 forced), the re-ranked
  selection 87-89%, the oracle 93%; the LUT's centroids cannot tell an outlier key from an ordinary one with the
  same sign pattern, and those outliers carry the attention;
* storage: the sign bits are the index *and* the sign of the stored key (1 bit per element). The magnitudes
  |K - mu| / alpha (alpha = per-channel abs max over the prompt) are quantized to `k_bits` (3 by default, the
  paper uses 2) bits, scale only (levels q x scale, q = 0..2^k_bits - 1, zero fixed at 0: magnitudes are >= 0).
  By default (`k_axis="auto"` -> "channel", KIVI-style) one float16 scale per channel per block of `k_group`
  (32) tokens, so an outlier channel no longer coarsens the other channels of its token (`k_axis="token"`: one
  scale per 32 channels of one token, the layout before). The values V are quantized token-wise to `kv_bits` (2)
  bits with a float16 scale and zero per 64 elements (the paper: 32), the range of each group clipped to the
  least squared error (`v_clip`). Same bytes per token as the paper's layout.
  By default (`v_rotate`) V is stored rotated, V R with a fixed orthogonal R per layer (random +-1 signs x the
  normalised Hadamard matrix), so that one outlier channel no longer sets the 2-bit range of its whole group; the
  16-bit copies (sinks, residual block) are rotated too, and `attend` un-rotates the attention output (exact:
  softmax . (V R) = (softmax . V) R). Offline, this halves the attention-output error of 2-bit V (0.218 -> 0.116).
  `kernels.compressed_format.dequantize_keys` / `dequantize` are the formulas of the gathered K / V rows. Nothing
  else of a compressed token is kept; attention gathers the selected tokens and dequantizes only those.
* `sink_tokens` (32; the paper: 64) tokens per kv-head are chosen SnapKV-style at the prefill (attention of the
  last 32 prompt queries, summed over the group, avg-pooled with kernel 5) and kept at 16-bit precision; the
  selection includes them first (inside the budget, ranked by their SnapKV weight), at most `sink_share` (1/4) of
  a query's budget.

Decode tokens (decision): every new token's sign bits (its code) and V are compressed as soon as it is stored,
with the prompt's mu/alpha and codebook (codebooks are not updated, so nothing depends on future tokens). The
tokens of the current *residual block* stay readable at 16-bit: blocks of `residual` tokens are counted from the
first decode position, and a query at position p reads the tokens of its own block (positions block_start(p)..p)
at 16-bit and every older token compressed. That is exactly what token-by-token decoding does when a block's
16-bit copy is dropped once the block is full, so chunked decoding gives the same result; at rest the 16-bit copy
holds < `residual` tokens. With `k_axis="channel"` a token's |K| codes need its whole K block, so K is compressed
a block at a time when the block fills: the prompt's blocks end at the prompt's end (the first block may be
short; token t's scale row is (t + pad) // k_group, pad = (-prompt_len) mod k_group), decode blocks are every
k_group tokens from the first decode position, and `residual` must be a multiple of k_group, so a block is always
full (and compressed, from the tokens' 16-bit copies) before any query reads it compressed. Block scales leave out
padding and the 16-bit sinks.

`kv_bits=16` keeps K/V in the input precision and uses only the 1-bit index (the paper's "16,16,1" row); it then
reproduces dense attention when the budget covers the context.

Memory: `SelfIndexSelector.memory_breakdown()` and `sparsekv.cache.cache_memory(cache)` measure the bytes of the
tensors actually held (buffer capacity included), and `sparsekv cache-memory` (`sparsekv.cli_methods`, measured by
`sparsekv.eval.cache_memory`) prints them per token against a bf16 dense cache.

GQA "group" scoring goes through `kernels.lut_score` (Triton on CUDA): its table is quantized per query row
(`quantized_lut`: integer entries, every score an exact integer sum within +-16,254 steps), so the CPU rule and the
kernels rank the same integers; `scoring.lut_scores` is the float reference used for gqa="head" and float64. A
fixed-shape (captured) decode step on CUDA runs the first stage as one op (`lut_topk_fixed`: scores, sinks and
local keys forced, unwritten slots, the radix select's first histogram in one pass over the sign bits, then the
sort-free select, which keeps each row's own 3 x budget candidates once every pick is a held key) and each row's
budget of the re-ranked candidates with `kernels.select_within`; no [B, H, N] tensor is built. The re-rank
and the dequantizing attention are the ops of `kernels.compressed_kv` (`device`): Triton kernels over the stored
bytes on CUDA, their references (`dequantized_rows`) elsewhere. `kernels.bits.pack_sign_bits` packs
the sign bits.

Modules: `codes` (sign codes, codebook), `rotation` (the fixed orthogonal R; its seed is `rotation.V_ROTATE_SEED`),
`scoring` (LUT scores, sinks), `store` (`CompressedStore`: what a layer holds, its writes and reads, memory),
`device` (the decode step's reads of the compressed cache, through the ops), `selector` (`SelfIndexSelector`). The
format itself (bit packing, quantizers, dequantization) is `kernels.compressed_format`.
"""

from sparsekv.selectors.self_index.codes import (
    GROUP_DIMS,
    codes_from_sign_bits,
    one_pass_centroids,
    sign_codes,
)
from sparsekv.selectors.self_index.rotation import rotation_base, rotation_signs, value_rotation
from sparsekv.selectors.self_index.scoring import SNAP_KERNEL, SNAP_WINDOW, lut_scores, snap_sinks
from sparsekv.selectors.self_index.selector import KV_BITS, SelfIndexSelector
from sparsekv.selectors.self_index.store import CompressedStore, quant_group_size

__all__ = [
    "GROUP_DIMS",
    "KV_BITS",
    "SNAP_KERNEL",
    "SNAP_WINDOW",
    "CompressedStore",
    "SelfIndexSelector",
    "codes_from_sign_bits",
    "lut_scores",
    "one_pass_centroids",
    "quant_group_size",
    "rotation_base",
    "rotation_signs",
    "sign_codes",
    "snap_sinks",
    "value_rotation",
]
