"""Scorers. Every score is in [0, 1], higher is better, and has a name that the JSON outputs carry. The Rouge-L ones
need rouge-score, part of the eval extra (`pip install 'sparsekv[eval]'`).

- `rougeL_recall(prediction, reference)`: Rouge-L recall (rouge-score, Porter stemming): the share of the reference's
  tokens that appear, in order, in the prediction.
- `rougeL_f(prediction, reference)`: Rouge-L F-measure, symmetric; used for fidelity (sparse output vs dense output).
- `keyword_recall(prediction, keywords)`: share of the keywords found in the prediction (case-insensitive,
  punctuation-insensitive, matched at word starts so that "sandwich" also finds "sandwiches").
- `string_match_all(prediction, answers)`: RULER's exact scoring: share of the reference answers that occur in the
  prediction (case-insensitive substring).
- `string_match_part(prediction, answers)`: 1 if any reference answer occurs, else 0.
"""

from __future__ import annotations

import functools
import re

from sparsekv.eval.common import require_extra

_WORD = re.compile(r"\w+", re.UNICODE)


def require_rouge() -> None:
    """ConfigError naming the eval extra when rouge-score (the Rouge-L scorers) is not installed."""
    require_extra("rouge_score.rouge_scorer")


@functools.lru_cache(maxsize=1)
def _rouge():
    return require_extra("rouge_score.rouge_scorer").RougeScorer(["rougeL"], use_stemmer=True)


def rougeL(prediction: str, reference: str):
    """rouge-score's Score(precision, recall, fmeasure) of Rouge-L; (0, 0, 0) when either side has no tokens."""
    return _rouge().score(reference, prediction)["rougeL"]


def rougeL_recall(prediction: str, reference: str) -> float:
    return float(rougeL(prediction, reference).recall)


def rougeL_f(prediction: str, reference: str) -> float:
    if prediction.strip() == reference.strip():
        return 1.0  # identical outputs (also when neither has a word rouge-score can tokenize)
    return float(rougeL(prediction, reference).fmeasure)


def _normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def keyword_recall(prediction: str, keywords: list[str]) -> float:
    if not keywords:
        raise ValueError("keyword_recall needs at least one keyword")
    text = f" {_normalise(prediction)}"
    return sum(f" {_normalise(k)}" in text for k in keywords) / len(keywords)


def string_match_all(prediction: str, answers: list[str]) -> float:
    if not answers:
        raise ValueError("string_match_all needs at least one answer")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    if not answers:
        raise ValueError("string_match_part needs at least one answer")
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}

_STOP = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "by", "do", "for", "from", "has", "have", "in", "is", "it", "its", "of", "on", "or", "that", "the", "this", "to", "was", "were", "what", "when", "where", "which", "who", "why", "will", "with"]
)


def default_keywords(needle: str, question: str) -> list[str]:
    """The needle's content words that the question does not already contain: what an answer must bring back."""
    asked = set(_normalise(question).split())
    words = [w for w in _normalise(needle).split() if w not in asked and w not in _STOP]
    return list(dict.fromkeys(words))
