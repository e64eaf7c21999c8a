"""Fidelity: how close a method's greedy output stays to the dense model's greedy output on the same prompts.

Score per prompt: Rouge-L F-measure (rouge-score, stemmed) of the method's output against the dense output; also
`exact` = 1 when the two texts are identical. Prompts come from a file (.jsonl with a "prompt" field per line, .json
list of strings or of {"prompt": ...}, or plain text with one prompt per non-empty line) or, by default, are built
from the embedded essays: a passage of `context` tokens followed by an instruction.
"""

from __future__ import annotations

import json
from pathlib import Path

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
from sparsekv.eval.scoring import require_rouge, rougeL_f

INSTRUCTIONS = (
    "Summarize the text above in three sentences.",
    "What is the main argument of the text above? Answer briefly.",
    "List three specific claims the author makes in the text above.",
    "Write a short title for the text above and explain it in one sentence.",
)


def read_prompts(path: Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        data = json.loads(text)
        prompts = [item["prompt"] if isinstance(item, dict) else item for item in data]
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError(f"{path} holds no prompts (need non-empty strings)")
    return prompts


def default_prompts(tokenizer, samples: int, context: int, text: str | None = None) -> list[str]:
    """`samples` prompts: passages of `context` tokens spread over the essays, each with an instruction."""
    ids = tokenizer(default_text(text), add_special_tokens=False).input_ids
    stride = max(context, (len(ids) - context) // max(samples, 1))
    prompts = []
    for i in range(samples):
        lo = i * stride
        if lo + context > len(ids):
            raise ConfigError(f"the text is too short for {samples} passages of {context} tokens")
        passage = tokenizer.decode(ids[lo : lo + context])
        prompts.append(f"{passage}\n\n{INSTRUCTIONS[i % len(INSTRUCTIONS)]}")
    return prompts


def _generate_cell(handle: ModelHandle, config: SparseConfig, prompt: str, chat: bool, max_new_tokens: int,
                   seed: int) -> dict:  # fmt: skip
    from sparsekv.models import chat_prompt

    text = chat_prompt(handle.get_tokenizer(), prompt) if chat else prompt
    result = greedy(handle, config, text, max_new_tokens, seed)
    return {"output": result.texts[0], "avg_budget_tokens": result.avg_budget_tokens,
            "avg_budget_fraction": result.avg_budget_fraction, "new_tokens": result.new_tokens}  # fmt: skip


def run_fidelity(
    handle: ModelHandle,
    config: SparseConfig,
    prompts: list[str] | None = None,
    prompts_name: str = "haystack passages",
    samples: int = 4,
    context: int = 1000,
    max_new_tokens: int = 48,
    chat: bool = True,
    seed: int = 0,
    cache: ResultCache = NO_CACHE,
    quiet: bool = True,
) -> dict:
    require_rouge()  # the metric: fail before the first generation, not after it
    if prompts is None:
        prompts = default_prompts(handle.get_tokenizer(), samples, context)
    dense = SparseConfig(method="dense")
    cells = []
    # the cells are plain generations (task "generate"): the dense ones are shared by every method's run
    with TaskRun("fidelity", handle, cache, len(prompts), f"fidelity {describe(config)}", quiet=quiet,
                 cells="generate") as run:  # fmt: skip
        for i, prompt in enumerate(prompts):
            fields = {"prompt": digest(prompt), "chat": chat, "max_new_tokens": max_new_tokens, "seed": seed}
            outputs = {}
            for name, cfg in (("dense", dense), ("method", config)):

                def compute(cfg=cfg, prompt=prompt):
                    return _generate_cell(handle, cfg, prompt, chat, max_new_tokens, seed)

                outputs[name] = run.cell(cfg, fields, compute)
            out, ref = outputs["method"]["output"], outputs["dense"]["output"]
            cells.append({"index": i, "output": out, "dense_output": ref, "rougeL": rougeL_f(out, ref),
                          "exact": float(out.strip() == ref.strip()),
                          "avg_budget_tokens": outputs["method"]["avg_budget_tokens"],
                          "avg_budget_fraction": outputs["method"]["avg_budget_fraction"],
                          "new_tokens": outputs["method"]["new_tokens"]})  # fmt: skip
            run.advance(f"#{i}: {cells[-1]['rougeL']:.2f}")
    return run.payload(
        config,
        prompts=prompts_name,
        metric="rougeL_f vs dense output",
        score=mean(c["rougeL"] for c in cells),
        rougeL=mean(c["rougeL"] for c in cells),
        exact=mean(c["exact"] for c in cells),
        **budget_summary(cells),
        cells=cells,
    )
