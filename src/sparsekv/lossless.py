"""Lossless decoding (self-speculation): sparse decode steps draft tokens, one dense forward over all of them
verifies, the agreeing prefix and the dense model's own next token are kept and the cache rolls the rest back.
Each row of a batch keeps its own agreeing prefix: the slots of the drafts a row rejected stay in the cache, masked
for that row (its attention mask has a 0 there, as for padding), and only the slots no row kept are rolled back.

Greedy, the output is the dense model's greedy output token for token; sampling, the speculative-sampling rule keeps
the dense model's distribution exactly. `sparsekv.generate(..., lossless=True)` runs it with sampling too;
`sparsekv.enable(model, config, lossless=True)` makes `model.generate()` itself decode this way (greedy).

The first round runs eagerly (`speculate`); on CUDA the later ones replay two CUDA graphs over a preallocated cache
(`CapturedRounds`), where the method allows, and `draft_tokens="auto"` sizes each of them from what it measured
(`best_draft_count`). `decode_rounds` runs the rounds for both entry points."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from sparsekv.cache import SparseCache, layer_infos
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.graph_decode import capture, forward_replaced
from sparsekv.hf_compat import cache_kwargs
from sparsekv.registry import get_method_class
from sparsekv.selectors.base import TokenSelector


@dataclass
class DraftCounts:
    """What the verifications of a lossless generation found (summed over the batch's unfinished rows)."""

    drafted: int = 0  # tokens proposed by the sparse steps
    accepted: int = 0  # of those, the ones the dense forward agreed with
    verifications: int = 0  # dense forwards
    rows_verified: int = 0  # unfinished rows over those forwards: each produced its accepted drafts + one token
    #: rounds per path: "eager: <why>", "graph" (CUDA graphs), "fixed-shape" (the same steps without graphs)
    paths: dict[str, int] = field(default_factory=dict)
    #: per round: (perf_counter() once its tokens are on the host, tokens the rows took, rows that were unfinished,
    #: whether it captured no graph and ran outside the profiler: a round that captures one, once per generation
    #: and step shape, is not steady)
    timeline: list[tuple[float, int, int, bool]] = field(default_factory=list)
    rejected: int = 0  # rows whose drafts met a rejection in a round (the others accepted every draft)
    #: fixed-shape rounds: seconds in draft steps and in verifications, and how many of each (CUDA events)
    draft_seconds: float = 0.0
    draft_steps: int = 0
    verify_seconds: float = 0.0
    verify_steps: int = 0
    #: rounds per number of drafts (`draft_tokens="auto"` chooses it round by round)
    drafts_per_round: dict[int, int] = field(default_factory=dict)
    #: CUDA: the graph-replayed round after that many timed ones runs under torch.profiler, its draft steps and
    #: its verification apart, and is left out of the timing (None: no profile)
    profile_after: int | None = None
    #: that round's kernels: "draft" and "verify" -> (torch.profiler's `key_averages()`, steps profiled)
    step_profiles: dict[str, tuple] = field(default_factory=dict)

    @property
    def draft_acceptance(self) -> float | None:
        """Each draft's chance of acceptance given the drafts before it were accepted: accepted drafts over
        accepted drafts and rejections (a round's drafts past its first rejection are never judged)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else None

    @property
    def draft_cost(self) -> float | None:
        """A draft step's time over a verification's (fixed-shape rounds), once both were timed."""
        if not (self.draft_steps and self.verify_steps and self.verify_seconds > 0):
            return None
        return (self.draft_seconds / self.draft_steps) / (self.verify_seconds / self.verify_steps)

    def count(self, path: str) -> None:
        self.paths[path] = self.paths.get(path, 0) + 1

    def add_round(self, gamma: int, agree: torch.Tensor, active: torch.Tensor, verdict: torch.Tensor | None = None):
        """One verification of `gamma` drafts: agree [B] the drafts each row took, active [B] the unfinished rows;
        `verdict` [B]: the drafts the verification accepted where a row took fewer (a sliding-window batch keeps
        its shortest accepted prefix). One device read."""
        verdict = agree if verdict is None else verdict
        rows, accepted, rejected = torch.stack([active.sum(), (agree * active).sum(),
                                                ((verdict < gamma) & active).sum()]).tolist()  # fmt: skip
        self.drafted += gamma * rows
        self.accepted += accepted
        self.rejected += rejected
        self.verifications += 1
        self.rows_verified += rows
        self.drafts_per_round[gamma] = self.drafts_per_round.get(gamma, 0) + 1

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
    """Each row's new tokens as the rounds produce them; a row finishes at an `eos` token or at `max_new`. Kept on
    the host (a round reads its tokens back once), so that following the rows costs no device reads."""

    def __init__(self, batch: int, max_new: int, eos: torch.Tensor, device: torch.device) -> None:
        self.rows: list[list[int]] = [[] for _ in range(batch)]
        self.max_new = max_new
        self.eos = set(eos.tolist())
        self.finished = [False] * batch
        self.device = device

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
        return all(self.finished)

    def room(self) -> torch.Tensor:
        """[B] tokens each row may still take (0 once finished), on the device."""
        left = [0 if done else self.max_new - len(row) for row, done in zip(self.rows, self.finished)]
        return torch.tensor(left, device=self.device)

    def padded(self, pad: int) -> torch.Tensor:
        """[B, longest row] with `pad` after each row's end."""
        longest = max(len(row) for row in self.rows)
        return torch.tensor([row + [pad] * (longest - len(row)) for row in self.rows], device=self.device)


#: `draft_tokens="auto"`: fixed-shape rounds choose how many tokens to draft, up to AUTO_MOST_DRAFTS, from the
#: measured acceptance and step times (`best_draft_count`); eager rounds, and fixed-shape ones until both steps are
#: timed, draft AUTO_EAGER_DRAFTS
AUTO_DRAFTS = "auto"
AUTO_MOST_DRAFTS = 8
AUTO_EAGER_DRAFTS = 4
#: the draft counts "auto" chooses from: every count is a verification graph of its own to capture (and its first
#: round is not timed), so a few counts serve the whole range
AUTO_DRAFT_CHOICES = (1, 2, 4, 8)
#: with "auto", a round that chose no drafts (plain dense steps) drafts one token every this many rounds, so that
#: the acceptance estimate follows the text at the cost of one draft step
AUTO_PROBE_EVERY = 16


def best_draft_count(acceptance: float, draft_cost: float, most: int) -> int:
    """The number of drafts (0 or one of AUTO_DRAFT_CHOICES up to `most`) that gives a row the most tokens per
    second: with each draft accepted with probability `acceptance` (given the ones before it), a round of g drafts
    yields (1 - a^(g+1)) / (1 - a) tokens (the accepted drafts and the verification's own token) and costs g draft
    steps and one verification, `draft_cost` being a draft step's time over a verification's. 0 is a plain dense
    step (one token a verification): drafting no longer pays."""
    best, best_rate = 0, 1.0
    for drafts in (d for d in AUTO_DRAFT_CHOICES if d <= most):
        tokens = drafts + 1.0 if acceptance >= 1 else (1 - acceptance ** (drafts + 1)) / (1 - acceptance)
        rate = tokens / (drafts * draft_cost + 1)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = drafts, rate
    return best


def lossless_refusal(name: str) -> str | None:
    """Why lossless decoding cannot draft with method `name` (None: it can)."""
    method = get_method_class(name)
    if method.dense or method.rewrites_prompt:
        return f"lossless decoding drafts with a sparse method; {name} decodes densely already"
    if method.stores_kv:  # the lossless cache keeps the 16-bit K/V beside its storage: `crop_stored` rolls it back
        if method.crop_stored is TokenSelector.crop_stored:
            return f"{name} keeps storage that cannot be rolled back, so rejected drafts cannot be undone"
    elif method.crop is TokenSelector.crop:
        return f"{name} keeps state that cannot be rolled back (it evicts for good), so rejected drafts cannot be undone"
    return None


def lossless_rounds(name: str) -> str:
    """How lossless decoding runs with method `name` on CUDA (what `sparsekv methods` lists): "captured" (the
    rounds after the first replay CUDA graphs), "eager", or "no: <why>"."""
    why = lossless_refusal(name)
    if why is not None:
        return f"no: {why}"
    method = get_method_class(name)
    return "captured" if method.fixed_shape and method.slot_state else "eager"


def check_lossless(config: SparseConfig, draft_tokens: int | str) -> None:
    why = lossless_refusal(config.method)
    if why is not None:
        raise ConfigError(why)
    if draft_tokens == AUTO_DRAFTS:
        return
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ConfigError(f"draft_tokens must be an int >= 1 or {AUTO_DRAFTS!r}, got {draft_tokens!r}")


def prefill(model, cache: SparseCache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            chunk_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """The (left-padded) prompt through the model into `cache` -> the last position's logits [B, V]; with
    `chunk_size`, that many tokens a forward (transformers' chunked prefill: the activations and masks are a
    chunk's, so a long prompt's batch is not bounded by them). The cache must know the prompt's length
    (`SparseCache.prompt_length`): its later chunks attend densely too."""
    length = input_ids.shape[1]
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    step = chunk_size or length
    for start in range(0, length, step):
        end = min(length, start + step)
        logits = model(
            input_ids=input_ids[:, start:end],
            attention_mask=attention_mask[:, :end],
            position_ids=positions[:, start:end],
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,  # the prompt's full-vocabulary logits would cost more than its attention
        ).logits
    return logits[:, -1]


def lossless_capacity(prompt_tokens: int, max_new: int, draft_tokens: int | str, graph_mode: bool | None,
                      device: torch.device) -> int:  # fmt: skip
    """Slots to allocate for a lossless generation's cache when its prompt is cached: where the rounds may run at
    fixed shapes (`CapturedRounds`: graph_mode True, or None on CUDA), room for every round to write its drafts' slots while a row
    gains one token a round, which the buffer that `decode_rounds` sizes after the first round stays within; else
    the prompt and the new tokens. Allocated at once, the buffers are not grown when the rounds begin: that copied
    the whole cache, and at 32K x B192 on an H200 the freed buffers, a little smaller than the grown ones, were left
    unused until a later generation's prefill ran out of memory."""
    if not (graph_mode is True or (graph_mode is None and device.type == "cuda")):
        return prompt_tokens + max_new
    most = AUTO_MOST_DRAFTS if draft_tokens == AUTO_DRAFTS else draft_tokens
    return prompt_tokens + max_new * (most + 1)


def speculate(decoder: Decoder, sampler: Sampler, last: torch.Tensor, draft_tokens: int, out: RowTokens,
              counts: DraftCounts) -> None:  # fmt: skip
    """One round after each row's token `last` [B]: up to `draft_tokens` sparse steps propose, one dense forward
    checks them all, and each unfinished row takes its own accepted drafts and the dense model's token after them
    (into `out`); the cache keeps, per row, the slots of what that row accepted. A model with sliding-window layers
    keeps its rows aligned instead: every row takes the batch's shortest accepted prefix."""
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
    verdict = agree
    if any(info.sliding for info in decoder.cache.infos):
        # a sliding window counts cache slots, masked ones too: the rows stay aligned at the batch's shortest
        # accepted prefix (a row that accepted more takes its accepted draft there: a valid token of its own)
        shortest = int(torch.where(active, agree, gamma).min())
        if shortest < gamma:
            after = torch.where(agree > shortest, drafts[shortest + 1], after)
        agree = torch.full_like(agree, shortest)
    counts.add_round(gamma, agree, active, verdict)
    # a row keeps the dense K/V of its last token and of its accepted drafts; a finished row, its last token only
    decoder.keep(torch.where(active, agree + 1, 1), gamma + 1)
    take(out, torch.stack(drafts[1:], dim=1), agree, after, room)


def take(out: RowTokens, drafts: torch.Tensor, agree: torch.Tensor, after: torch.Tensor, room: torch.Tensor) -> None:
    """Each row's first agree[i] drafts ([B, gamma]) and then its token `after` into `out`, within its room."""
    proposed = torch.cat([drafts, after[:, None]], dim=1)  # [B, gamma + 1]
    proposed.scatter_(1, agree[:, None].long(), after[:, None])  # each row's own token right after its prefix
    out.add(proposed, torch.minimum(agree + 1, room))


@dataclass
class _Round:
    """A lossless round queued on the device (`CapturedRounds.launch`): its number of drafts, its result's host copy
    [B, gamma + 3] (the tokens a row may take, how many it takes, how many drafts it accepted) once `ready`
    (a CUDA event; None off CUDA) has passed, its step clock, and whether it captured no graph and ran outside the
    profiler."""

    gamma: int
    result: torch.Tensor
    ready: object | None
    clock: _StepClock
    steady: bool


class CapturedRounds:
    """Lossless rounds at fixed shapes over a cache preallocated for the rest of the generation: the draft step
    (one token a row) and the verification (a row's last token and its drafts, attending densely) each replay one
    CUDA graph (`graph_decode.capture`; on CPU the same steps run without graphs). Nothing is rolled back: a round
    writes `draft_tokens + 1` slots, the verification rewrites the slots the drafts wrote (the methods' state is
    one entry per slot: `TokenSelector.slot_state`), and each row masks the drafts it rejected
    (`SparseCache.keep_slots`). One host read per round, which the next round does not wait for: each row's
    tokens and accepted drafts (`run`). A sliding-window
    layer counts its window in each row's own positions (`attention._window_start`), so rows of a hybrid model (Gemma 3)
    also take their own drafts here.

    step_forward: the forward both steps run (the model's own when None), e.g. its `torch.compile` version
    (`GraphDecode.step_forward` with compile_step)."""

    def __init__(self, model, decoder: Decoder, draft_tokens: int | str, capacity: int, out: RowTokens,
                 step_forward=None) -> None:  # fmt: skip
        self.model, self.cache = model, decoder.cache
        self.step_forward = step_forward
        self.auto = draft_tokens == AUTO_DRAFTS
        self.most = AUTO_MOST_DRAFTS if self.auto else draft_tokens
        cache = self.cache
        self.slot = cache.layers[0].length  # the next round's first slot
        cache.begin_fixed_shape(capacity, rows=True, compiled=step_forward is not None)
        cache.keep_slots(0, decoder.mask.bool())
        self.capacity = capacity
        self.positions = decoder.mask.sum(-1, keepdim=True)  # [B, 1]: each row's next position
        self.batch, self.device = decoder.mask.shape[0], decoder.mask.device
        self.draft_inputs = self._inputs(1)
        self.verify_inputs: dict[int, dict[str, torch.Tensor]] = {}  # per number of drafts
        self.offsets = torch.arange(self.most + 1, device=self.device)
        self.graphs: dict[str, tuple] = {}  # step name -> (graph, its output)
        self.path = "graph" if self.device.type == "cuda" else "fixed-shape"
        self.dense_rounds = 0  # rounds that chose no drafts (draft_tokens="auto")
        # on the device, where the rounds follow them without host reads: each row's latest token (a finished
        # row's: any), its room (tokens it may still take, 0 once finished) and the EOS tokens
        self.last = torch.tensor([row[-1] for row in out.rows], device=self.device)
        self.room = out.room()
        self.eos = torch.tensor(sorted(out.eos), dtype=torch.long, device=self.device)
        self.max_new = out.max_new

    def _inputs(self, tokens: int) -> dict[str, torch.Tensor]:
        zeros = torch.zeros(self.batch, tokens, dtype=torch.long, device=self.device)
        return {"input_ids": zeros, "position_ids": zeros.clone()}

    def _drafts(self, counts: DraftCounts) -> int:
        """This round's number of drafts: `draft_tokens`, or ("auto") `best_draft_count` of what was measured."""
        acceptance, cost = counts.draft_acceptance, counts.draft_cost
        if not self.auto:
            return self.most
        if acceptance is None or cost is None:
            return min(AUTO_EAGER_DRAFTS, self.most)
        drafts = best_draft_count(acceptance, cost, self.most)
        if drafts == 0:
            self.dense_rounds += 1
            if self.dense_rounds % AUTO_PROBE_EVERY == 0:
                return 1
        return drafts

    @staticmethod
    def refusal(cache: SparseCache, sampler: Sampler, graph_mode: bool | None) -> str | None:
        """Why the rounds of this generation run eagerly (None: they can run at fixed shapes)."""
        device = cache.layers[0].keys.device
        if graph_mode is False:
            return "graph_decode=False"
        if graph_mode is None and device.type != "cuda":
            return "no CUDA device"
        for layer in cache.layers:
            if layer.pruner is not None:
                return "top-p pruning"
            if layer.selector is not None and not layer.selector.slot_state:
                return f"{layer.selector.name} keeps state that a slot written again does not replace"
        return None

    def _step(self, name: str, inputs: dict, dense: bool) -> torch.Tensor:
        """The step's logits: the graph's replay, or on its first call the step itself (then captured)."""
        cache = self.cache

        def run():
            cache.attend_densely = dense
            own = self.step_forward is None
            try:
                cache.prepare_fixed_step()
                with contextlib.nullcontext() if own else forward_replaced(self.model, self.step_forward):
                    return self.model(**inputs, attention_mask=None, **cache_kwargs(self.model, cache),
                                      use_cache=True, logits_to_keep=0 if dense else 1)  # fmt: skip
            finally:
                cache.attend_densely = False

        if self.path == "fixed-shape":
            return run().logits
        if name in self.graphs:
            graph, output = self.graphs[name]
            graph.replay()
            return output.logits
        output, graph_output, graph, error = capture(run)
        if error is not None:
            raise ConfigError(f"lossless decoding: {error}; pass graph_decode=False to decode its rounds eagerly")
        self.graphs[name] = (graph, graph_output)
        return output.logits

    def run(self, sampler: Sampler, out: RowTokens, counts: DraftCounts, report) -> None:
        """Rounds until every row of `out` has finished; `report(before, steady)` after each one's tokens are in
        `out` (`before`: each row's token count until then). A round goes to the device before the host reads the
        previous one's tokens back, so the host's bookkeeping (taking the tokens, counting, streaming) overlaps the
        device's work instead of leaving it idle between rounds (H200, Gemma 3 270M at 32K x B192: a round of 8
        drafts took 34.3 ms for 31.9 ms of steps; queued ahead, 29.5 ms for 29.8). Not ahead of a round that may
        finish every row (it would be wasted), nor ahead of one that captures a graph or runs under the profiler
        (its timing would take in the earlier round's)."""
        pending = self.launch(sampler, counts, self._drafts(counts))
        while True:
            ahead = gamma = None
            if self._outlasts(pending, out):
                gamma = self._drafts(counts)
                if self._quiet(counts, gamma):
                    ahead = self.launch(sampler, counts, gamma)
            before = [len(row) for row in out.rows]
            self.finish(pending, out, counts)
            report(before, pending.steady)
            if out.done:  # a round launched ahead is left unread (only an EOS gets here): its rows had finished
                return
            if ahead is None:
                ahead = self.launch(sampler, counts, self._drafts(counts) if gamma is None else gamma)
            pending = ahead

    def _outlasts(self, pending: _Round, out: RowTokens) -> bool:
        """Whether some row certainly decodes past the round in flight (its EOS aside): its room exceeds what one
        round gives."""
        return any(not done and self.max_new - len(row) > pending.gamma + 1
                   for row, done in zip(out.rows, out.finished))  # fmt: skip

    def _quiet(self, counts: DraftCounts, gamma: int) -> bool:
        """Whether a round of `gamma` drafts replays graphs captured already and runs outside the profiler."""
        names = {f"verify{gamma}"} | ({"draft"} if gamma else set())
        return self.path != "graph" or (names <= self.graphs.keys() and not self._profiles(counts, gamma))

    def launch(self, sampler: Sampler, counts: DraftCounts, gamma: int) -> _Round:
        """A round of `gamma` drafts after each row's latest token, queued on the device without a host read:
        the rows' latest tokens, positions and room stay on the device, and what the host needs comes back in
        one copy that `finish` reads."""
        cache, start = self.cache, self.slot
        if start + gamma + 1 > self.capacity:
            raise ConfigError(f"lossless rounds ran out of their {self.capacity} preallocated slots")
        active = self.room > 0
        if gamma not in self.verify_inputs:
            self.verify_inputs[gamma] = self._inputs(gamma + 1)
        verify_inputs = self.verify_inputs[gamma]
        draft, verify_ids = self.draft_inputs["input_ids"], verify_inputs["input_ids"]
        draft[:, 0] = self.last
        verify_ids[:, 0] = self.last
        clock, graphs = _StepClock(self.device), len(self.graphs)
        profiled = _profiled if self._profiles(counts, gamma) else _unprofiled
        draft_probs = []
        with profiled(counts, "draft", gamma):
            for j in range(gamma):  # sparse steps propose, each at its slot
                cache.fixed_position.fill_(start + j)
                torch.add(self.positions, j, out=self.draft_inputs["position_ids"])
                token, probs = sampler.draw(self._step("draft", self.draft_inputs, dense=False)[:, -1])
                draft_probs.append(probs)
                draft[:, 0] = token
                verify_ids[:, j + 1] = token
        clock.mark()
        cache.fixed_position.fill_(start)  # one dense forward checks them, rewriting their slots
        torch.add(self.positions, self.offsets[: gamma + 1], out=verify_inputs["position_ids"])
        with profiled(counts, "verify", 1):
            dense_logits = self._step(f"verify{gamma}", verify_inputs, dense=True)  # [B, gamma + 1, V]
        clock.mark()
        drafts = verify_ids[:, 1:]
        if gamma:
            agree, after = verify(sampler, list(verify_ids.unbind(1)), draft_probs, dense_logits)
        else:  # a plain dense step
            agree, after = torch.zeros_like(self.last), sampler.draw(dense_logits[:, 0])[0]
        agree = torch.where(active, agree, 0)  # a finished row keeps its last token's slot only
        cache.keep_slots(start, self.offsets[: gamma + 1] <= agree[:, None])
        self.positions += agree[:, None] + 1
        self.slot = start + gamma + 1
        for layer in cache.layers:
            layer.length = self.slot
        # each row's accepted drafts, then the dense model's token: what the row takes, within its room; a row
        # finishes there, or at an EOS among them
        tokens = torch.cat([drafts, after[:, None]], dim=1)
        tokens.scatter_(1, agree[:, None].long(), after[:, None])
        taken = torch.minimum(agree + 1, self.room)
        ended = (torch.isin(tokens, self.eos) & (self.offsets[: gamma + 1] < taken[:, None])).any(-1)
        self.room = torch.where(ended, 0, self.room - taken)
        self.last = after
        # [B, gamma + 3]: the tokens, how many the row takes, how many drafts it accepted
        result = torch.cat([tokens, taken[:, None], agree[:, None]], dim=1).long()
        host = torch.empty(result.shape, dtype=result.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        steady = len(self.graphs) == graphs and profiled is _unprofiled
        return _Round(gamma, host, ready, clock, steady)

    def finish(self, pending: _Round, out: RowTokens, counts: DraftCounts) -> None:
        """The round's tokens into `out` and its counts into `counts` (waits for the device)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        gamma, result = pending.gamma, pending.result
        active = torch.tensor([not done for done in out.finished])
        out.add(result[:, : gamma + 1], result[:, gamma + 1])
        counts.add_round(gamma, result[:, gamma + 2], active)
        counts.count(self.path)
        if pending.steady:  # a round that captured a graph, or ran under the profiler, is not timed
            drafting, verifying = pending.clock.seconds()
            if gamma:
                counts.draft_seconds += drafting
                counts.draft_steps += gamma
            counts.verify_seconds += verifying
            counts.verify_steps += 1

    def _profiles(self, counts: DraftCounts, gamma: int) -> bool:
        """Whether this round runs under the profiler (`DraftCounts.profile_after`): its graphs are captured
        already (a capture is not what a round costs), once per generation."""
        return (counts.profile_after is not None and not counts.step_profiles and self.path == "graph" and gamma > 0
                and counts.verify_steps >= counts.profile_after and {"draft", f"verify{gamma}"} <= self.graphs.keys())  # fmt: skip


@contextlib.contextmanager
def _profiled(counts: DraftCounts, name: str, steps: int):
    """The device work of the block under torch.profiler; its kernel averages land in `counts.step_profiles`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    counts.step_profiles[name] = (prof.key_averages(), steps)


@contextlib.contextmanager
def _unprofiled(counts: DraftCounts, name: str, steps: int):
    yield


class _StepClock:
    """Times between marks of a round's device work: CUDA events on a GPU (read once the round has synchronised),
    the host clock elsewhere (the steps run synchronously there)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.marks.append(self._now())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


def decode_rounds(model, decoder: Decoder, sampler: Sampler, first: torch.Tensor, out: RowTokens,
                  draft_tokens: int | str, counts: DraftCounts, graph_mode: bool | None, on_tokens=None,
                  step_forward=None) -> None:  # fmt: skip
    """Lossless rounds after the prompt's token `first` [B] (already in `out`) until every row has finished: the
    first round eagerly (its draft steps complete the methods' state from the prompt), the others at fixed
    shapes (`CapturedRounds`) where they can run so, else eagerly too; `counts.paths` says how each ran.
    `on_tokens(taken)`: each row's new tokens after every round. `graph_mode`: as `enable`'s graph_decode; the
    model's own graph decoding (`GraphDecode`) must be off while the rounds run (`lossless_forwards`).
    `step_forward`: the forward of the fixed-shape rounds (`CapturedRounds`; None: the model's own)."""
    cache = decoder.cache
    cache.fallback_threshold = 0  # drafts are sparse: a dense fallback would make them the verification's twin

    def report(before: list[int], steady: bool) -> None:
        taken = [row[n:] for row, n in zip(out.rows, before)]
        active = sum(n < out.max_new for n in before)  # an EOS row is counted until its round
        counts.timeline.append((time.perf_counter(), sum(map(len, taken)), active, steady))
        if on_tokens is not None:
            on_tokens(taken)

    latest, why = first, "first round"
    try:
        while not out.done:
            before = [len(row) for row in out.rows]
            speculate(decoder, sampler, latest, AUTO_EAGER_DRAFTS if draft_tokens == AUTO_DRAFTS else draft_tokens,
                      out, counts)  # fmt: skip
            counts.count(f"eager: {why}")
            report(before, True)
            why = CapturedRounds.refusal(cache, sampler, graph_mode)
            if why is None and not out.done:
                most = AUTO_MOST_DRAFTS if draft_tokens == AUTO_DRAFTS else draft_tokens
                capacity = cache.layers[0].length + int(out.room().max()) * (most + 1)
                CapturedRounds(model, decoder, draft_tokens, capacity, out, step_forward).run(sampler, out, counts,
                                                                                           report)  # fmt: skip
                return
            latest = torch.tensor([row[-1] for row in out.rows], device=first.device)  # finished rows: any token
    finally:
        cache.end_fixed_shape()


#: `model.generate()` arguments a lossless generation takes; any other is refused, not ignored
_GENERATE_ARGUMENTS = ("input_ids", "inputs", "attention_mask", "max_new_tokens", "do_sample", "pad_token_id",
                       "eos_token_id", "streamer", "use_cache", "prefill_chunk_size")  # fmt: skip


def generate_losslessly(model, config: SparseConfig, draft_tokens: int | str, counts: DraftCounts, args: tuple,
                        kwargs: dict, graph_mode: bool | None = None, step_forward=None) -> torch.Tensor:  # fmt: skip
    """`model.generate(input_ids, attention_mask=..., max_new_tokens=N, do_sample=False)` of an enabled model in
    lossless mode: greedy, token for token the dense model's output (each row of a left-padded batch advances by
    its own accepted drafts). Returns the prompt and the new tokens [B, prompt + new], as `generate` does; rows
    that finished (EOS) are padded with `pad_token_id`. `counts` adds up the rounds' drafts. `graph_mode` and
    `step_forward`: as `decode_rounds`'s."""
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
    chunk = kwargs.get("prefill_chunk_size", getattr(generation, "prefill_chunk_size", None))
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"prefill_chunk_size must be an int >= 1, got {chunk!r}")
    # a compressing method (self-index) drafts from its own storage; the dense verification reads the 16-bit K/V
    capacity = lossless_capacity(ids.shape[1], max_new, draft_tokens, graph_mode, ids.device)
    cache = SparseCache(config, layer_infos(model), initial_capacity=capacity,
                        prompt_length=ids.shape[1], keeps_plain_kv=True)  # fmt: skip
    with torch.inference_mode():
        if streamer is not None:
            streamer.put(ids.cpu())
        logits = prefill(model, cache, ids, mask, chunk)
        decoder, sampler = Decoder(model, cache, mask), Sampler(None, None, ids.device)
        out = RowTokens(len(ids), max_new, eos, ids.device)
        first = sampler.draw(logits)[0]

        def stream(taken: list[list[int]]) -> None:
            if streamer is not None and taken[0]:
                streamer.put(torch.tensor(taken[0]))

        stream(out.add(first[:, None], torch.ones_like(first)))
        decode_rounds(model, decoder, sampler, first, out, draft_tokens, counts, graph_mode, stream, step_forward)
        if streamer is not None:
            streamer.end()
    return torch.cat([ids, out.padded(pad)], dim=1)
