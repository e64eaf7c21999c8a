"""Lossless decoding (self-speculation): sparse decode steps draft tokens, one dense forward over all of them
verifies, the agreeing prefix and the dense model's own next token are kept and the cache rolls the rest back.
Each row of a batch keeps its own agreeing prefix: the slots of the drafts a row rejected stay in the cache, masked
for that row (its attention mask has a 0 there, as for padding), and only the slots no row kept are rolled back.

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
    """What the verifications of a lossless generation found (summed over the batch's unfinished rows)."""

    drafted: int = 0  # tokens proposed by the sparse steps
    accepted: int = 0  # of those, the ones the dense forward agreed with
    verifications: int = 0  # dense forwards
    rows_verified: int = 0  # unfinished rows over those forwards: each produced its accepted drafts + one token

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens a row gets per dense forward: its accepted drafts plus the dense model's own token."""
        return (self.accepted + self.rows_verified) / self.rows_verified if self.rows_verified else None


class Decoder:
    """Forwards of new tokens after a left-padded prompt. `mask` [B, cached] marks each row's real tokens: 0 is
    padding, or the slot of a draft that row rejected while another row accepted its own (`keep`), so that every
    row advances by its own accepted count. Positions count a row's real tokens, so rotary positions are the
    ones the row would have without the masked slots; a rollback of the tail (`rewind`) is one call."""

    def __init__(self, model, cache: SparseCache, prompt_mask: torch.Tensor) -> None:
        self.model, self.cache = model, cache
        self.mask = prompt_mask
        self.prompt_length = prompt_mask.shape[1]

    @property
    def decoded(self) -> int:
        """Slots cached after the prompt (masked ones included)."""
        return self.mask.shape[1] - self.prompt_length

    def __call__(self, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] (or of the last position only)."""
        n = tokens.shape[1]
        offsets = torch.arange(n, device=tokens.device)
        positions = self.mask.sum(-1, keepdim=True) + offsets  # each row's real tokens so far, then one apiece
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), n)], dim=-1)
        return self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions,
                          **cache_kwargs(self.model, self.cache), use_cache=True,
                          logits_to_keep=0 if all_logits else 1).logits  # fmt: skip

    def rewind(self, decoded: int) -> None:
        self.cache.crop(decoded - self.decoded)
        self.mask = self.mask[:, : self.prompt_length + decoded]

    def keep(self, kept: torch.Tensor, latest: int) -> None:
        """Of the `latest` cached slots, row i keeps its first kept[i] ([B]); the rest are masked for that row,
        and the slots no row keeps are rolled back."""
        most = int(kept.max())
        self.rewind(self.decoded - latest + most)
        if most:
            self.mask[:, -most:] = torch.arange(most, device=kept.device) < kept[:, None]


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
    """The dense model's verdict on the drafts, row by row: -> (how many drafts each row accepts [B], each row's
    token after its accepted prefix [B]).

    Greedy: a draft stands while it equals the dense argmax. Sampling: the speculative-sampling rule, so every
    emitted token is distributed exactly as the dense model's: draft d with draft probability q(d) is accepted
    with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from max(0, p - q),
    normalised; after a full acceptance, from p."""
    proposed = torch.stack(drafts[1:], dim=1)  # [B, gamma]
    gamma = proposed.shape[1]
    if sampler.temperature is None:
        dense = dense_logits.argmax(-1)  # [B, gamma + 1]
        agree = (dense[:, :gamma] == proposed).int().cumprod(-1).sum(-1)
        return agree, dense.gather(1, agree[:, None].long())[:, 0]
    p = sampler.probs(dense_logits)  # [B, gamma + 1, V]
    q = torch.stack(draft_probs, dim=1)  # [B, gamma, V]
    p_d = p[:, :gamma].gather(-1, proposed[..., None])[..., 0]
    q_d = q.gather(-1, proposed[..., None])[..., 0]
    accept = sampler.uniform(p_d.shape, p_d.device) * q_d < p_d
    agree = accept.int().cumprod(-1).sum(-1).long()
    rows = torch.arange(len(agree), device=agree.device)
    p_next = p[rows, agree]  # [B, V]: dense at the first rejected draft, or past the last draft
    residual = (p_next - q[rows, agree.clamp(max=gamma - 1)]).clamp(min=0)
    resample = (agree < gamma)[:, None] & (residual.sum(-1, keepdim=True) > 0)
    return agree, sampler.sample(torch.where(resample, residual, p_next))  # multinomial normalises


class RowTokens:
    """Each row's new tokens as the rounds produce them; a row finishes at an `eos` token or at `max_new`."""

    def __init__(self, batch: int, max_new: int, eos: torch.Tensor, device: torch.device) -> None:
        self.rows: list[list[int]] = [[] for _ in range(batch)]
        self.max_new = max_new
        self.eos = set(eos.tolist())
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)

    def add(self, tokens: torch.Tensor, counts: torch.Tensor) -> list[list[int]]:
        """Row i's first counts[i] of tokens [B, n] (finished rows take none) -> the tokens each row took."""
        taken = []
        for i, (row, count) in enumerate(zip(tokens.tolist(), counts.tolist())):
            new: list[int] = []
            for token in row[:count] if not self.finished[i] else ():
                new.append(token)
                if token in self.eos or len(self.rows[i]) + len(new) == self.max_new:
                    self.finished[i] = True
                    break
            self.rows[i].extend(new)
            taken.append(new)
        return taken

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def room(self) -> torch.Tensor:
        """[B] tokens each row may still take (0 once finished)."""
        left = [0 if done else self.max_new - len(row) for row, done in zip(self.rows, self.finished.tolist())]
        return torch.tensor(left, device=self.finished.device)

    def padded(self, pad: int) -> torch.Tensor:
        """[B, longest row] with `pad` after each row's end."""
        longest = max(len(row) for row in self.rows)
        return torch.tensor([row + [pad] * (longest - len(row)) for row in self.rows], device=self.finished.device)


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


def speculate(decoder: Decoder, sampler: Sampler, last: torch.Tensor, draft_tokens: int, out: RowTokens,
              counts: DraftCounts) -> None:  # fmt: skip
    """One round after each row's token `last` [B]: up to `draft_tokens` sparse steps propose, one dense forward
    checks them all, and each unfinished row takes its own accepted drafts and the dense model's token after them
    (into `out`); the cache keeps, per row, the slots of what that row accepted."""
    room = out.room()
    active = room > 0
    gamma = min(draft_tokens, int(room.max()))
    base = decoder.decoded
    drafts, draft_probs = [last], []
    for _ in range(gamma):  # sparse steps propose
        token, probs = sampler.draw(decoder(drafts[-1][:, None])[:, -1])
        drafts.append(token)
        draft_probs.append(probs)
    decoder.rewind(base)
    decoder.cache.attend_densely = True  # one dense forward checks every proposal at once
    try:
        dense_logits = decoder(torch.stack(drafts, dim=1), all_logits=True)  # [B, gamma + 1, V]
    finally:
        decoder.cache.attend_densely = False
    agree, after = verify(sampler, drafts, draft_probs, dense_logits)
    rows = int(active.sum())
    counts.drafted += gamma * rows
    counts.accepted += int(agree[active].sum())
    counts.verifications += 1
    counts.rows_verified += rows
    # a row keeps the dense K/V of its last token and of its accepted drafts; a finished row, its last token only
    decoder.keep(torch.where(active, agree + 1, 1), gamma + 1)
    proposed = torch.stack([*drafts[1:], after], dim=1)  # [B, gamma + 1]
    proposed.scatter_(1, agree[:, None].long(), after[:, None])  # each row's own token right after its prefix
    out.add(proposed, torch.minimum(agree + 1, room))


#: `model.generate()` arguments a lossless generation takes; any other is refused, not ignored
_GENERATE_ARGUMENTS = ("input_ids", "inputs", "attention_mask", "max_new_tokens", "do_sample", "pad_token_id",
                       "eos_token_id", "streamer", "use_cache")  # fmt: skip


def generate_losslessly(model, config: SparseConfig, draft_tokens: int, counts: DraftCounts, args: tuple,
                        kwargs: dict) -> torch.Tensor:  # fmt: skip
    """`model.generate(input_ids, attention_mask=..., max_new_tokens=N, do_sample=False)` of an enabled model in
    lossless mode: greedy, token for token the dense model's output (each row of a left-padded batch advances by
    its own accepted drafts). Returns the prompt and the new tokens [B, prompt + new], as `generate` does; rows
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
        out = RowTokens(len(ids), max_new, eos, ids.device)
        latest = sampler.draw(logits)[0]
        taken = out.add(latest[:, None], torch.ones_like(latest))
        while True:
            if streamer is not None and taken[0]:
                streamer.put(torch.tensor(taken[0]))
            if out.done:
                break
            before = [len(row) for row in out.rows]
            speculate(decoder, sampler, latest, draft_tokens, out, counts)
            taken = [row[n:] for row, n in zip(out.rows, before)]
            # a row's next input is its latest token (finished rows: any token, their output is complete)
            latest = torch.tensor([row[-1] for row in out.rows], device=ids.device)
        if streamer is not None:
            streamer.end()
    return torch.cat([ids, out.padded(pad)], dim=1)
