"""Runs one task over several methods and budgets: JSON, a markdown table and a budget-quality plot.

Methods that are not registered in this build are listed as missing; a method that fails on a cell (bad option,
missing checkpoint...) is reported with its error and the run goes on. Dense-type methods run once: their value
fills every budget column. Each cell is cached like the single-task commands, so a rerun only computes what changed.

Under torchrun (`shard`: see eval.distributed) cell i of the comparison runs on rank i % world; every cell is computed
on its own (its own config, data and seeds), so the merged rows and runs, in the cells' order, equal one process's.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import CellNotCached, Progress, describe
from sparsekv.eval.distributed import SINGLE, Shard
from sparsekv.registry import available_methods, get_method_class, options_by_method

NOT_COMPUTED = "not computed yet"


@dataclass(frozen=True)
class TaskSpec:
    metric: str  # key of the headline value in the task payload
    label: str
    lower_is_better: bool
    fmt: str


TASK_SPECS = {
    "ppl": TaskSpec("ppl", "perplexity", True, "{:.2f}"),
    "niah": TaskSpec("score", "NIAH score", False, "{:.3f}"),
    "ruler": TaskSpec("score", "RULER score (string_match_all)", False, "{:.3f}"),
    "iou": TaskSpec("mean_iou", "IoU vs oracle top-k", False, "{:.3f}"),
    "fidelity": TaskSpec("rougeL", "Rouge-L F vs dense output", False, "{:.3f}"),
}


@dataclass
class CompareResult:
    task: str
    methods: list[str]
    budgets: list[int | float]
    missing: list[str]
    rows: list[dict] = field(default_factory=list)  # {"method", "budget", "value", "avg_budget_tokens", "error"}
    payloads: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"task": self.task, "metric": TASK_SPECS[self.task].metric, "methods": self.methods,
                "budgets": self.budgets, "missing_methods": self.missing, "rows": self.rows,
                "runs": self.payloads}  # fmt: skip


def run_compare(
    task: str,
    run_task: Callable[[SparseConfig], dict],
    methods: list[str],
    budgets: list[int | float],
    base: dict | None = None,
    options: dict | None = None,
    quiet: bool = True,
    shard: Shard = SINGLE,
) -> CompareResult:
    """`run_task(config) -> payload` runs one cell (cached by the task itself). With a `shard` of several ranks
    (a collective: every rank calls it with the same arguments) each rank runs its own cells and every rank gets
    the whole result, merged in the cells' order."""
    if task not in TASK_SPECS:
        raise ConfigError(f"compare supports tasks {', '.join(TASK_SPECS)}, got {task!r}")
    if not methods or not budgets:
        raise ConfigError("compare needs at least one method and one budget")
    known = set(available_methods())
    missing = [m for m in methods if m not in known]
    present = [m for m in methods if m in known]
    if not present:  # nothing would run: an empty table is not a result
        raise ConfigError(f"no method to compare: {', '.join(missing)} not registered; known: "
                          f"{', '.join(sorted(known))}")  # fmt: skip
    # options scoped to a method this build lacks go with it (reported as missing); the rest must each apply
    options_of = options_by_method(present, {k: v for k, v in (options or {}).items()
                                             if k.partition(":")[0] not in missing})  # fmt: skip
    base = dict(base or {})
    spec = TASK_SPECS[task]
    result = CompareResult(task=task, methods=present, budgets=list(budgets), missing=missing)
    jobs: list[tuple[str, int | float | None]] = []
    for method in present:
        dense = bool(get_method_class(method).dense)
        jobs.extend([(method, None)] if dense else [(method, b) for b in budgets])
    mine = [i for i in range(len(jobs)) if shard.owns(i)]
    done: dict[int, tuple[dict, dict | None]] = {}  # cell index -> (row, payload or None)
    with Progress(len(mine), f"compare {task}", quiet=quiet) as progress:
        for i in mine:
            method, budget = jobs[i]
            row = {"method": method, "budget": budget, "value": None, "avg_budget_tokens": None, "error": None}
            payload = None
            try:
                config = SparseConfig(method=method, budget=budgets[0] if budget is None else budget,
                                      options=options_of[method], **base)
                progress.label(describe(config))
                payload = run_task(config)
                row["value"] = payload.get(spec.metric)
                row["avg_budget_tokens"] = payload.get("avg_budget_tokens")
                row["avg_budget_fraction"] = payload.get("avg_budget_fraction")
            except CellNotCached:
                row["error"] = NOT_COMPUTED
            except Exception as error:  # noqa: BLE001 - one failing method must not end the comparison
                payload = None
                row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                if not isinstance(error, ConfigError):
                    row["traceback"] = traceback.format_exc(limit=6)
            done[i] = (row, payload)
            progress.advance(f"{method}: {row['value'] if row['error'] is None else 'error'}")
    if shard.world > 1:
        for part in shard.gather(done):
            done.update(part)
    for i in range(len(jobs)):  # the cells' order, whichever rank ran them
        row, payload = done[i]
        result.rows.append(row)
        if payload is not None:
            result.payloads.append(payload)
    return result


def markdown_table(result: CompareResult) -> str:
    """Methods x budgets; each cell 'value (tokens)' with the mean tokens attended per step in parentheses."""
    spec = TASK_SPECS[result.task]
    arrow = "lower is better" if spec.lower_is_better else "higher is better"
    header = [f"method ({spec.label}, {arrow})"] + [_budget_label(b) for b in result.budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in result.methods:
        cells = []
        for budget in result.budgets:
            row = next((r for r in result.rows if r["method"] == method and r["budget"] in (budget, None)), None)
            cells.append(_cell(row, spec))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    notes = []
    if result.missing:
        notes.append(f"not registered in this build: {', '.join(result.missing)}")
    pending = [f"{r['method']} @ {_budget_label(r['budget'])}" for r in result.rows if r["error"] == NOT_COMPUTED]
    if pending:
        notes.append(f"not run yet: {', '.join(pending)}")
    for row in result.rows:
        if row["error"] and row["error"] != NOT_COMPUTED:
            notes.append(f"{row['method']} @ {_budget_label(row['budget'])}: {row['error']}")
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return text


def _budget_label(budget) -> str:
    if budget is None:
        return "all"
    return f"budget {100 * budget:g}%" if isinstance(budget, float) else f"budget {budget} tok"


def _cell(row: dict | None, spec: TaskSpec) -> str:
    if row is None:
        return "-"
    if row["error"] == NOT_COMPUTED:
        return "not run"
    if row["error"]:
        return "error"
    if row["value"] is None:
        return "n/a"
    value = spec.fmt.format(row["value"])
    tokens = row.get("avg_budget_tokens")
    return value if tokens is None else f"{value} ({tokens:.0f} tok)"


def plot(result: CompareResult, path, title: str):
    from sparsekv.eval.plots import budget_curve

    spec = TASK_SPECS[result.task]
    return budget_curve(result.rows, path, spec.metric, title, lower_is_better=spec.lower_is_better)

