"""Layer-wise training of Spotlight hashes with the ranking loss (frozen model, captured q/k).

Per sparse layer, independently: normalisation from the calibration keys/queries (key mean and RMS, query
RMS per kv head), a hash initialised from the seed, then `steps` AdamW steps. Each step takes one calibration
window and `batch_queries` random query positions; for every query head the positives are the oracle top-2%
of its visible keys (exact q·k), the negatives `random_negatives` uniformly drawn visible keys plus the
`hard_negatives` non-positive keys the current hash ranks highest. The loss is ranking_loss on soft-sign codes
(score = Σ_bits softsign(h(q))·softsign(h(k)), γ=64). Each finished layer is saved to `<output>.parts/` so an
interrupted run resumes where it stopped; the final file holds all layers, the model fingerprint, this config
and the held-out IoU measured after each layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsekv.budget import budget_tokens_tensor
from sparsekv.config import ConfigError
from sparsekv.selectors.spotlight import (
    HASH_KINDS,
    LayerHash,
    load_checkpoint,
    read_header,
    save_checkpoint,
    softsign,
)
from sparsekv.training.loss import ranking_loss
from sparsekv.training.metrics import layer_iou, query_positions


@dataclass(frozen=True)
class TrainConfig:
    """Settings of `train-hash`; defaults are the paper's where it has one, sized for a CPU otherwise."""

    bits: int = 128
    hash: str = "mlp"
    hidden: int | None = None  # MLP width (default: head_dim)
    steps: int = 40
    batch_queries: int = 16
    random_negatives: int = 128
    hard_negatives: int = 32
    top_fraction: float = 0.02  # positives: oracle top-2% of the visible keys
    beta: float = 1.0
    alpha: float = 0.0  # margin (paper text 3, authors' code 0)
    gamma: float = 64.0  # soft sign sharpness, training only
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.1
    warmup_fraction: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    window: int = 2048
    train_windows: int = 2
    eval_windows: int = 1
    eval_queries: int = 96
    min_query_position: int = 256
    holdout_fraction: float = 0.2
    dense_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        if self.hash not in HASH_KINDS:
            raise ConfigError(f"--hash must be one of {', '.join(HASH_KINDS)}, got {self.hash!r}")
        for name in ("bits", "steps", "batch_queries", "window", "train_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.top_fraction < 1:
            raise ConfigError(f"top_fraction must be in (0, 1), got {self.top_fraction}")
        if not 0 <= self.min_query_position < self.window - 1:
            raise ConfigError(f"min_query_position must be in [0, window-1), got {self.min_query_position}")

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


@dataclass
class LayerResult:
    layer: int
    hash_fn: LayerHash
    metrics: dict = field(default_factory=dict)


def normalisation(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key mean [Hkv, d], key RMS after centring [Hkv], query RMS per kv group [Hkv]) of q [W,Hq,L,d], k [W,Hkv,L,d]."""
    hkv, d = k.shape[1], k.shape[-1]
    kf = k.float().transpose(0, 1).reshape(hkv, -1, d)
    mean = kf.mean(1)
    key_scale = (kf - mean[:, None]).pow(2).mean((1, 2)).sqrt().clamp(min=1e-6)
    qf = q.float().transpose(0, 1).reshape(hkv, -1, d)
    query_scale = qf.pow(2).mean((1, 2)).sqrt().clamp(min=1e-6)
    return mean, key_scale, query_scale


def lr_lambda(cfg: TrainConfig):
    warmup = max(1, round(cfg.warmup_fraction * cfg.steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def new_hash(cfg: TrainConfig, num_kv_heads: int, head_dim: int, layer: int) -> LayerHash:
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + layer)
    return LayerHash(num_kv_heads, head_dim, cfg.bits, cfg.hash, cfg.hidden, generator=generator)


def train_layer(
    q: torch.Tensor, k: torch.Tensor, cfg: TrainConfig, layer: int, on_step=None, device=None
) -> tuple[LayerHash, float]:
    """Trains the hash of one layer on q [W, Hq, L, d], k [W, Hkv, L, d]; returns (hash on the CPU, mean loss of
    the last 10%). `device` (default: q's) runs the steps there; the random draws come from a CPU generator,
    so a seed gives the same batches on every device (the float results differ by rounding)."""
    device = torch.device(device) if device is not None else q.device
    windows, hq, length, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    fn = new_hash(cfg, hkv, d, layer)
    fn.set_normalisation(*normalisation(q, k))
    fn.to(device)
    q, k = q.to(device), k.to(device)
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + layer + 7_919)
    opt = torch.optim.AdamW(fn.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    key_pos = torch.arange(length, device=device)
    losses = []
    bq = cfg.batch_queries
    for step in range(cfg.steps):
        w = step % windows
        pos = torch.randint(cfg.min_query_position, length, (bq,), generator=generator).to(device)
        qs = q[w][:, pos].float().reshape(hkv, g * bq, d)  # query head h -> kv head h // g
        ks = k[w].float()
        t = pos.repeat(g)  # positions of the rows of qs (group-major)
        visible = key_pos[None, :] <= t[:, None]  # [gBq, L]
        with torch.no_grad():
            logits = torch.matmul(qs, ks.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
            count = budget_tokens_tensor(float(cfg.top_fraction), t + 1)  # the decode path's rounding
            k_max = int(count.max())
            pos_idx = logits.topk(k_max, dim=-1).indices  # [Hkv, gBq, k_max]
            pos_valid = (torch.arange(k_max, device=device) < count[:, None]).expand_as(pos_idx)
            is_pos = torch.zeros(logits.shape, dtype=torch.bool, device=device).scatter_(
                -1, pos_idx, pos_valid
            )
            draws = torch.rand(hkv, g * bq, cfg.random_negatives, generator=generator).to(device)
            rand_idx = (draws * (t + 1)[:, None]).long()
            rand_valid = ~is_pos.gather(-1, rand_idx)
        hq_soft = softsign(fn(qs, "q"), cfg.gamma)
        hk_soft = softsign(fn(ks, "k"), cfg.gamma)
        scores = torch.matmul(hq_soft, hk_soft.transpose(-1, -2))  # [Hkv, gBq, L]
        neg_idx, neg_valid = rand_idx, rand_valid
        if cfg.hard_negatives > 0:
            with torch.no_grad():
                hard = scores.detach().masked_fill(is_pos | ~visible, float("-inf"))
                hard_val, hard_idx = hard.topk(cfg.hard_negatives, dim=-1)
            neg_idx = torch.cat([rand_idx, hard_idx], dim=-1)
            neg_valid = torch.cat([rand_valid, hard_val > float("-inf")], dim=-1)
        loss = ranking_loss(
            scores.gather(-1, pos_idx), pos_valid, scores.gather(-1, neg_idx), neg_valid, cfg.beta, cfg.alpha
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(fn.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    fn.requires_grad_(False)
    fn.to("cpu")
    tail = losses[-max(1, len(losses) // 10) :]
    return fn, sum(tail) / len(tail)


def _part_path(parts: Path, layer: int) -> Path:
    return parts / f"layer_{layer:03d}.safetensors"


def _load_part(path: Path, fingerprint: dict, cfg: TrainConfig, layer: int) -> LayerResult | None:
    """A finished layer of an earlier run with the same model and config, else None."""
    if not path.is_file():
        return None
    try:
        header = read_header(path)
    except ConfigError:
        return None
    if header["fingerprint"] != fingerprint or header["training"] != cfg.to_json():
        return None
    loaded = load_checkpoint(path)
    if layer not in loaded.layers:
        return None
    return LayerResult(layer, loaded.layers[layer], header["metrics"].get(str(layer), {}))


def train_hash(
    model,
    tokenizer,
    cfg: TrainConfig,
    output: str | Path,
    train_text: str | list[str] | None = None,
    eval_text: str | list[str] | None = None,
    show_progress: bool = True,
    console=None,
) -> dict:
    """Captures q/k, trains every sparse layer, writes `output`; returns a report (times, per-layer metrics).

    Without texts, calibration uses the embedded haystack with its last essays held out for evaluation. A list
    of texts is one text per genre: training windows are drawn evenly from them (`genre_windows`), and so are
    the evaluation windows of a list of held-out texts.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from sparsekv.fingerprint import model_fingerprint
    from sparsekv.training.capture import capture_qk, genre_windows, haystack_split, held_out_windows

    start = time.perf_counter()
    output = Path(output)
    device = next(model.parameters()).device  # training steps run where the model is
    fingerprint = model_fingerprint(model)
    num_layers = fingerprint["num_layers"]
    bad = [i for i in cfg.dense_layers if i >= num_layers]
    if bad:
        raise ConfigError(f"dense layer(s) {bad} out of range: the model has {num_layers} layers")
    layers = [i for i in range(num_layers) if i not in cfg.dense_layers]
    if not layers:
        raise ConfigError("every layer is dense: nothing to train")
    if train_text is None:
        train_text, held_text = haystack_split(cfg.holdout_fraction)
        eval_text = eval_text or held_text
    parts = output.with_name(output.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    results: dict[int, LayerResult] = {}
    for layer in layers:
        done = _load_part(_part_path(parts, layer), fingerprint, cfg, layer)
        if done is not None:
            results[layer] = done
    todo = [i for i in layers if i not in results]

    report: dict = {"resumed_layers": sorted(results), "trained_layers": todo}
    if todo:
        train_texts = [train_text] if isinstance(train_text, str) else list(train_text)
        train_ids = genre_windows(tokenizer, train_texts, cfg.window, cfg.train_windows)
        eval_texts = [eval_text] if isinstance(eval_text, str) else list(eval_text or [])
        eval_ids = None
        if eval_texts and cfg.eval_windows > 0:
            eval_ids = held_out_windows(tokenizer, eval_texts, cfg.window, cfg.eval_windows)
        t0 = time.perf_counter()
        train_qk = capture_qk(model, train_ids, todo)
        eval_qk = capture_qk(model, eval_ids, todo) if eval_ids is not None else {}
        report["capture_seconds"] = time.perf_counter() - t0
        positions = query_positions(cfg.window, cfg.eval_queries, cfg.min_query_position, seed=12345)
        columns = [
            TextColumn("[bold]train-hash[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, console=console, disable=not show_progress, transient=False) as progress:
            task = progress.add_task("", total=len(todo) * cfg.steps)
            for layer in todo:
                q, k = train_qk[layer]

                def on_step(step, loss, layer=layer):
                    progress.update(task, advance=1, description=f"layer {layer} loss {loss:.4f}")

                t_layer = time.perf_counter()
                fn, final_loss = train_layer(q, k, cfg, layer, on_step, device=device)
                metrics = {"final_loss": final_loss, "seconds": time.perf_counter() - t_layer}
                if layer in eval_qk:
                    eq, ek = eval_qk[layer]
                    iou = layer_iou(fn, eq, ek, cfg.top_fraction, positions)
                    metrics.update({f"iou_{p}": float(v.mean()) for p, v in iou.items()})
                results[layer] = LayerResult(layer, fn, metrics)
                save_checkpoint(
                    _part_path(parts, layer), {layer: fn}, fingerprint, cfg.to_json(), {str(layer): metrics}
                )
                del train_qk[layer]
    per_layer = {str(i): results[i].metrics for i in layers}
    summary = {}
    for key in ("iou_group", "iou_head"):
        values = [m[key] for m in per_layer.values() if key in m]
        if values:
            summary[f"mean_{key}"] = sum(values) / len(values)
    save_checkpoint(
        output,
        {i: results[i].hash_fn for i in layers},
        fingerprint,
        cfg.to_json(),
        {**per_layer, "summary": summary},
    )
    report.update(
        {"output": str(output), "seconds": time.perf_counter() - start, "per_layer": per_layer, **summary}
    )
    return report
