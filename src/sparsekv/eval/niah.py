"""Needle in a haystack: a grid of context lengths x needle depths, greedy answers, one score per cell, heatmap.

Cell score (named in the output as `scorer`):
- "keyword-recall" (default): share of the needle's keywords found in the answer. For the default needle the keywords
  are "sandwich", "Dolores Park", "sunny"; for another needle pass them, else the needle's content words that the
  question does not contain are used.
- "rougeL-recall": Rouge-L recall of the needle sentence in the answer (rouge-score, stemmed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
)
from sparsekv.eval.haystack import NEEDLE, QUESTION, needle_prompt
from sparsekv.eval.scoring import default_keywords, keyword_recall, require_rouge, rougeL_recall

DEFAULT_KEYWORDS = ["sandwich", "Dolores Park", "sunny"]
SCORERS = ("keyword-recall", "rougeL-recall")


@dataclass(frozen=True)
class NiahSettings:
    lengths: tuple[int, ...] = (500, 1000, 2000, 3000)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle: str = NEEDLE
    question: str = QUESTION
    keywords: tuple[str, ...] = field(default=())
    scorer: str = "keyword-recall"
    max_new_tokens: int = 32
    chat: bool = True
    seed: int = 0

    def check(self) -> None:
        if not self.lengths or not self.depths:
            raise ConfigError("niah needs at least one length and one depth")
        if any(n < 16 for n in self.lengths):
            raise ConfigError(f"context lengths must be >= 16 tokens, got {list(self.lengths)}")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ConfigError(f"depths must be fractions in [0, 1], got {list(self.depths)}")
        if self.scorer not in SCORERS:
            raise ConfigError(f"scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")

    def resolved_keywords(self) -> list[str]:
        if self.keywords:
            return list(self.keywords)
        if self.needle == NEEDLE and self.question == QUESTION:
            return list(DEFAULT_KEYWORDS)
        return default_keywords(self.needle, self.question)


def score_answer(answer: str, settings: NiahSettings) -> dict:
    scores = {
        "keyword_recall": keyword_recall(answer, settings.resolved_keywords()),
        "rougeL_recall": rougeL_recall(answer, settings.needle),
    }
    scores["score"] = scores["keyword_recall" if settings.scorer == "keyword-recall" else "rougeL_recall"]
    return scores


def build_prompt(tokenizer, length: int, depth: float, settings: NiahSettings, haystack: str | None) -> str:
    from sparsekv.models import chat_prompt

    text = needle_prompt(tokenizer, length, depth, needle=settings.needle, question=settings.question,
                         haystack=haystack)  # fmt: skip
    return chat_prompt(tokenizer, text) if settings.chat else text


def run_niah(
    handle: ModelHandle,
    config: SparseConfig,
    settings: NiahSettings,
    haystack: str | None = None,
    haystack_name: str = "paul-graham-essays",
    cache: ResultCache = NO_CACHE,
    quiet: bool = True,
) -> dict:
    settings.check()
    require_rouge()  # every cell is also scored by Rouge-L recall: fail before the first cell, not after it
    haystack = default_text(haystack)
    hay_id = digest(haystack)
    cells = []
    grid = [(n, d) for n in settings.lengths for d in settings.depths]
    with TaskRun("niah", handle, cache, len(grid), f"niah {describe(config)}", quiet=quiet) as run:
        for length, depth in grid:
            fields = {"haystack": hay_id, "length": length, "depth": depth, "needle": settings.needle,
                      "question": settings.question, "max_new_tokens": settings.max_new_tokens,
                      "chat": settings.chat, "seed": settings.seed}  # fmt: skip

            def compute(length=length, depth=depth):
                tokenizer = handle.get_tokenizer()
                prompt = build_prompt(tokenizer, length, depth, settings, haystack)
                result = greedy(handle, config, prompt, settings.max_new_tokens, settings.seed)
                return {
                    "answer": result.texts[0],
                    "prompt_tokens": len(tokenizer(prompt, add_special_tokens=False).input_ids),
                    "avg_budget_tokens": result.avg_budget_tokens,
                    "avg_context_tokens": result.avg_context_tokens,
                    "avg_budget_fraction": result.avg_budget_fraction,
                    "new_tokens": result.new_tokens,
                    "decode_tokens_per_second": result.tokens_per_second,
                }

            cell = dict(run.cell(config, fields, compute, label=f"{length} tokens, depth {depth:.0%}"))
            cell.update(length=length, depth=depth, **score_answer(cell["answer"], settings))
            cells.append(cell)
            run.advance(f"{length}/{depth:.0%}: {cell['score']:.2f}")
    return run.payload(
        config,
        haystack=haystack_name,
        scorer=settings.scorer,
        keywords=settings.resolved_keywords() if settings.scorer == "keyword-recall" else None,
        needle=settings.needle,
        question=settings.question,
        lengths=list(settings.lengths),
        depths=list(settings.depths),
        score=mean(c["score"] for c in cells),
        score_by_length={str(n): mean(c["score"] for c in cells if c["length"] == n) for n in settings.lengths},
        **budget_summary(cells),
        cells=cells,
    )


def score_matrix(payload: dict):
    """[depths x lengths] numpy array of the cell scores (rows: depth top to bottom, columns: length)."""
    import numpy as np

    matrix = np.full((len(payload["depths"]), len(payload["lengths"])), np.nan)
    for cell in payload["cells"]:
        matrix[payload["depths"].index(cell["depth"]), payload["lengths"].index(cell["length"])] = cell["score"]
    return matrix
