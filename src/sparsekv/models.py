"""Model loading: the embedded default model, GGUF files, local HF dirs, hub ids; random-weight models for tests.

Every model comes back with SDPA attention, in eval mode, in the requested dtype and device.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from sparsekv.assets import _TMP_PREFIX, _remove_stale_tmp, cache_dir, default_model_file, gemma3_270m_file
from sparsekv.errors import ConfigError

__all__ = [
    "DEFAULT_MODEL_DIRNAME",
    "MODEL_SHAPES",
    "ModelLoadError",
    "ModelShape",
    "chat_prompt",
    "default_model_dir",
    "load_model",
    "load_tensor_parallel",
    "random_model",
    "torch_dtype",
]

_Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]

DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
# What the embedded SmolLM2-135M-Instruct must look like; a mismatch means a broken asset or conversion.
_DEFAULT_EXPECTED = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF asset: converted once to a plain safetensors folder in the cache, checked."""

    dirname: str
    gguf: Callable[[], Path]
    architecture: str
    expected: dict[str, Any]
    #: a text and the token ids the model's own tokenizer gives it: some transformers releases build another
    #: tokenizer from the GGUF, and the model then reads every text as nonsense without any error
    tokenizer_probe: tuple[str, tuple[int, ...]] | None = None


EMBEDDED: dict[str, EmbeddedModel] = {
    "default": EmbeddedModel(DEFAULT_MODEL_DIRNAME, default_model_file, "LlamaForCausalLM", _DEFAULT_EXPECTED),
    # Gemma 3 270M (base, no chat template): 18 layers, global attention at 5, 11, 17, the others a 512 window
    "gemma3-270m": EmbeddedModel("gemma3-270m", gemma3_270m_file, "Gemma3ForCausalLM", {
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "sliding_window": 512,
    }, tokenizer_probe=("July 2010What hard liquor", (30211, 236743, 236778, 236771, 236770, 236771, 3689, 2651, 37059))),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[\w.-]+)?$")


class ModelLoadError(RuntimeError):
    """A model spec could not be resolved or loaded."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype by name ("float32", "bfloat16", "float16", as the CLI and the eval harness give it)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


# ----------------------------------------------------------------------------------------------------------------
# Real models


def load_model(
    spec: str = "default",
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``spec`` is an embedded model (``"default"``: SmolLM2-135M-Instruct; ``"gemma3-270m"``: Gemma 3 270M base), a
    ``.gguf`` file, a local HF model dir or a hub id.
    ``dtype`` is a torch dtype or its name (`torch_dtype`).
    """
    dtype = torch_dtype(dtype)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"cannot load model {spec!r} on cuda: this machine has no CUDA GPU (use --device cpu)")
    path = Path(spec).expanduser()
    if spec in EMBEDDED:
        return _load_embedded(spec, dtype, device)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"cannot load model {spec!r}: it is a file but not a .gguf; {_HINT}")
        hint = "check that it is a complete GGUF file of a supported architecture (e.g. Llama)"
        load = partial(_from_pretrained, path.parent, dtype, device, gguf_file=path.name)
    elif path.is_dir():
        hint = "check that the folder holds config.json, the weights and the tokenizer files"
        load = partial(_from_pretrained, path, dtype, device)
    elif not _HUB_ID.match(spec) or spec.lower().endswith(".gguf"):
        raise ModelLoadError(f"cannot load model {spec!r}: no such file or directory; {_HINT}")
    else:
        hint = (
            "if this machine is offline or the id is wrong, download the model on a connected machine "
            "(`hf download ID --local-dir DIR`) and pass DIR, or use 'default'"
        )
        load = partial(_from_pretrained, spec, dtype, device)
    return _guarded(spec, hint, load)


_HINT = (
    f"pass an embedded model ({', '.join(EMBEDDED)}), a .gguf file, a local Hugging Face model folder, or a hub id "
    "like 'org/name'"
)


def default_model_dir() -> Path:
    """Folder of the default model converted to safetensors (converted from the GGUF on first use)."""
    return embedded_model_dir("default")


def embedded_model_dir(name: str) -> Path:
    """Folder of an embedded model converted to safetensors (converted from its GGUF on first use)."""
    final = cache_dir() / "models" / EMBEDDED[name].dirname
    if not final.is_dir():
        _convert_embedded(name, final)
    return final


def _load_embedded(
    name: str, dtype: torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = embedded_model_dir(name)
    # The converted folder only appears complete (atomic rename), so a failure here is external damage or a
    # dtype/device problem; rebuilding automatically could throw away a good copy, so we only say how to fix it.
    hint = f"if the cached copy is damaged, delete {folder} and retry"
    model, tok = _guarded(name, hint, partial(_from_pretrained, folder, dtype, device))
    _check_embedded(name, model)
    if not _tokenizer_matches(name, tok):
        raise ModelLoadError(
            f"the cached copy of the embedded model {name!r} has a wrong tokenizer (transformers 5.17.0 builds a "
            f"Unigram tokenizer from this GGUF instead of its BPE one): delete {folder} and convert it again with "
            f"transformers >= 5.18 (installed: {transformers.__version__})"
        )
    return model, tok


def _convert_embedded(name: str, final: Path) -> None:
    """Dequantize the embedded GGUF once and save it as a plain safetensors model + tokenizer, atomically."""
    gguf = EMBEDDED[name].gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)  # a killed conversion leaves ~0.5 GB behind
    work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
    try:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_gguf_kwargs()
            )
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if not _tokenizer_matches(name, tok):
                raise ModelLoadError(
                    f"transformers {transformers.__version__} builds a wrong tokenizer from this GGUF (5.17.0 "
                    "makes a Unigram tokenizer of Gemma 3's BPE one): use transformers >= 5.18"
                )
            model = _plain_copy(loaded)
            del loaded
            _check_embedded(name, model)
            # fp32 keeps the dequantized Q4_1 values exactly (bf16 would round them).
            model.save_pretrained(work / "out")
            tok.save_pretrained(work / "out")
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means no usable conversion
            raise ModelLoadError(
                f"cannot convert the embedded model {name!r} ({gguf}) to safetensors: {_short(exc)}; delete "
                f"{gguf.parent} to refetch it"
            ) from None
        try:
            (work / "out").rename(final)
        except OSError:
            if not final.is_dir():  # else another process converted it at the same time: use theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _gguf_kwargs() -> dict[str, Any]:
    # Newer transformers keep GGUF weights packed when the `kernels` package is present; we want plain nn.Linear
    # weights everywhere, so ask for dequantization explicitly where that option exists.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """Same weights in a model with no quantizer attached, so that ``save_pretrained`` writes a plain checkpoint."""
    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(cfg_dict)
    # Built on meta and filled by assignment: random-initialising 135M weights only to overwrite them costs ~10 s.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain


def _tokenizer_matches(name: str, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer gives the embedded model's probe text its known ids (True without a probe)."""
    probe = EMBEDDED[name].tokenizer_probe
    if probe is None:
        return True
    text, ids = probe
    return tuple(tokenizer(text, add_special_tokens=False).input_ids) == ids


def _check_embedded(name: str, model: PreTrainedModel) -> None:
    spec = EMBEDDED[name]
    got = {key: getattr(model.config, key, None) for key in spec.expected}
    if type(model).__name__ != spec.architecture or got != spec.expected:
        raise ModelLoadError(
            f"the embedded model {name!r} does not have its expected shape: got {type(model).__name__} {got}, "
            f"expected {spec.architecture} {spec.expected}"
        )


def _from_pretrained(
    source: str | Path, dtype: torch.dtype, device: str | torch.device, gguf_file: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    dev = torch.device(device)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if dev.type != "cpu":
        kwargs["device_map"] = {"": dev}  # load straight onto the accelerator, no full CPU copy first
    if gguf_file is not None:
        kwargs.update(gguf_file=gguf_file, **_gguf_kwargs())
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    tok_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tok = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # batched generate needs a pad token; causal LMs often ship without one
    model = model.to(device=dev, dtype=dtype).eval()
    return model, tok


def _guarded(spec: str, hint: str, load: Callable[[], _Loaded]) -> _Loaded:
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - callers get one clear error, not a transformers traceback
        raise ModelLoadError(f"cannot load model {spec!r}: {_short(exc)}; {hint}") from None


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()).rstrip(".") or "no message"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """``text`` as one user turn plus the assistant generation prompt, if the tokenizer has a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


# ----------------------------------------------------------------------------------------------------------------
# Random-weight models


@dataclass(frozen=True)
class ModelShape:
    """A model family (HF ``model_type``) and the config fields that define its shape."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)


_TINY_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": 512}

MODEL_SHAPES: dict[str, ModelShape] = {
    # Tiny shapes: fast unit tests. Varied GQA ratios and head dims (32, 48, 64) catch shape assumptions.
    "tiny-llama": ModelShape("llama", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192,
    }),
    "tiny-llama-mha": ModelShape("llama", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 8192,
    }),
    "tiny-qwen2": ModelShape("qwen2", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
    "tiny-mistral": ModelShape("mistral", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
        "sliding_window": None,
    }),
    "tiny-qwen3": ModelShape("qwen3", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192,
    }),
    # hybrid: sliding-window layers (window 16) around global ones (layers 2 and 5), one kv head, as Gemma 3
    "tiny-gemma3": ModelShape("gemma3_text", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 8192,
        "sliding_window": 16, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    }),
    "tiny-phi3": ModelShape("phi3", {
        **_TINY_IDS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
    }),
    # Real published shapes, for speed benchmarks (random weights, no download).
    # Llama-3.1-8B: the 131072-token context comes with its "llama3" RoPE scaling.
    "llama3-8b": ModelShape("llama", {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    }),
    # Qwen2-7B(-Instruct): 32K native context (longer needs YaRN, not modelled here).
    "qwen2-7b": ModelShape("qwen2", {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "bos_token_id": 151643, "eos_token_id": 151643, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
    # Gemma 3 270M: 15 layers of a 512-token window around 3 global ones (5, 11, 17), one kv head of 256 channels,
    # a 262,144-token vocabulary (the embedded asset's real weights: `load_model("gemma3-270m")`)
    "gemma3-270m": ModelShape("gemma3_text", {
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "sliding_window": 512,
        "tie_word_embeddings": True,  # layer types from the config's default pattern: every sixth layer global
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    }),
    # Mistral-7B-v0.3: full attention (no sliding window), 32768-token vocab.
    "mistral-7b": ModelShape("mistral", {
        "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
}  # fmt: skip


def random_model(
    shape: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """A random-weight model of a ``MODEL_SHAPES`` shape; ``overrides`` replace config fields.

    Weights are created directly on ``device`` in ``dtype`` (``"meta"`` allocates nothing). Build on the device you
    will run on: a meta model's RoPE buffers are not real values.
    """
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    entry = MODEL_SHAPES[shape]
    config = AutoConfig.for_model(entry.model_type, **{**entry.config, **overrides})
    dev = torch.device(device)
    rng_devices = [dev] if dev.type == "cuda" else []
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=rng_devices), torch.device(dev):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def load_tensor_parallel(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """`model_dir` loaded with transformers' own tensor parallelism (`tp_plan="auto"`) over the ranks of the
    process group (launched with torchrun): each rank holds its shard of every layer's heads. transformers
    initialises the process group where none is (NCCL on GPUs, gloo on CPU)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # releases before DistributedConfig take tp_plan directly
        return AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=dtype, attn_implementation="sdpa").eval()
    config = DistributedConfig(tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=config, dtype=dtype, attn_implementation="sdpa"
    ).eval()
