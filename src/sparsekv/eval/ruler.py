"""RULER-style synthetic long-context tasks, generated locally from a seed and scored exactly.

Tasks (every sample is a user message of at most `length` tokens, plus an answer prefix that starts the reply):
- niah_single: one "special magic number" for a key hidden in essay text; asked for that key's number.
- niah_multikey: four such needles with different keys; asked for one of them.
- niah_multivalue: four numbers for the same key at different places; asked for all of them.
- variable_tracking: a chain "VAR A = 12345. ... VAR B = VAR A. ..." hidden in repeated noise sentences; asked for
  every variable that holds the value.
- common_words: a numbered list where 10 words occur often and many others rarely; asked for the 10 common ones.
- freq_words: coded words with Zipf-like counts (count of the i-th word = round(K / i^2)); asked for the top three.

Scoring is RULER's `string_match_all`: the share of the reference answers found verbatim (case-insensitive) in the
generated text. A sample is a pure function of (seed, task, length, index, tokenizer, haystack): reruns are identical.
"""

from __future__ import annotations

import functools
import itertools
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import (
    NO_CACHE,
    ModelHandle,
    ResultCache,
    TaskRun,
    budget_summary,
    default_text,
    describe,
    digest,
    greedy,
    mean,
    sample_rng,
)
from sparsekv.eval.scoring import METRICS

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "freq_words")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"^[a-z]{4,10}$")


@dataclass(frozen=True)
class Sample:
    task: str
    length: int
    index: int
    context: str  # the user message: document + question
    answer_prefix: str  # appended after the (chat-formatted) prompt; the model continues it
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int

    def score(self, prediction: str) -> float:
        return METRICS[self.metric](prediction, list(self.answers))


@dataclass(frozen=True)
class Resources:
    """Filler sentences and a word pool, both derived deterministically from a text (default: the haystack)."""

    sentences: tuple[str, ...]
    words: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str) -> Resources:
        sentences = tuple(s.strip() for s in _SENTENCE_END.split(" ".join(text.split())) if s.strip())
        words = tuple(sorted({w for w in re.findall(r"[A-Za-z]+", text) if _WORD.match(w)}))
        if len(sentences) < 50 or len(words) < 200:
            raise ConfigError("the filler text is too short: need >= 50 sentences and >= 200 distinct words")
        return cls(sentences, words)


def _fit(build: Callable[[int], str], count_tokens: Callable[[str], int], lo: int, hi: int, length: int,
         what: str) -> int:  # fmt: skip
    """Largest n in [lo, hi] with count_tokens(build(n)) <= length (token counts grow with n)."""
    if count_tokens(build(lo)) > length:
        raise ConfigError(f"{length} tokens are too few for {what}; use a larger length")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(build(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _number(rng, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _key(rng, words: tuple[str, ...], taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in taken:
            taken.add(key)
            return key


def _insert(units: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """Places each (depth, text) between units at round(depth * len(units)); equal slots keep insert order."""
    out = list(units)
    for depth, text in sorted(inserts, key=lambda x: x[0], reverse=True):
        out.insert(round(depth * len(units)), text)
    return out


def _niah(task: str, rng, res: Resources) -> tuple[Callable[[int], str], tuple, str, int]:
    taken_keys: set[str] = set()
    taken_values: set[str] = set()
    if task == "niah_single":
        keys = [_key(rng, res.words, taken_keys)]
        values = [[_number(rng, taken_values)]]
    elif task == "niah_multikey":
        keys = [_key(rng, res.words, taken_keys) for _ in range(4)]
        values = [[_number(rng, taken_values)] for _ in keys]
    else:
        keys = [_key(rng, res.words, taken_keys)]
        values = [[_number(rng, taken_values) for _ in range(4)]]
    needles = [(rng.random(), f"One of the special magic numbers for {key} is: {value}.")
               for key, vals in zip(keys, values) for value in vals]  # fmt: skip
    asked = rng.randrange(len(keys))
    start = rng.randrange(len(res.sentences) // 2)
    key = keys[asked]
    if task == "niah_multivalue":
        question = f"What are all the special magic numbers for {key} mentioned in the text above?"
        prefix = f"The special magic numbers for {key} mentioned in the text above are"
    else:
        question = f"What is the special magic number for {key} mentioned in the text above?"
        prefix = f"The special magic number for {key} mentioned in the text above is"
    header = ("Some special magic numbers are hidden inside the following text. Memorize them: "
              "you will be asked about them afterwards.")  # fmt: skip

    def build(n: int) -> str:
        body = " ".join(_insert(list(res.sentences[start : start + n]), needles))
        return f"{header}\n{body}\n{question}"

    return build, tuple(values[asked]), prefix, len(res.sentences) - start


def _variable_tracking(rng, hops: int = 4):
    names: set[str] = set()
    chain = []
    while len(chain) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.add(name)
            chain.append(name)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain)]
    depths = sorted(rng.random() for _ in statements)
    question = (f"Find all variables that are assigned the value {value} in the text above, directly or through "
                "other variables.")  # fmt: skip
    prefix = f"Answer: the variables that hold the value {value} are:"
    header = "Memorize and track the chain of variable assignments hidden in the following text."

    def build(n: int) -> str:
        body = " ".join(_insert([NOISE] * n, list(zip(depths, statements))))
        return f"{header}\n{body}\n{question}"

    return build, tuple(chain), prefix


def _common_words(rng, res: Resources, count_tokens, length: int):
    pool = list(res.words)
    rng.shuffle(pool)
    common, rare = pool[:10], pool[10:]
    order_seed = rng.random()
    question = "What are the 10 most common words in the list above?"
    prefix = "Answer: the 10 words that appear most often in the list are:"
    header = "Below is a numbered list of words. Some of them appear many times."

    def builder(freq_common: int, freq_rare: int):
        def build(n: int) -> str:
            if n > len(rare):
                raise ConfigError("the word pool is too small for this length")
            items = common * freq_common + rare[:n] * freq_rare
            sample_rng(order_seed, n).shuffle(items)
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
            return f"{header}\n{listing}\n{question}"

        return build

    # RULER-like frequencies (common x30, rare x3) scaled down to what fits, keeping >= 10 rare words
    for freq_common, freq_rare in ((30, 3), (20, 3), (12, 2), (8, 2), (5, 1), (3, 1)):
        build = builder(freq_common, freq_rare)
        try:
            n = _fit(build, count_tokens, 10, len(rare), length, "common_words")
        except ConfigError:
            continue
        return build, n, tuple(common), prefix
    raise ConfigError(f"{length} tokens are too few for common_words; use a larger length")


def _freq_words(rng, count_tokens, length: int):
    question = ("What are the three most frequently appearing coded words in the text above? "
                "Do not explain.")  # fmt: skip
    prefix = "Answer: the three most frequent coded words are:"
    header = "Read the following coded text and track how often each coded word appears."
    vocab: list[str] = []
    seen: set[str] = set()
    order_seed = rng.random()

    def words_for(k: int) -> list[str]:
        while len(vocab) < k:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 6)))
            if word not in seen:
                seen.add(word)
                vocab.append(word)
        return vocab[:k]

    def build(k: int) -> str:
        words = words_for(k)
        items = [w for i, w in enumerate(words) for _ in range(max(1, round(k / (i + 1) ** 2)))]
        sample_rng(order_seed, k).shuffle(items)
        return f"{header}\n{' '.join(items)}\n{question}"

    top = max(16, min(4096, length))
    words_for(top)  # fix the vocabulary before fitting, so the fitted sample does not depend on the search path
    k = _fit(build, count_tokens, 16, top, length, "freq_words")
    return build, k, tuple(vocab[:3]), prefix


def generate_sample(task: str, length: int, index: int, seed: int, count_tokens: Callable[[str], int],
                    resources: Resources) -> Sample:  # fmt: skip
    """One sample of `task` whose user message has at most `length` tokens (as counted by `count_tokens`)."""
    if task not in TASKS:
        raise ConfigError(f"unknown ruler task {task!r}; tasks: {', '.join(TASKS)}")
    rng = sample_rng("ruler", seed, task, length, index)
    if task.startswith("niah"):
        build, answers, prefix, available = _niah(task, rng, resources)
        n = _fit(build, count_tokens, 0, min(available, length), length, task)
        new_tokens = 64 if task == "niah_multivalue" else 24
    elif task == "variable_tracking":
        build, answers, prefix = _variable_tracking(rng)
        n = _fit(build, count_tokens, 0, length, length, task)
        new_tokens = 32
    elif task == "common_words":
        build, n, answers, prefix = _common_words(rng, resources, count_tokens, length)
        new_tokens = 96
    else:
        build, n, answers, prefix = _freq_words(rng, count_tokens, length)
        new_tokens = 32
    return Sample(task=task, length=length, index=index, context=build(n), answer_prefix=" " + prefix.strip(),
                  answers=tuple(answers), metric="string_match_all", max_new_tokens=new_tokens)  # fmt: skip


def token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def run_ruler(
    handle: ModelHandle,
    config: SparseConfig,
    tasks: tuple[str, ...] = TASKS,
    lengths: tuple[int, ...] = (1000, 2000),
    samples: int = 4,
    seed: int = 0,
    chat: bool = True,
    filler: str | None = None,
    cache: ResultCache = NO_CACHE,
    quiet: bool = True,
) -> dict:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown ruler task(s) {unknown}; tasks: {', '.join(TASKS)}")
    if samples < 1 or not lengths or not tasks:
        raise ConfigError("ruler needs >= 1 sample, a length and a task")
    filler = default_text(filler)
    filler_id = digest(filler)
    resources = functools.cache(lambda: Resources.from_text(filler))
    cells = []
    grid = [(t, n, i) for t in tasks for n in lengths for i in range(samples)]
    with TaskRun("ruler", handle, cache, len(grid), f"ruler {describe(config)}", quiet=quiet) as run:
        for task, length, index in grid:
            fields = {"filler": filler_id, "task": task, "length": length, "index": index, "seed": seed,
                      "chat": chat}  # fmt: skip

            def compute(task=task, length=length, index=index):
                from sparsekv.models import chat_prompt

                tokenizer = handle.get_tokenizer()
                sample = generate_sample(task, length, index, seed, token_counter(tokenizer), resources())
                prompt = (chat_prompt(tokenizer, sample.context) if chat else sample.context) + sample.answer_prefix
                result = greedy(handle, config, prompt, sample.max_new_tokens, seed)
                return {
                    "answer": result.texts[0],
                    "answers": list(sample.answers),
                    "score": sample.score(result.texts[0]),
                    "avg_budget_tokens": result.avg_budget_tokens,
                    "avg_budget_fraction": result.avg_budget_fraction,
                    "new_tokens": result.new_tokens,
                }

            cell = {"task": task, "length": length, "index": index,
                    **run.cell(config, fields, compute, label=f"{task} {length} #{index}")}  # fmt: skip
            cells.append(cell)
            run.advance(f"{task} {length} #{index}: {cell['score']:.2f}")
    per_task = {t: {str(n): mean(c["score"] for c in cells if c["task"] == t and c["length"] == n) for n in lengths}
                for t in tasks}  # fmt: skip
    return run.payload(
        config,
        metric="string_match_all",
        tasks=list(tasks),
        lengths=list(lengths),
        samples=samples,
        seed=seed,
        score=mean(c["score"] for c in cells),
        score_by_task={t: mean(c["score"] for c in cells if c["task"] == t) for t in tasks},
        score_by_task_length=per_task,
        **budget_summary(cells),
        cells=cells,
    )
