"""The bench's models (random weights of a real shape, no download) and whether one fits the device."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from sparsekv.config import ConfigError

#: bench model names -> (sparsekv.models shape, config overrides)
DEFAULT_SHAPE = {  # SmolLM2-135M(-Instruct), the embedded default model (random weights here)
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}  # fmt: skip
MODELS = {
    "default": ("tiny-llama", DEFAULT_SHAPE),
    "llama3-8b-random": ("llama3-8b", {}),
    "gemma3-270m-random": ("gemma3-270m", {}),
}


def build_model(name: str, *, layers: int | None = None, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """A random-weight model: a MODELS name or any sparsekv.models shape; `layers` overrides the layer count."""
    from sparsekv.models import MODEL_SHAPES, random_model

    shape, overrides = MODELS.get(name, (name, {}))
    if shape not in MODEL_SHAPES:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join([*MODELS, *MODEL_SHAPES])}")
    overrides = dict(overrides)
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    return random_model(shape, dtype=dtype, device=device, seed=seed, **overrides)


def _available_bytes(device: torch.device) -> int | None:
    """Memory a run can still take: free GPU memory, or the kernel's MemAvailable on Linux (None elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tensor_parallel_model(name: str, *, layers: int | None, tp: int, dtype=torch.bfloat16, seed: int = 0):
    """`build_model`'s model loaded with transformers' tensor parallelism over `tp` ranks, one process per GPU
    (launched with torchrun): rank 0 saves the random weights once (a safetensors checkpoint in the temporary
    directory, reused by later runs), then every rank loads its shard with `tp_plan="auto"`, as a user's checkpoint
    would be loaded."""
    import torch.distributed as dist

    from sparsekv.cache import layer_infos
    from sparsekv.models import load_tensor_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise ConfigError(
            f"--tp {tp} runs one process per GPU: launch it as `torchrun --nproc-per-node {tp} -m sparsekv.cli "
            f"bench generate --tp {tp} ...` (this run has {world} process{'es' if world > 1 else ''})"
        )
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < tp:
        raise ConfigError(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dtype_name = str(dtype).removeprefix("torch.")
    directory = Path(tempfile.gettempdir()) / f"sparsekv-random-{name}-{layers or 'all'}L-{dtype_name}-seed{seed}"
    if dist.get_rank() == 0 and not (directory / "config.json").exists():
        partial = directory.with_name(directory.name + ".partial")
        build_model(name, layers=layers, dtype=dtype, device=device, seed=seed).save_pretrained(partial)
        partial.rename(directory)  # whole or absent: an interrupted save is not reused
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    model = load_tensor_parallel(directory, dtype)
    layer_infos(model)  # heads that do not divide by tp: one clear error, not a reshape error deep in the forward
    return model


def check_fits(name: str, *, layers: int | None, dtype: torch.dtype, device: torch.device, batch: int,
               context: int, shards: int = 1, dense_cache: bool = True) -> None:  # fmt: skip
    """Refuse, before allocating, a model whose weights and dense KV cache exceed the device's free memory: an 8B
    model in float32 on a laptop would otherwise end in the out-of-memory killer, not in an error message. Under
    tensor parallelism each of the `shards` GPUs holds about 1/shards of both. `dense_cache=False`: the run keeps
    no dense KV cache (only a method's compressed one, whose size the method decides), so the weights alone are
    checked."""
    available = _available_bytes(device)
    if available is None:
        return
    meta = build_model(name, layers=layers, dtype=dtype, device="meta")
    cfg = meta.config
    size = torch.tensor([], dtype=dtype).element_size()
    weights = sum(p.numel() for p in meta.parameters()) * size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = 2 * cfg.num_hidden_layers * batch * context * cfg.num_key_value_heads * head_dim * size
    weights, cache = weights / shards, cache / shards if dense_cache else 0
    if weights + cache > available:
        needs = (f" and {cache / 1e9:.1f} GB of dense KV cache ({str(dtype).replace('torch.', '')}) for context "
                 f"{context} x batch {batch}" if dense_cache else "")  # fmt: skip
        raise ConfigError(
            f"{name} with {cfg.num_hidden_layers} layers needs about {weights / 1e9:.1f} GB of weights{needs}"
            f"{f' per GPU over {shards}' if shards > 1 else ''}, but {device.type} has "
            f"{available / 1e9:.1f} GB free: use a smaller --model (e.g. "
            f"default), fewer --layers, a shorter --context or --batch, or a GPU"
        )


def fit_layers(
    batch: int, context: int, model: str = "llama3-8b-random", fraction: float = 0.8, cap: int = 32
) -> int:
    """Decoder layers of `model` whose bf16 weights + dense KV cache (+ codes) fit in `fraction` of free memory."""
    from sparsekv.models import MODEL_SHAPES

    cfg = {**MODEL_SHAPES[MODELS.get(model, (model, {}))[0]].config}
    h, kv, d, inter = (
        cfg["hidden_size"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    )
    q = cfg["num_attention_heads"]
    per_layer_w = 2 * (h * d * (q + 2 * kv) + q * d * h + 3 * h * inter)
    per_layer_kv = 2 * 2 * batch * kv * context * d * 1.05  # + hash codes / selector state
    embed = 2 * 2 * cfg["vocab_size"] * h
    free = torch.cuda.mem_get_info()[0] * fraction - embed - 4 * 2**30  # temporaries of the fill and decode
    return max(1, min(cap, int(free // (per_layer_w + per_layer_kv))))
