"""What one self-index layer holds, and how it is written and read back.

Per kv-head: the prompt's statistics (mu = mean key, alpha = per-channel max |K - mu|, the codebook), the rows of
every token (packed sign bits, |K - mu| / alpha codes, V codes with their scales, in `kernels.compressed_format`'s
layout; kv_bits=16: the full K/V instead), the K block scales (k_axis="channel"), the 16-bit copies of the sinks
and of the current residual block, and the layer's rotation signs. Every stored K row is K R with k_rotate, every
stored V row V R with v_rotate.

Writes: `prefill` (statistics, codebook, sink copies, the prompt's rows), `append` (decode tokens, and the later
chunks of a prompt stored chunk by chunk: rows with the prompt's statistics, the residual block's 16-bit copy, and
the K blocks completed), `set_sinks` (the sinks of a prompt stored chunk by chunk, once it ended). Reads:
`kernel_view` hands the stored bytes to `kernels.compressed_kv`, whose ops and `dequantized_rows` read the tokens as
a query at a given position reads them (compressed rows dequantized, sinks and the query's own residual block from
their 16-bit copies); `read_all_into` writes every token so. `memory_breakdown` measures the bytes of the tensors
held (buffer capacity included).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from sparsekv.config import ConfigError
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.compressed_format import (
    pack_bits,
    quantize,
    quantize_codes,
)
from sparsekv.kernels.compressed_kv import CompressedKV, dequantized_rows
from sparsekv.selectors.base import maybe_compiled, tensor_nbytes
from sparsekv.selectors.self_index.buffers import RowBuffers
from sparsekv.selectors.self_index.codes import one_pass_centroids, sign_codes
from sparsekv.selectors.self_index.rotation import rotation_base, rotation_signs
from sparsekv.selectors.self_index.scoring import sequence_groups

QUANT_GROUP = (
    32  # preferred channels per K scale (k_axis="token") / tokens per K scale row (k_axis="channel")
)
FP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "input": None}


def work_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype statistics, dequantized rows and scores are computed in: float64 for float64 inputs (exact tests),
    else float32."""
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def quant_group_size(head_dim: int, preferred: int = QUANT_GROUP) -> int:
    """`preferred` elements per (scale, zero) pair, or the largest of 32/16/8/4 dividing head_dim below it."""
    for size in (preferred, 32, 16, 8, 4):
        if size <= preferred and head_dim % size == 0:
            return size
    raise ConfigError(f"self-index needs a head_dim divisible by 4, got {head_dim}")


#: the first torch release whose CPU inductor runs the compiled token encoding: torch 2.11's vectorized C++ kernel
#: of `_open_block` aborts the process (measured; 2.13 runs it, and 2.11 with vectorization off too)
CPU_COMPILE_TORCH = (2, 13)


def check_compiled_device(device: torch.device) -> None:
    """A clear error in place of torch's abort: `compile_step` with self-index on CPU needs CPU_COMPILE_TORCH."""
    if device.type == "cpu" and torch.torch_version.TorchVersion(torch.__version__) < CPU_COMPILE_TORCH:
        raise ConfigError(
            f"compile_step with self-index on CPU needs torch >= {'.'.join(map(str, CPU_COMPILE_TORCH))} (torch "
            f"{torch.__version__}'s CPU compiler aborts on its token encoding); decode without compile_step, or on CUDA"
        )


#: tokens per `_append` of a long `append`: 1,024 tokens x 8 kv heads of 128 channels make about 40 MB of float32
#: work tensors a sequence, an 8,192-token chunk about 0.3 GB
APPEND_SLICE = 1024

#: rows up to which a rotation traced by torch.compile is a multiply-sum instead of a matmul (`_times`)
FUSED_ROTATION_ROWS = 4096


def _prompt_statistics(keys: torch.Tensor, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """mu [B, H, 1, d] (the mean key), alpha [B, H, 1, d] (the largest |K - mu| per channel) and the codebook [B, H,
    d/4, 16, 4] (`one_pass_centroids`) of keys [B, H, N, d] (rotated) in the work dtype; key_mask [B, N] (False =
    padding) keeps padding out."""
    b, _, n, _ = keys.shape
    k = keys.to(work_dtype(keys))
    weight = torch.ones(b, n, dtype=k.dtype, device=k.device) if key_mask is None else key_mask.to(k.dtype)
    wsum = weight.sum(-1).clamp(min=1)[:, None, None, None]
    mu = (k * weight[:, None, :, None]).sum(2, keepdim=True) / wsum
    centred = k - mu
    alpha = (centred.abs() * weight[:, None, :, None]).amax(2, keepdim=True)
    alpha = alpha.clamp(min=torch.finfo(k.dtype).tiny ** 0.5)
    mask = None if key_mask is None else key_mask.bool()
    return mu, alpha, one_pass_centroids(centred, sign_codes(centred), mask)


def _times(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., d] @ matrix [d, d]. Traced by torch.compile (`compile_step`: a decode step's few rows) it is a
    multiply-sum that inductor fuses with the ops around it: cuBLAS's float32 kernels for these 8-32 rows took up
    to 51 us each inside the captured step (H200, 128K x B1), four a layer."""
    if torch.compiler.is_compiling() and x.numel() <= FUSED_ROTATION_ROWS * x.shape[-1]:
        return (x.unsqueeze(-1) * matrix).sum(-2)
    return torch.matmul(x, matrix)


class CompressedStore:
    """One layer's self-index K/V. The format options are `SelfIndexSelector`'s, already resolved (k_bits > 0,
    k_axis "token" or "channel", group sizes that divide head_dim)."""

    def __init__(self, *, layer_idx: int, num_kv_heads: int, kv_bits: int, k_bits: int, k_axis: str,
                 k_group: int, v_group: int, k_zero: bool, v_clip: bool, residual: int, fp_dtype: str,
                 v_rotate: bool, k_rotate: bool) -> None:  # fmt: skip
        self.layer_idx, self.num_kv_heads = layer_idx, num_kv_heads
        self.kv_bits, self.k_bits, self.k_axis, self.k_group, self.v_group = (
            kv_bits,
            k_bits,
            k_axis,
            k_group,
            v_group,
        )
        self.k_zero, self.v_clip, self.residual, self.fp_dtype = k_zero, v_clip, residual, fp_dtype
        self.v_rotate, self.k_rotate = v_rotate, k_rotate
        self.rows = RowBuffers()  # sign bits (+ quantized K/V, or full K/V when kv_bits=16)
        self.tail = RowBuffers(reserve=residual, step=residual)  # 16-bit copy of the current block(s)
        self.tail_start = 0
        self.decode_start = 0
        # k_axis="channel": one fp16 scale row [d] per block of k_group tokens; blocks end at the prompt's end and
        # then every k_group decode tokens, so token t is in block row (t + k_pad) // k_group
        self.k_blocks = RowBuffers(step=8)
        self.k_pad = 0
        self.k_done = 0  # tokens [0, k_done) have their compressed |K|; later ones are read from the tail
        self.mu = self.alpha = self.centroids = None
        self.sink_positions = self.sink_rank = self.sink_keys = self.sink_values = None
        # R = diag(signs) x rot_base, set at the prefill: v_signs with v_rotate, k_signs with k_rotate (one tensor)
        self.v_signs = self.k_signs = self.rot_base = None
        #: fixed-shape decoding (`begin_fixed`): the device position [1] of the step's token, else None
        self.fixed_position: torch.Tensor | None = None

    @property
    def compressed(self) -> bool:
        return self.kv_bits < 16

    @property
    def channel_axis(self) -> bool:
        return self.compressed and self.k_axis == "channel"

    def storage_dtype(self, like: torch.Tensor) -> torch.dtype:
        return FP_DTYPES[self.fp_dtype] or like.dtype

    # --- rotation ---------------------------------------------------------------------------------------------

    def rotate_values(self, values: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """V [..., d] -> V R in `work` (V itself without v_rotate)."""
        v = values.to(work)
        if self.v_signs is None:
            return v
        return _times(v * self.v_signs.to(work), self.rot_base.to(work))

    def unrotate_values(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] in the stored V domain (an attention output, or rows of `compressed_kv.dequantized_rows`) ->
        x R^T, in the input's dtype, computed in the cache's work dtype (x itself without v_rotate)."""
        return self._unrotate(x, self.v_signs)

    def unrotate_keys(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] in the stored K domain -> x R^T in its dtype (x itself without k_rotate)."""
        return self._unrotate(x, self.k_signs)

    def _unrotate(self, x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
        if signs is None:
            return x
        return (_times(x.to(signs.dtype), self.rot_base.T) * signs).to(x.dtype)

    def rotate_keys(self, x: torch.Tensor) -> torch.Tensor:
        """k_rotate: keys or queries [..., d] -> x R in their dtype (computed in the work dtype); x itself without.
        q . k is unchanged, so attention is too; what changes is what the sign index and the |K| scales see."""
        if self.k_signs is None:
            return x
        work = self.k_signs.dtype
        return _times(x.to(work) * self.k_signs, self.rot_base).to(x.dtype)

    # --- writes -----------------------------------------------------------------------------------------------

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor | None,
                sinks: tuple[torch.Tensor, torch.Tensor] | None) -> None:  # fmt: skip
        """Builds mu/alpha/codebook and the sinks' 16-bit copies from the prompt (keys / values [B, Hkv, N, d] as
        the model gives them; sinks: `snap_sinks`'s (positions, rank) or None) and compresses it. `key_mask` [B, N]
        (False = padding) keeps left padding out of the statistics; without it every prompt position counts."""
        work = work_dtype(keys)
        b, _, n, d = keys.shape
        if self.v_rotate or self.k_rotate:  # built here, outside any CUDA graph capture of the decode steps
            signs = rotation_signs(d, self.layer_idx, work, keys.device)
            self.rot_base = rotation_base(d, work, keys.device)
            self.v_signs = signs if self.v_rotate else None
            self.k_signs = signs if self.k_rotate else None
        # a few sequences at a time: the float32 work tensors of the statistics are several times the prompt's bytes
        rotated = keys if self.k_signs is None else torch.empty_like(keys)
        stats = []
        for part in sequence_groups(b, keys[0].numel()):
            if self.k_signs is not None:
                rotated[part] = self.rotate_keys(keys[part])
            stats.append(_prompt_statistics(rotated[part], None if key_mask is None else key_mask[part]))
        keys = rotated
        self.mu, self.alpha, centroids = (torch.cat(parts) for parts in zip(*stats, strict=True))
        # stored at 16-bit (float64 runs keep float64 so that tests compare exactly)
        self.centroids = centroids if work == torch.float64 else centroids.to(torch.float16)
        if sinks is not None:
            positions, rank = sinks
            self.sink_positions, self.sink_rank = positions.to(torch.int32), rank.to(torch.int16)
            if self.compressed:
                idx = positions.clamp(max=n - 1)[..., None].expand(-1, -1, -1, d)
                fp = self.storage_dtype(keys)
                self.sink_keys = keys.gather(2, idx).to(fp)
                self.sink_values = self.rotate_values(values.gather(2, idx), work).to(fp)
        exclude = (
            None  # tokens left out of the channel-axis block scales: padding, and sinks (read at 16-bit)
        )
        if self.channel_axis:
            self.k_pad = (-n) % self.k_group
            exclude = torch.zeros(b, keys.shape[1], n + 1, dtype=torch.bool, device=keys.device)
            if self.sink_keys is not None:
                exclude.scatter_(-1, self.sink_positions.long().clamp(max=n), True)
            exclude = exclude[..., :n]
            if key_mask is not None:
                exclude = exclude | ~key_mask.bool()[:, None]
        self.rows.make_room(n)  # one allocation for every part
        if self.channel_axis:
            self.k_blocks.make_room((n + self.k_pad) // self.k_group)
        for start, end in self._prompt_slices(n):  # bounded work tensors, as `append`'s
            part = slice(start, end)
            self._append(keys[:, :, part], values[:, :, part], prompt=True,
                         exclude=None if exclude is None else exclude[..., part])  # fmt: skip
        self.decode_start = n
        self.tail_start = n

    def _prompt_slices(self, n: int) -> list[tuple[int, int]]:
        """The prompt's [start, end) parts of about APPEND_SLICE tokens that `prefill` compresses one at a time: on
        the channel axis each part ends where a K block does (the first block is the one short by k_pad)."""
        step = max(1, APPEND_SLICE // self.k_group) * self.k_group if self.channel_axis else APPEND_SLICE
        pad = self.k_pad if self.channel_axis else 0
        ends = [*range(step - pad, n, step), n]
        return list(zip([0, *ends[:-1]], ends, strict=True))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode tokens, or a later chunk of a prompt stored chunk by chunk (keys / values [B, Hkv, T, d] as the
        model gives them), with the prompt's statistics. A long chunk goes APPEND_SLICE tokens at a time (what
        appends of its parts write, exactly): its float32 work tensors, several times the chunk's own bytes, then
        stay small next to a cache that is nearly full by the prompt's last chunk."""
        if keys.shape[2] > APPEND_SLICE:
            self.rows.make_room(keys.shape[2])
            if self.channel_axis:
                self.k_blocks.make_room((self.rows.length + keys.shape[2] - self.k_done) // self.k_group)
        for start in range(0, max(1, keys.shape[2]), APPEND_SLICE):
            part = slice(start, start + APPEND_SLICE)
            self._append(self.rotate_keys(keys[:, :, part]), values[:, :, part])

    def crop(self, length: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rolls the store back to its first `length` tokens (decode tokens only), exactly: back to the last count
        at which a K block and a residual block both ended, where `append` leaves nothing half-built, then the
        tokens from there up to `length` appended again from keys / values [B, Hkv, >= length, d], the K/V as the
        model gave them (an `append` of a chunk writes what token-by-token appends write)."""
        if length < self.decode_start or self.fixed_position is not None:
            raise ConfigError(f"self-index rolls back decode tokens only, between fixed-shape steps (asked {length})")
        tail = self.compressed and self.residual > 0
        period = math.lcm(self.residual if tail else 1, self.k_group if self.channel_axis else 1)
        start = self.decode_start + (length - self.decode_start) // period * period
        self.rows.length = start
        if self.channel_axis:
            self.k_done = start
            self.k_blocks.length = (start + self.k_pad) // self.k_group
        if tail:
            self.tail, self.tail_start = RowBuffers(reserve=self.residual, step=self.residual), start
        if length > start:
            self.append(keys[:, :, start:length], values[:, :, start:length])
            self.trim_tail()

    def set_sinks(self, positions: torch.Tensor, rank: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The sinks of a prompt stored chunk by chunk, chosen once it ended: positions / rank [B, Hkv, S] as
        `snap_sinks` gives them, keys / values [B, Hkv, S, d] their 16-bit K/V as the model gave them."""
        self.sink_positions, self.sink_rank = positions.to(torch.int32), rank.to(torch.int16)
        if self.compressed:
            fp = self.storage_dtype(keys)
            self.sink_keys = self.rotate_keys(keys).to(fp)
            self.sink_values = self.rotate_values(values, work_dtype(keys)).to(fp)

    def trim_tail(self) -> None:
        """Drops the 16-bit copies of the blocks before the last token's (an `append` of many tokens keeps them
        all until the next one): after a prompt chunk, the tail holds one residual block, as after a decode step."""
        if self.compressed and self.residual > 0 and self.tail.length > 0:
            self._keep_last_block(self.rows.length)

    def _keep_last_block(self, length: int) -> None:
        """The tail keeps the residual block of token `length` - 1 only, as `append` leaves it."""
        last = length - 1
        block = max(self.tail_start, self.decode_start + (last - self.decode_start) // self.residual * self.residual)
        held = {name: self.tail.tensors[name][:, :, block - self.tail_start : length - self.tail_start].clone()
                for name in ("k", "v")}  # fmt: skip
        self.tail = RowBuffers(reserve=self.residual, step=self.residual)
        self.tail.append(**held)
        self.tail_start = block

    def _append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        prompt: bool = False,
        exclude: torch.Tensor | None = None,
    ) -> None:
        work = work_dtype(keys)
        parts, centred, rotated = self._token_rows(keys, values)
        channel = self.channel_axis
        if self.compressed and channel:  # filled in by _compress_k_blocks once the token's block is full
            b, h, t, d = keys.shape
            parts["k_mag"] = keys.new_zeros(b, h, t, d * self.k_bits // 8, dtype=torch.uint8)
        self.rows.append(**parts)
        if channel and prompt:
            self._compress_k_blocks(centred, self.rows.length - keys.shape[2], exclude)
            self.k_done = self.rows.length
        elif channel:
            # the blocks completed by these tokens, from the 16-bit copies (the tail holds every token from
            # k_done on; new tokens are rounded to the tail's dtype first, so chunked == token-by-token)
            new = keys.to(self.storage_dtype(keys)).to(work) - self.mu
            held = self.k_done - self.tail_start
            if self.tail.length > held:
                new = torch.cat([self.tail.view("k")[:, :, held:].to(work) - self.mu, new], dim=2)
            count = new.shape[2] // self.k_group * self.k_group
            if count:
                self._compress_k_blocks(new[:, :, :count], self.k_done)
                self.k_done += count
        if prompt or not self.compressed or self.residual == 0:
            return
        # 16-bit copy of the decode tokens from the block of the first new token on (older blocks are full)
        first = self.rows.length - keys.shape[2]
        block = self.decode_start + (first - self.decode_start) // self.residual * self.residual
        if block > self.tail_start:
            kept = self.tail.length - (block - self.tail_start)
            old = {name: self.tail.view(name)[:, :, -kept:] if kept > 0 else None for name in ("k", "v")}
            self.tail = RowBuffers(reserve=self.residual, step=self.residual)
            if old["k"] is not None:
                self.tail.append(k=old["k"], v=old["v"])
            self.tail_start = block
        fp = self.storage_dtype(keys)
        self.tail.append(k=keys.to(fp), v=values.to(fp) if self.v_signs is None else rotated.to(fp))

    def _token_rows(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The stored rows of tokens (keys already rotated, [B, Hkv, T, d]) with the prompt's statistics: sign bits,
        V codes with their scales, the |K| codes on the token axis (the channel axis writes them per block), or
        kv_bits=16's full K/V. Also K - mu and V (v_rotate: V R), both in the work dtype."""
        work = work_dtype(keys)
        centred = keys.to(work) - self.mu
        rotated = self.rotate_values(values, work)
        rows = {"sign_bits": pack_sign_bits(centred)}
        if self.compressed:
            if not self.channel_axis:  # the paper's layout with k_zero: asymmetric, scale and zero per k_group channels
                mag, mag_scale, mag_zero = quantize(
                    centred.abs() / self.alpha, self.k_bits, self.k_group, with_zero=self.k_zero
                )
                rows.update(k_mag=mag, k_scale=mag_scale)
                if self.k_zero:
                    rows.update(k_zero=mag_zero)
            val, val_scale, val_zero = quantize(rotated, self.kv_bits, self.v_group, clip=self.v_clip)
            rows.update(v=val, v_scale=val_scale, v_zero=val_zero)
        else:
            rows.update(k_full=keys, v_full=values if self.v_signs is None else rotated.to(values.dtype))
        return rows, centred, rotated

    def _compress_k_blocks(
        self, centred: torch.Tensor, start: int, exclude: torch.Tensor | None = None
    ) -> None:
        """k_axis="channel": |K - mu| / alpha of the tokens [start, start + T) (centred [B, H, T, d]; full blocks,
        except that the prompt's first block may be short) -> one fp16 scale per channel and block (scale rows
        appended to k_blocks) and per-token codes (written into the rows' k_mag). `exclude` [B, H, T] tokens
        (padding, 16-bit sinks) do not count towards their block's scales (their codes are never read)."""
        g = self.k_group
        x = centred.abs() / self.alpha
        if exclude is not None:
            x = x.masked_fill(exclude[..., None], 0)
        pad = (-x.shape[2]) % g  # only the prompt's first block can be short: pad it at the front
        if pad:
            x = F.pad(x, (0, 0, pad, 0))
        b, h, t, d = x.shape
        blocks = x.view(b, h, t // g, g, d).transpose(-1, -2)  # [B, H, NB, d, G]
        codes, scale, _ = quantize_codes(blocks, self.k_bits, g, with_zero=False)  # scale [B, H, NB, d, 1]
        codes = codes.transpose(-1, -2).reshape(b, h, t, d)[:, :, pad:]
        self.rows.tensors["k_mag"][:, :, start : start + t - pad] = pack_bits(codes, self.k_bits)
        self.k_blocks.append(k_scale=scale.squeeze(-1))

    # --- fixed-shape decoding ---------------------------------------------------------------------------------

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` tokens is made once, at the next write, with `begin_fixed`'s slack: neither later
        appends nor fixed-shape decoding up to that length copy the rows into larger buffers."""
        self.rows.reserve = capacity + (self.k_group if self.channel_axis else 0) if capacity else 0

    def begin_fixed(self, capacity: int) -> None:
        """Fixed-shape decoding up to `capacity` tokens: every buffer gets its room once, views show all of it
        (unwritten rows are zeros, masked by the step's visibility), and `append_fixed` writes at a device
        position. The 16-bit tail then holds every token from its current start on (it is not cut back at each
        residual block, which would be a host decision), so reads find a query's block at the same offsets."""
        slack = self.k_group if self.channel_axis else 0  # whole K blocks are rewritten (`_open_block`)
        self.rows.fix(capacity, slack)
        if self.compressed and self.residual > 0:
            self.tail.fix(capacity - self.tail_start, slack)
        if self.channel_axis:
            self.k_blocks.fix((capacity + self.k_pad) // self.k_group + 1)

    def append_fixed(
        self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, compiled: bool = False
    ) -> None:
        """`append` of one token (keys / values [B, Hkv, 1, d] as the model gives them) at the device position
        [1]: the same rows as `append` writes, from device values only (a CUDA graph replays it). `compiled`:
        the encoding and its writes run through torch.compile as one graph (a few fused kernels that store the rows
        where they go, instead of dozens of small kernels and a copy launch per row tensor)."""
        self.fixed_position = position
        if compiled:
            check_compiled_device(keys.device)
        maybe_compiled(CompressedStore._write_token, compiled)(self, keys, values, position)

    def _write_token(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """`append_fixed`'s encoding and writes: the token's rows and tail copy at `position`, and the open K
        block's codes and scales (k_axis="channel")."""
        rows, tail = self._encode_token(keys, values)
        self.rows.write(position, **rows)
        if tail:
            self.tail.write(position - self.tail_start, **tail)
        if self.channel_axis:
            slots, block_row, k_mag, k_scale = self._open_block(position)
            self.rows.write(slots, k_mag=k_mag)
            self.k_blocks.write(block_row, k_scale=k_scale)

    def _encode_token(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One token's stored rows (sign bits, |K| and V codes with their scales, or kv_bits=16's full K/V) and its
        16-bit tail copy (empty without a tail), computed as `_append` computes them."""
        keys = self.rotate_keys(keys)
        rows, _, rotated = self._token_rows(keys, values)
        tail = {}
        if self.compressed and self.residual > 0:
            fp = self.storage_dtype(keys)
            tail = {"k": keys.to(fp), "v": (values if self.v_signs is None else rotated).to(fp)}
        return rows, tail

    def _open_block(self, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """k_axis="channel" in fixed-shape steps: the K block holding `position` is (re)compressed from the 16-bit
        tail at every step, its unwritten tokens counting as 0. Once its last token is in, the codes and scales are
        `_compress_k_blocks`'s; before that nobody reads them (the open block lies inside the query's residual
        block, which is read from the tail). Returns the block's slots [G], its scale row [1], the packed codes
        [B, H, G, c] and the scales [B, H, 1, d]."""
        g = self.k_group
        first = self.decode_start + (position - self.decode_start) // g * g  # [1]
        slots = first + torch.arange(g, device=position.device)
        work = self.mu.dtype
        block = self.tail.tensors["k"].index_select(2, slots - self.tail_start).to(work)
        x = ((block - self.mu).abs() / self.alpha).masked_fill((slots > position)[:, None], 0)  # [B, H, G, d]
        b, h, _, d = x.shape
        codes, scale, _ = quantize_codes(x.transpose(-1, -2).unsqueeze(2), self.k_bits, g, with_zero=False)
        k_mag = pack_bits(codes.squeeze(2).transpose(-1, -2), self.k_bits)
        return slots, (first + self.k_pad) // g, k_mag, scale.view(b, h, 1, d)

    def end_fixed(self, length: int) -> None:
        """Fixed-shape decoding ended with `length` tokens written: the host state `append` continues from."""
        self.fixed_position = None
        self.rows.unfix(length)
        if self.channel_axis:
            self.k_done = self.decode_start + (length - self.decode_start) // self.k_group * self.k_group
            self.k_blocks.unfix((self.k_done + self.k_pad) // self.k_group)
        if self.compressed and self.residual > 0:
            self._keep_last_block(length)

    def query_positions(self, q_len: int, device: torch.device) -> torch.Tensor:
        """[Q] positions of a step's queries: the last `q_len` tokens, or the device position of a fixed-shape
        step."""
        if self.fixed_position is not None:
            return self.fixed_position
        n = self.rows.length
        return torch.arange(n - q_len, n, device=device)

    # --- reads ------------------------------------------------------------------------------------------------

    def tail_from(self, positions: torch.Tensor) -> torch.Tensor:
        """[Q]: the first token that the queries at `positions` [Q] read from the 16-bit tail (their residual
        block, within the tail); past every token without a residual block."""
        if self.residual <= 0:
            return torch.full_like(positions, self.rows.view_length)
        block = self.decode_start + (positions - self.decode_start) // self.residual * self.residual
        return block.clamp(min=self.tail_start)

    def per_head(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """t [B, Hkv, ...] repeated for `heads` rows (kv heads, or query heads for rows of their own)."""
        rep = heads // self.num_kv_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t

    def gather(self, buffers: RowBuffers, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` [B, S, Q, K] of buffers[name] [B, Hkv, N, c] (S = kv heads or query heads) ->
        [B, S, Q, K, c]."""
        b, s, q, k = indices.shape
        src = self.per_head(buffers.view(name), s)
        flat = indices.reshape(b, s, q * k, 1).expand(-1, -1, -1, src.shape[-1])
        return src.gather(2, flat).view(b, s, q, k, src.shape[-1])

    def row(self, index: int) -> CompressedStore:
        """A read-only view of one sequence (batch row `index`): every per-sequence tensor sliced to [1, ...]."""
        view = copy.copy(self)
        for buffers in ("rows", "tail", "k_blocks"):
            setattr(view, buffers, getattr(self, buffers).row(index))
        for name in ("mu", "alpha", "centroids", "sink_positions", "sink_rank", "sink_keys", "sink_values"):
            value = getattr(self, name)
            setattr(view, name, None if value is None else value[index : index + 1])
        return view

    def read_all_into(self, keys: torch.Tensor, values: torch.Tensor, slice_tokens: int = 4096) -> None:
        """Every stored token's K and V as the model gave them (un-rotated, mu added back; compressed rows
        dequantized, sinks and the last token's residual block from their 16-bit copies) written into keys /
        values [B, Hkv, N, d] (N = the tokens stored), `slice_tokens` at a time so that the work-dtype
        intermediates stay small: what the later chunks of a prompt stored chunk by chunk attend over."""
        b, h, n, _ = keys.shape
        if n != self.rows.length:
            raise ValueError(f"read_all_into: {n} rows asked, {self.rows.length} stored")
        tail_from = self.tail_from(torch.tensor([n - 1], device=keys.device))
        view = self.kernel_view() if self.compressed else None
        for lo in range(0, n, slice_tokens):
            hi = min(n, lo + slice_tokens)
            if view is not None:
                index = torch.arange(lo, hi, device=keys.device)[None, None, None].expand(b, h, 1, -1)
                k, v = dequantized_rows(view, index, tail_from)
                k, v = k[:, :, 0], v[:, :, 0]
            else:
                k, v = self.rows.view("k_full")[:, :, lo:hi], self.rows.view("v_full")[:, :, lo:hi]
            keys[:, :, lo:hi] = self.unrotate_keys(k).to(keys.dtype)
            values[:, :, lo:hi] = self.unrotate_values(v).to(values.dtype)

    def kernel_view(self) -> CompressedKV:
        """The stored bytes as `kernels.compressed_kv` reads them (compressed rows, float32 statistics)."""
        channel = self.k_axis == "channel"
        tail = self.residual > 0 and self.tail.view_length > 0
        return CompressedKV(
            sign_bits=self.rows.view("sign_bits"),
            k_mag=self.rows.view("k_mag"),
            k_scale=self.k_blocks.view("k_scale") if channel else self.rows.view("k_scale"),
            k_zero=self.rows.view("k_zero") if self.k_zero else None,
            v=self.rows.view("v"),
            v_scale=self.rows.view("v_scale"),
            v_zero=self.rows.view("v_zero"),
            mu=self.mu,
            alpha=self.alpha,
            k_bits=self.k_bits,
            v_bits=self.kv_bits,
            k_scale_tokens=self.k_group if channel else 1,
            k_scale_offset=self.k_pad if channel else 0,
            sink_positions=self.sink_positions,
            sink_keys=self.sink_keys,
            sink_values=self.sink_values,
            tail_keys=self.tail.view("k") if tail else None,
            tail_values=self.tail.view("v") if tail else None,
            tail_first=self.tail_start,
        )

    # --- memory -----------------------------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds (buffer capacity included), by component."""
        rows = self.rows.nbytes()
        return {
            "sign_bits": rows.get("sign_bits", 0),
            "k_quant": rows.get("k_mag", 0),
            "k_scale_zero": rows.get("k_scale", 0)
            + rows.get("k_zero", 0)
            + sum(self.k_blocks.nbytes().values()),
            "v_quant": rows.get("v", 0),
            "v_scale_zero": rows.get("v_scale", 0) + rows.get("v_zero", 0),
            "kv_full": rows.get("k_full", 0) + rows.get("v_full", 0),
            "sinks_fp": tensor_nbytes(self.sink_keys) + tensor_nbytes(self.sink_values),
            "sink_positions": tensor_nbytes(self.sink_positions) + tensor_nbytes(self.sink_rank),
            "residual_fp": sum(self.tail.nbytes().values()),
            "codebook": tensor_nbytes(self.centroids),
            "mu_alpha": tensor_nbytes(self.mu) + tensor_nbytes(self.alpha),
            # v_rotate / k_rotate: the layer's d signs (one tensor for both); the [d, d] base (rotation_base) is
            # one constant shared by every layer
            "rotation": tensor_nbytes(self.v_signs if self.v_signs is not None else self.k_signs),
        }
