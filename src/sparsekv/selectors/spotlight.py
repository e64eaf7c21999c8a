"""Spotlight Attention: a learned (MLP) hash of post-RoPE queries and keys, Hamming top-k.

Per sparse layer and kv head, a hash maps a vector x (query or key, d dims) to `bits` signs:

    mlp:     code(x) = sign(W · x̂ + W2 · SiLU(W1 · x̂ + b1))   d -> hidden (default d) -> bits
    linear:  code(x) = sign(W · x̂)                            d -> bits (trainable angular LSH)

W starts as stacked random rotations (angular LSH, Spotlight appendix A.5) and W2 at zero, so an untrained MLP
hash *is* angular LSH and training learns the non-linear residual on top of it (the authors' code also adds a
residual to the paper's W2·SiLU(W1·x + b1); a pure N(0, 1e-3) MLP starts from chance and needs far more steps
than a CPU budget allows).

with x̂ = (x - mean) / scale a fixed per-head normalisation measured on calibration text (keys are centred,
which never changes a query's ranking of keys; queries are only scaled). Query heads use the hash of their kv
head. Keys are hashed once (prefill, then on append) and kept as packed int32 codes; a query's score for a key
is the number of matching bits (XNOR + popcount), summed over the query heads of a kv head for gqa="group",
per query head for gqa="head". Ties go to the more recent key.

Which hash a layer uses (option `checkpoint`):

- ``"auto"`` (default): the checkpoint shipped in ``sparsekv/data`` for the model's shape (the embedded models:
  SmolLM2-135M, 30 layers, 9/3 heads, head_dim 64; Gemma 3 270M, 18 layers, 4/1 heads, head_dim 256, its
  three global layers); for any other shape an *untrained* MLP hash
  initialised from `seed`, which is angular LSH with 128 bits (no key centring: that needs calibration). That
  keeps spotlight usable on every model without a warning, at LSH quality; for the learned quality train one with
  ``sparsekv train-hash --model <model> --output hash.safetensors`` and pass ``checkpoint=hash.safetensors``.
- ``"none"``: always the untrained hash (a baseline).
- a path to a ``.safetensors`` file written by ``sparsekv train-hash``: it must match the model (layer count,
  heads, head_dim at construction; the full fingerprint, a hash of the weights included, in
  ``check_model(model, config)``), otherwise one ConfigError says so.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.hamming import hamming_scores
from sparsekv.selectors.base import (
    RowBuffer,
    TokenSelector,
    fixed_hamming_selection,
    fixed_int_topk_selection,
    fused_hamming_selection,
    int_topk_selection,
)
from sparsekv.step import DecodeStep, LayerInfo, Selection

HASH_KINDS = ("mlp", "linear")
DEFAULT_BITS = 128
FORMAT = "sparsekv-spotlight"
FORMAT_VERSION = 1
METADATA_KEY = "sparsekv"
#: the checkpoints shipped for the embedded models (`checkpoint="auto"` picks the one of the model's shape)
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_CHECKPOINT = DATA_DIR / "spotlight-smollm2-135m.safetensors"  # the default model's


def shipped_checkpoint(layer: LayerInfo) -> tuple[Path, dict] | None:
    """The shipped checkpoint (and its header) made for a model of `layer`'s shape, None when none is."""
    for path in sorted(DATA_DIR.glob("spotlight-*.safetensors")):
        header = read_header(path)
        if shape_mismatch(header["fingerprint"], layer) is None:
            return path, header
    return None


def softsign(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """Differentiable stand-in for sign during training: γx / (1 + γ|x|)."""
    return gamma * x / (1 + gamma * x.abs())


class LayerHash(nn.Module):
    """The hash functions of one layer: one per kv head, evaluated for all heads at once.

    forward(x [..., H, T, d], role) -> [..., H, T, bits] real outputs whose signs are the code bits; `role`
    ("q" or "k") picks the normalisation. Query heads are mapped to their kv head by the caller.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        bits: int = DEFAULT_BITS,
        kind: str = "mlp",
        hidden: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if kind not in HASH_KINDS:
            raise ConfigError(f"hash must be one of {', '.join(HASH_KINDS)}, got {kind!r}")
        if not isinstance(bits, int) or bits < 1:
            raise ConfigError(f"bits must be a positive int, got {bits!r}")
        self.kind, self.bits, self.num_heads, self.head_dim = kind, bits, num_heads, head_dim
        self.hidden = (hidden or head_dim) if kind == "mlp" else None
        h, d = num_heads, head_dim
        # the linear part: angular LSH hyperplanes (random rotations); the MLP adds a residual branch to it
        self.w = nn.Parameter(random_rotations(h, d, bits, generator))
        if kind == "mlp":
            self.w1 = nn.Parameter(torch.randn(h, d, self.hidden, generator=generator) * d**-0.5)
            self.b1 = nn.Parameter(torch.zeros(h, self.hidden))
            # zero-initialised last layer: the untrained MLP hash is exactly the angular LSH above
            self.w2 = nn.Parameter(torch.zeros(h, self.hidden, bits))
        # calibration normalisation (identity until set_normalisation)
        self.register_buffer("key_mean", torch.zeros(h, d))
        self.register_buffer("key_scale", torch.ones(h))
        self.register_buffer("query_scale", torch.ones(h))

    def set_normalisation(
        self, key_mean: torch.Tensor, key_scale: torch.Tensor, query_scale: torch.Tensor
    ) -> None:
        self.key_mean.copy_(key_mean)
        self.key_scale.copy_(key_scale)
        self.query_scale.copy_(query_scale)

    def normalise(self, x: torch.Tensor, role: str) -> torch.Tensor:
        if role == "k":
            return (x - self.key_mean[:, None, :]) / self.key_scale[:, None, None]
        if role == "q":
            return x / self.query_scale[:, None, None]
        raise ValueError(f"role must be 'q' or 'k', got {role!r}")

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:
        x = self.normalise(x.to(self.key_mean.dtype), role)
        out = torch.einsum("...htd,hdb->...htb", x, self.w)
        if self.kind == "linear":
            return out
        hidden = torch.einsum("...htd,hde->...hte", x, self.w1) + self.b1[:, None, :]
        return out + torch.einsum("...hte,heb->...htb", nn.functional.silu(hidden), self.w2)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.state_dict().items()}

    def select_heads(self, heads: slice) -> LayerHash:
        """The hash functions of kv heads `heads` only (under tensor parallelism: this rank's share)."""
        state = {name: tensor[heads] for name, tensor in self.state_tensors().items()}
        count = next(iter(state.values())).shape[0]
        part = LayerHash(count, self.head_dim, self.bits, self.kind, self.hidden)
        part.load_state_dict(state)
        return part.requires_grad_(False)


def random_rotations(heads: int, dim: int, bits: int, generator: torch.Generator | None) -> torch.Tensor:
    """[heads, dim, bits]: columns of random rotations (QR of a Gaussian, det fixed to +1), enough blocks of
    `dim` columns to give `bits` hyperplanes: angular LSH as in Spotlight's appendix A.5."""
    out = torch.empty(heads, dim, bits)
    for h in range(heads):
        blocks = []
        for _ in range(math.ceil(bits / dim)):
            q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
            q = q * torch.sign(torch.diagonal(r))  # unique QR (Haar-distributed q)
            if torch.linalg.det(q) < 0:
                q[:, 0] = -q[:, 0]
            blocks.append(q)
        out[h] = torch.cat(blocks, dim=1)[:, :bits].float()
    return out


# ---------------------------------------------------------------------------------------------------------------
# checkpoints (safetensors + a JSON header in the metadata)


@dataclass
class HashCheckpoint:
    """A trained set of layer hashes and the metadata of the file."""

    header: dict
    layers: dict[int, LayerHash]
    path: str | None = None

    @property
    def fingerprint(self) -> dict:
        return self.header["fingerprint"]

    def describe(self) -> str:
        return self.path or "spotlight checkpoint"


def save_checkpoint(
    path: str | Path,
    layers: dict[int, LayerHash],
    fingerprint: dict,
    training: dict,
    metrics: dict | None = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Writes a spotlight checkpoint (weights stored in `dtype`, normalisation in float32)."""
    from safetensors.torch import save_file

    if not layers:
        raise ValueError("no layers to save")
    first = next(iter(layers.values()))
    tensors = {}
    for idx, layer_hash in sorted(layers.items()):
        for name, tensor in layer_hash.state_tensors().items():
            keep = torch.float32 if name.startswith(("key", "query")) else dtype
            tensors[f"layers.{idx}.{name}"] = tensor.to("cpu", keep).contiguous()
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "hash": first.kind,
        "bits": first.bits,
        "hidden": first.hidden,
        "layers": sorted(layers),
        "fingerprint": fingerprint,
        "training": training,
        "metrics": metrics or {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
    os.replace(tmp, path)
    return path


def read_header(path: str | Path) -> dict:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"spotlight checkpoint {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except Exception as error:  # noqa: BLE001 - any parse failure is the same user problem
        raise ConfigError(f"{str(path)!r} is not a readable safetensors file ({error})") from None
    try:
        header = json.loads(meta[METADATA_KEY])
    except (KeyError, json.JSONDecodeError):
        raise ConfigError(
            f"{str(path)!r} is not a spotlight checkpoint (no '{METADATA_KEY}' header)"
        ) from None
    if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{str(path)!r} has format {header.get('format')!r} v{header.get('version')}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    return header


_LOADED: dict[tuple, HashCheckpoint] = {}


def load_checkpoint(path: str | Path) -> HashCheckpoint:
    """Reads a checkpoint (cached per file path, size and mtime); weights come back as float32."""
    from safetensors.torch import load_file

    path = Path(path).resolve()
    header = read_header(path)
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key in _LOADED:
        return _LOADED[key]
    tensors = load_file(str(path))
    fp = header["fingerprint"]
    layers = {}
    for idx in header["layers"]:
        layer_hash = LayerHash(
            fp["num_kv_heads"], fp["head_dim"], header["bits"], header["hash"], header["hidden"]
        )
        prefix = f"layers.{idx}."
        state = {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
        layer_hash.load_state_dict(state)
        layer_hash.requires_grad_(False)
        layers[int(idx)] = layer_hash
    _LOADED[key] = HashCheckpoint(header, layers, str(path))
    return _LOADED[key]


SHAPE_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim")


def shape_mismatch(fingerprint: dict, layer: LayerInfo) -> str | None:
    actual = {  # the model's shape: under tensor parallelism `layer` holds one share of its heads
        "num_layers": layer.num_layers,
        "num_heads": layer.num_heads * layer.shards,
        "num_kv_heads": layer.num_kv_heads * layer.shards,
        "head_dim": layer.head_dim,
    }
    diff = [
        f"{k}: file {fingerprint.get(k)!r} vs model {v!r}"
        for k, v in actual.items()
        if fingerprint.get(k) != v
    ]
    return ", ".join(diff) or None


def untrained_hash(layer: LayerInfo, bits: int, kind: str, seed: int) -> LayerHash:
    """The deterministic untrained hash of a layer (seeded per layer; drawn for all of the model's kv heads, so that
    a rank of a tensor-parallel model uses its own heads' hashes)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + layer.layer_idx)
    whole = LayerHash(layer.num_kv_heads * layer.shards, layer.head_dim, bits, kind, generator=generator)
    whole.requires_grad_(False)
    return whole if layer.shards == 1 else whole.select_heads(layer.kv_heads)


# ---------------------------------------------------------------------------------------------------------------
# the selector


@dataclass
class SpotlightSelector(TokenSelector):
    """Spotlight Attention (learned MLP hash + Hamming top-k). Options:

    checkpoint: "auto" (the shipped checkpoint of the model's shape, else an untrained seeded hash),
        "none" (untrained hash) or a path written by `sparsekv train-hash`.
    bits / hash: code length and hash kind of the untrained hash; with a checkpoint they are read from it
        (a different explicit value is a ConfigError).
    seed: seed of the untrained hash.
    """

    name = "spotlight"
    fixed_shape = True
    slot_state = True
    #: the dense fallback's default (H200, Llama-3-8B shapes, B4, budget 2%: at 64K cached tokens over the
    #: batch 0.93x, at 128K 1.21x)
    dense_below = 98_304
    checkpoint: str = "auto"
    bits: int | None = None
    hash: str | None = None
    seed: int = 0

    @classmethod
    def check_config(cls, config: SparseConfig) -> None:
        opts = config.options
        bits = opts.get("bits")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or bits < 1):
            raise ConfigError(f"spotlight option bits must be a positive int, got {bits!r}")
        kind = opts.get("hash")
        if kind is not None and kind not in HASH_KINDS:
            raise ConfigError(f"spotlight option hash must be one of {', '.join(HASH_KINDS)}, got {kind!r}")
        seed = opts.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"spotlight option seed must be an int, got {seed!r}")
        ckpt = opts.get("checkpoint", "auto")
        if not isinstance(ckpt, str) or not ckpt:
            raise ConfigError(f"spotlight option checkpoint must be 'auto', 'none' or a path, got {ckpt!r}")
        if ckpt not in ("auto", "none"):
            header = read_header(ckpt)
            cls._check_header_options(header, bits, kind, ckpt)

    @staticmethod
    def _check_header_options(header: dict, bits, kind, where: str) -> None:
        if bits is not None and bits != header["bits"]:
            raise ConfigError(
                f"spotlight bits={bits} but checkpoint {where!r} has {header['bits']}-bit codes"
            )
        if kind is not None and kind != header["hash"]:
            raise ConfigError(
                f"spotlight hash={kind!r} but checkpoint {where!r} holds a {header['hash']!r} hash"
            )

    @classmethod
    def check_model(cls, model, config: SparseConfig) -> None:
        """Full check of an explicit checkpoint against a model (weights hash included): one ConfigError."""
        from sparsekv.fingerprint import check_fingerprint

        ckpt = config.options.get("checkpoint", "auto")
        if ckpt not in ("auto", "none"):
            check_fingerprint(read_header(ckpt)["fingerprint"], model, f"spotlight checkpoint {ckpt!r}")

    def __post_init__(self) -> None:
        self.threshold_hints = RowBuffer()
        self.hash_fn = copy.deepcopy(
            resolve_hash(self.layer, self.checkpoint, self.bits, self.hash, self.seed)
        )
        self.code_bits = self.hash_fn.bits
        self._codes: torch.Tensor | None = None
        self._length = 0
        self._folded: dict = {}
        # a decode step's new keys whose codes the query hash of the same step writes (one launch for both), and
        # in a fixed-shape step their slots (a device tensor)
        self._pending: torch.Tensor | None = None
        self._pending_slots: torch.Tensor | None = None

    # state ---------------------------------------------------------------------------------------------------
    def _hash(self, x: torch.Tensor, role: str) -> torch.Tensor:
        """x [B, H, T, d] (H = kv heads, or query heads for role 'q') -> packed codes [B, H, T, W]."""
        if x.is_cuda and x.dtype != torch.float64 and (folded := self._folded_weights(role, x.device)):
            from sparsekv.kernels.sign_hash import sign_hash

            return sign_hash(x, *folded)  # one kernel: normalise, MLP + linear branch, sign, pack
        fn = self.hash_fn
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if fn.key_mean.device != x.device or fn.key_mean.dtype != dtype:
            fn.to(device=x.device, dtype=dtype)
        b, h, t, d = x.shape
        group = h // self.layer.num_kv_heads  # query head i uses the hash of kv head i // group
        with torch.no_grad():
            out = fn(x.reshape(b, self.layer.num_kv_heads, group * t, d), role)
        return pack_sign_bits(out).reshape(b, h, t, -1)

    def _kernel_shapes(self) -> bool:
        """The hash's sizes fit the fused kernels' tiles (tl.arange / tl.dot: powers of two, at least 16)."""
        fn = self.hash_fn
        return all(n >= 16 and n & (n - 1) == 0 for n in (fn.head_dim, fn.hidden or fn.bits, fn.bits))

    def _folded_weights(self, role: str, device: torch.device) -> tuple | None:
        """The hash with its normalisation folded into the weights, as `sign_hash` arguments (float32 on
        `device`): (x - m) / s through W1, b1, W2, W becomes x through W1 / s, b1 - (m / s) W1, W2, W / s plus the
        output bias -(m / s) W. None where the fused kernel's tile constraints do not hold."""
        key = (role, device)
        if key not in self._folded:
            fn = self.hash_fn
            if not self._kernel_shapes():
                self._folded[key] = None
                return None
            with torch.no_grad():
                scale = (fn.key_scale if role == "k" else fn.query_scale).float().cpu()
                mean = (
                    fn.key_mean.float().cpu() if role == "k" else torch.zeros_like(fn.key_mean.float().cpu())
                )
                shift = mean / scale[:, None]  # [H, d]
                w = fn.w.float().cpu() / scale[:, None, None]
                out_bias = -torch.einsum("hd,hdb->hb", shift, fn.w.float().cpu())
                b2 = out_bias if role == "k" else None
                if fn.kind == "linear":
                    args = (w, None, None, None, b2)
                else:
                    w1 = fn.w1.float().cpu() / scale[:, None, None]
                    b1 = fn.b1.float().cpu() - torch.einsum("hd,hde->he", shift, fn.w1.float().cpu())
                    args = (w1, fn.w2.float().cpu(), b1, w, b2)
            self._folded[key] = tuple(None if t is None else t.to(device).contiguous() for t in args)
        return self._folded[key]

    def _pair_weights(self, device: torch.device) -> tuple | None:
        """`sign_hash_pair`'s hash arguments (float32 on `device`): key mean, key scale, query scale, W1, W2,
        b1, W; None where the fused kernels' tile constraints do not hold."""
        key = ("pair", device)
        if key not in self._folded:
            fn = self.hash_fn
            if not self._kernel_shapes():
                self._folded[key] = None
                return None
            hash_args = (fn.w, None, None, None) if fn.kind == "linear" else (fn.w1, fn.w2, fn.b1, fn.w)
            self._folded[key] = tuple(
                None if t is None else t.detach().to(device, torch.float32).contiguous()
                for t in (fn.key_mean, fn.key_scale, fn.query_scale, *hash_args)
            )
        return self._folded[key]

    def _defers(self, keys: torch.Tensor) -> bool:
        """Whether the new keys' codes can wait for the step's query hash: a decode step on the GPU."""
        from sparsekv.kernels.sign_hash import PAIR_MAX_ROWS

        rows = (self.layer.group_size + 1) * keys.shape[-2]  # the group's queries (one per new token) + the keys
        return (
            keys.is_cuda
            and keys.dtype != torch.float64
            and rows <= PAIR_MAX_ROWS
            and self._pair_weights(keys.device) is not None
        )

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        self._codes, self._length, self._pending, self._pending_slots = None, 0, None, None
        self.append(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._hash_pending()
        b, h, t, _ = keys.shape
        needed = self._length + t
        if self._codes is None or needed > self._codes.shape[-2]:
            words = (self.code_bits + 31) // 32  # pack_sign_bits' words
            # capacity in multiples of 64 keys: the scorer's 16-byte code loads need a row stride that Triton
            # sees as a multiple of 16 words (H200, 128K x B8: 73.5 us at a stride of 2**17 + 5 keys, 48.6 us
            # at 2**17 + 64)
            capacity = -(-max(needed, 2 * self._length) // 64) * 64
            grown = torch.empty(b, h, capacity, words, dtype=torch.int32, device=keys.device)
            if self._codes is not None:
                grown[..., : self._length, :] = self._codes[..., : self._length, :]
            self._codes = grown
        if self._defers(keys):
            self._pending = keys
        else:
            self._codes[..., self._length : needed, :] = self._hash(keys, "k")
        self._length = needed

    def crop(self, length: int) -> None:
        self._hash_pending()
        self._length = min(self._length, length)

    def begin_fixed_shape(self, capacity: int) -> None:
        self._hash_pending()
        if self._codes.shape[-2] < capacity:
            grown = self._codes.new_zeros(*self._codes.shape[:-2], capacity, self._codes.shape[-1])
            grown[..., : self._length, :] = self._codes[..., : self._length, :]
            self._codes = grown

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        if self._defers(keys):
            self._pending, self._pending_slots = keys, position
        else:
            self._codes.index_copy_(-2, position, self._hash(keys, "k"))

    def end_fixed_shape(self, length: int) -> None:
        self._hash_pending()
        self._length = length

    def complete_append(self) -> None:
        self._hash_pending()

    def _hash_pending(self) -> None:
        if self._pending is None:
            return
        codes = self._hash(self._pending, "k")
        if self._pending_slots is not None:
            self._codes.index_copy_(-2, self._pending_slots, codes)
        else:
            t = self._pending.shape[-2]
            self._codes[..., self._length - t : self._length, :] = codes
        self._pending = self._pending_slots = None

    def _query_codes(self, query: torch.Tensor) -> torch.Tensor:
        """The step's query codes; deferred new keys are hashed in the same launch, into their slots."""
        if self._pending is None:
            return self._hash(query, "q")
        from sparsekv.kernels.sign_hash import sign_hash_pair

        weights = self._pair_weights(query.device)
        if self._pending_slots is not None:  # fixed shape: the slots are a device position
            codes = sign_hash_pair(query, self._pending, self._codes, *weights, key_slots=self._pending_slots)
        else:
            t = self._pending.shape[-2]
            slots = self._codes[..., self._length - t : self._length, :]
            codes = sign_hash_pair(query, self._pending, slots, *weights)
        self._pending = self._pending_slots = None
        return codes

    @property
    def key_codes(self) -> torch.Tensor:
        self._hash_pending()
        return self._codes[..., : self._length, :]

    # selection -----------------------------------------------------------------------------------------------
    def score(self, step: DecodeStep) -> torch.Tensor:
        """[B, S, Q, N] int32 matching bits (S = kv heads for gqa 'group', query heads for 'head')."""
        query_codes = self._hash(step.query, "q")  # [B, Hq, Q, W]
        self._hash_pending()
        keys = self._codes[..., : step.keys.shape[-2], :]
        if step.gqa == "head" and self.layer.group_size > 1:
            keys = keys.repeat_interleave(self.layer.group_size, dim=1)
        return hamming_scores(query_codes, keys, bits=self.code_bits)

    def select(self, step: DecodeStep) -> Selection:
        # deferred new keys: their codes are written by `_query_codes`, which runs before the scorer
        keys = self._codes[..., : step.keys.shape[-2], :]
        query_codes = lambda: self._query_codes(step.query)  # hashed only when the fast path runs
        fast = fixed_hamming_selection(query_codes, keys, self.code_bits, step, self.threshold_hints)
        if fast is not None:
            return fast
        fast = fused_hamming_selection(query_codes, keys, self.code_bits, step, self.threshold_hints)
        if fast is not None:
            return fast
        group = self.layer.group_size if step.gqa == "group" else 1
        value_range = (0, group * self.code_bits)
        scores = self.score(step)
        fixed = step.hints is not None and step.hints.fixed
        if fixed and (selection := fixed_int_topk_selection(scores, step, value_range)) is not None:
            return selection
        return hamming_topk(scores, step, value_range=value_range)


def hamming_topk(
    scores: torch.Tensor, step: DecodeStep, value_range: tuple[int, int] | None = None
) -> Selection:
    """Top-budget keys per row by integer score, ties to the more recent key, forced tokens first.

    Ranks on one int64 key per token (score above, position below), so every key is distinct and the chosen
    set never depends on how a backend orders ties (chunked == token-by-token, batch invariance).
    """
    if value_range is not None and (fast := int_topk_selection(scores, step, value_range)) is not None:
        return fast  # CUDA, uniform step: histogram select, same set as below
    n = scores.shape[-1]
    position = torch.arange(n, device=scores.device, dtype=torch.int64)
    rank_key = (scores.to(torch.int64) << 32) | position
    top = torch.iinfo(torch.int64).max
    rank_key = torch.where(step.forced[:, None], top - n + position, rank_key)
    rank_key = rank_key.masked_fill(~step.visible[:, None], -1)
    k_max = step.max_budget()
    values, indices = rank_key.topk(k_max, dim=-1, sorted=True)
    ranks = torch.arange(k_max, device=scores.device)
    valid = (ranks < step.budgets[:, None, :, None]) & (values >= 0)
    return Selection(indices=indices, valid=valid)


def resolve_hash(
    layer: LayerInfo, checkpoint: str, bits: int | None, kind: str | None, seed: int
) -> LayerHash:
    """The LayerHash a selector of `layer` uses for the given options (see the module docstring)."""
    if checkpoint == "none":
        return untrained_hash(layer, bits or DEFAULT_BITS, kind or "mlp", seed)
    if checkpoint == "auto":
        if (shipped := shipped_checkpoint(layer)) is None:
            return untrained_hash(layer, bits or DEFAULT_BITS, kind or "mlp", seed)
        path, header = shipped
    else:
        path = Path(checkpoint)
        header = read_header(path)
        if (diff := shape_mismatch(header["fingerprint"], layer)) is not None:
            raise ConfigError(f"spotlight checkpoint {checkpoint!r} was made for another model ({diff})")
    SpotlightSelector._check_header_options(header, bits, kind, str(path))
    loaded = load_checkpoint(path)
    if layer.layer_idx not in loaded.layers:
        trained = header["layers"]
        raise ConfigError(
            f"spotlight checkpoint {str(path)!r} has no hash for layer {layer.layer_idx} (it covers layers "
            f"{trained[0]}..{trained[-1]}): keep that layer dense (dense_layers) or train it with train-hash"
        )
    trained = loaded.layers[layer.layer_idx]
    return trained if layer.shards == 1 else trained.select_heads(layer.kv_heads)
