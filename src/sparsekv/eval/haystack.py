"""Needle-in-a-haystack prompts built from the embedded Paul Graham essays."""

from __future__ import annotations

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"


def insert_needle(tokenizer, haystack: str, needle: str, context_tokens: int, depth: float) -> str:
    """`context_tokens` tokens of haystack with the needle placed at `depth` (0 = start, 1 = end), at the
    sentence boundary nearest below that depth so the needle does not cut a sentence."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle_ids = tokenizer.encode(" " + needle, add_special_tokens=False)
    budget = max(0, context_tokens - len(needle_ids))
    ids = tokenizer.encode(haystack, add_special_tokens=False)
    if len(ids) < budget:
        raise ValueError(f"the haystack has {len(ids)} tokens, fewer than the {budget} asked for")
    ids = ids[:budget]
    cut = round(depth * len(ids))
    before = tokenizer.decode(ids[:cut])
    after = tokenizer.decode(ids[cut:])
    boundary = before.rfind(". ")
    if 0 < boundary and depth < 1:
        after = before[boundary + 2 :] + after
        before = before[: boundary + 1]
    return f"{before} {needle} {after}".strip()


def needle_prompt(
    tokenizer,
    context_tokens: int,
    depth: float,
    needle: str = NEEDLE,
    question: str = QUESTION,
    haystack: str | None = None,
) -> str:
    """The user message of a needle test: document, then the question."""
    if haystack is None:
        from sparsekv.assets import haystack_text

        haystack = haystack_text()
    document = insert_needle(tokenizer, haystack, needle, context_tokens, depth)
    return f"{document}\n\nAnswer from the text above. {question}"


def read_haystack_dir(folder) -> str:
    """All .txt files of `folder` concatenated in sorted name order, separated by blank lines (like the essays)."""
    from pathlib import Path

    files = sorted(Path(folder).expanduser().glob("*.txt"), key=lambda p: p.name)
    if not files:
        from sparsekv.config import ConfigError

        raise ConfigError(f"no .txt files in haystack dir {folder}")
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files)
