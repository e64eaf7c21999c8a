"""Lossless decoding (self-speculation): sparse decode steps draft tokens, one dense forward over all of them
verifies, the agreeing prefix and the dense model's own next token are kept and the cache rolls the rest back.

Greedy, the output is the dense model's greedy output token for token; sampling, the speculative-sampling rule keeps
the dense model's distribution exactly. `sparsekv.generate(..., lossless=True)` runs it with sampling too;
`sparsekv.enable(model, config, lossless=True)` makes `model.generate()` itself decode this way (greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.cache import SparseCache, layer_infos
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.registry import get_method_class


@dataclass
class DraftCounts:
    """What the verifications of a lossless generation found."""

    drafted: int = 0  # tokens proposed by the sparse steps
    accepted: int = 0  # of those, the ones the dense forward agreed with
    verifications: int = 0  # dense forwards

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens produced per dense forward: the accepted drafts plus the dense model's own token."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else None


class Decoder:
    """Forwards of new tokens after a left-padded prompt: the attention mask and positions follow the cache's
    length, so that a rollback (`rewind`) is one call."""

    def __init__(self, model, cache: SparseCache, prompt_mask: torch.Tensor) -> None:
        self.model, self.cache, self.prompt_mask = model, cache, prompt_mask
        self.last_position = (prompt_mask.sum(-1, keepdim=True) - 1).clamp(min=0)  # [B, 1]
        self.decoded = 0  # tokens cached after the prompt

    def __call__(self, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] (or of the last position only)."""
        n = tokens.shape[1]
        mask = torch.cat([self.prompt_mask, self.prompt_mask.new_ones(len(tokens), self.decoded + n)], dim=-1)
        offsets = torch.arange(self.decoded + 1, self.decoded + n + 1, device=tokens.device)
        logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=self.last_position + offsets,
                            **cache_kwargs(self.model, self.cache), use_cache=True,
                            logits_to_keep=0 if all_logits else 1).logits  # fmt: skip
        self.decoded += n
        return logits

    def rewind(self, decoded: int) -> None:
        self.cache.crop(decoded - self.decoded)
        self.decoded = decoded


class Sampler:
    """Greedy (temperature None) or sampling from softmax(logits / temperature) with its own generator."""

    def __init__(self, temperature: float | None, seed: int | None, device: torch.device) -> None:
        self.temperature = temperature
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, V] logits -> (tokens [B], their distribution [B, V] when sampling, else None)."""
        if self.temperature is None:
            return logits.argmax(-1), None
        probs = self.probs(logits)
        return self.sample(probs), probs

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device)


def verify(sampler: Sampler, drafts: list[torch.Tensor], draft_probs: list, dense_logits: torch.Tensor):
    """The dense model's verdict on the drafts: -> (how many each row accepts [B], each row's token after its
    accepted prefix [B] as a function of the prefix length k kept for the whole batch).

    Greedy: a draft stands while it equals the dense argmax. Sampling: the speculative-sampling rule, so every
    emitted token is distributed exactly as the dense model's: draft d with draft probability q(d) is accepted
    with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from max(0, p - q),
    normalised; after a full acceptance, from p."""
    proposed = torch.stack(drafts[1:], dim=1)  # [B, gamma]
    gamma = proposed.shape[1]
    if sampler.temperature is None:
        dense = dense_logits.argmax(-1)  # [B, gamma + 1]
        agree = (dense[:, :gamma] == proposed).int().cumprod(-1).sum(-1)
        return agree, lambda k: dense[:, k]
    p = sampler.probs(dense_logits)  # [B, gamma + 1, V]
    q = torch.stack(draft_probs, dim=1)  # [B, gamma, V]
    p_d = p[:, :gamma].gather(-1, proposed[..., None])[..., 0]
    q_d = q.gather(-1, proposed[..., None])[..., 0]
    accept = sampler.uniform(p_d.shape, p_d.device) * q_d < p_d
    agree = accept.int().cumprod(-1).sum(-1)

    def token_after(k: int) -> torch.Tensor:
        if k == gamma:
            return sampler.sample(p[:, gamma])
        residual = (p[:, k] - q[:, k]).clamp(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0
        resampled = sampler.sample(torch.where(empty, p[:, k], residual))  # multinomial normalises
        return torch.where(agree > k, proposed[:, k], resampled)  # rows that accepted draft k + 1 keep it

    return agree, token_after


def check_lossless(config: SparseConfig, draft_tokens: int) -> None:
    method = get_method_class(config.method)
    if method.dense or method.rewrites_prompt:
        raise ConfigError(f"lossless decoding drafts with a sparse method; {config.method} decodes densely already")
    if method.stores_kv:
        raise ConfigError(
            f"{config.method} keeps only its compressed K/V, so a dense step cannot verify its drafts; lossless "
            "decoding needs a method that keeps the full K/V"
        )
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ConfigError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")


def prefill(model, cache: SparseCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The (left-padded) prompt through the model into `cache` -> the last position's logits [B, V]."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,  # the prompt's full-vocabulary logits would cost more than its attention
    ).logits[:, -1]


def speculate(decoder: Decoder, sampler: Sampler, last: torch.Tensor, draft_tokens: int, room: int,
              finished: torch.Tensor, counts: DraftCounts) -> list[torch.Tensor]:  # fmt: skip
    """One round after token `last` [B]: `draft_tokens` sparse steps propose (at most `room`), one dense forward
    checks them all, the cache keeps the accepted prefix. -> the round's tokens, each [B] (at most `room`): the
    drafts the whole batch accepted (its unfinished rows) and the dense model's token after them."""
    cache = decoder.cache
    base = decoder.decoded
    gamma = min(draft_tokens, room)
    drafts, draft_probs = [last], []
    for _ in range(gamma):  # sparse steps propose
        token, probs = sampler.draw(decoder(drafts[-1][:, None])[:, -1])
        drafts.append(token)
        draft_probs.append(probs)
    decoder.rewind(base)
    cache.attend_densely = True  # one dense forward checks every proposal at once
    try:
        dense_logits = decoder(torch.stack(drafts, dim=1), all_logits=True)  # [B, gamma + 1, V]
    finally:
        cache.attend_densely = False
    agree, token_after = verify(sampler, drafts, draft_probs, dense_logits)
    k = int(agree[~finished].min()) if bool((~finished).any()) else gamma
    counts.drafted, counts.accepted, counts.verifications = counts.drafted + gamma, counts.accepted + k, counts.verifications + 1
    decoder.rewind(base + k + 1)  # keep the dense K/V of the last token and the accepted drafts
    return [*drafts[1 : k + 1], token_after(k)][:room]


#: `model.generate()` arguments a lossless generation takes; any other is refused, not ignored
_GENERATE_ARGUMENTS = ("input_ids", "inputs", "attention_mask", "max_new_tokens", "do_sample", "pad_token_id",
                       "eos_token_id", "streamer", "use_cache")  # fmt: skip


def generate_losslessly(model, config: SparseConfig, draft_tokens: int, counts: DraftCounts, args: tuple,
                        kwargs: dict) -> torch.Tensor:  # fmt: skip
    """`model.generate(input_ids, attention_mask=..., max_new_tokens=N, do_sample=False)` of an enabled model in
    lossless mode: greedy, token for token the dense model's output (a left-padded batch keeps each round's
    shortest accepted prefix). Returns the prompt and the new tokens [B, prompt + new], as `generate` does; rows
    that finished (EOS) are padded with `pad_token_id`. `counts` adds up the rounds' drafts."""
    unknown = sorted(k for k, v in kwargs.items() if k not in _GENERATE_ARGUMENTS and v is not None)
    if unknown or len(args) > 1:
        raise ConfigError(
            f"lossless model.generate() takes {', '.join(_GENERATE_ARGUMENTS)}; got {unknown or 'extra positional arguments'} "
            "(for more, generate without lossless=True)"
        )
    if kwargs.get("use_cache") is False:
        raise ConfigError("lossless model.generate() decodes from its cache: use_cache=False cannot be honoured")
    generation = model.generation_config
    do_sample = kwargs.get("do_sample")
    if do_sample or (do_sample is None and generation.do_sample):
        raise ConfigError(
            "lossless model.generate() decodes greedily: pass do_sample=False (lossless sampling: "
            "sparsekv.generate(..., lossless=True, do_sample=True))"
        )
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError("lossless model.generate() needs input_ids as a [batch, tokens] tensor")
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    if bool((mask[:, -1] == 0).any()):
        raise ConfigError("lossless model.generate() takes left-padded batches (a row ends in padding)")
    max_new = kwargs.get("max_new_tokens") or generation.max_new_tokens
    if not max_new:
        raise ConfigError("lossless model.generate() needs max_new_tokens")
    eos = kwargs.get("eos_token_id", generation.eos_token_id)
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=ids.device)
    pad = kwargs.get("pad_token_id", generation.pad_token_id)
    pad = pad if pad is not None else (int(eos[0]) if len(eos) else 0)
    streamer = kwargs.get("streamer")
    cache = SparseCache(config, layer_infos(model), initial_capacity=ids.shape[1] + max_new)
    with torch.inference_mode():
        if streamer is not None:
            streamer.put(ids.cpu())
        logits = prefill(model, cache, ids, mask)
        decoder, sampler = Decoder(model, cache, mask), Sampler(None, None, ids.device)
        finished = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        generated: list[torch.Tensor] = []
        tokens = [sampler.draw(logits)[0]]
        while tokens:
            for token in tokens:
                token = torch.where(finished, torch.full_like(token, pad), token)
                generated.append(token)
                if streamer is not None:
                    streamer.put(token.cpu())
                finished |= torch.isin(token, eos)
                if bool(finished.all()) or len(generated) == max_new:
                    tokens = []
                    break
            else:
                tokens = speculate(decoder, sampler, generated[-1], draft_tokens, max_new - len(generated),
                                   finished, counts)  # fmt: skip
        if streamer is not None:
            streamer.end()
    return torch.cat([ids, torch.stack(generated, dim=1)], dim=1)
