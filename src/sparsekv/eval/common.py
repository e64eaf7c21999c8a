"""What every evaluation task shares: lazy model loading, config keys, the per-cell result cache, progress, and the
skeleton a task runs on them (`TaskRun`: cells keyed and cached, one progress bar, the payload header; the text
windows and the sparse forward passes of the window tasks; the seeded greedy generation of the prompt tasks). A task
module keeps only what is its own: its data, its cell's computation and its metric."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Self

import torch

import sparsekv
from sparsekv.cache import SparseCache
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.registry import TOP_P_PRUNER, get_method_class

#: bump when a task's protocol changes so that cached cells of the old protocol are not reused
PROTOCOL_VERSION = 1


# ------------------------------------------------------------------------------------------------ model handle


@dataclass
class ModelHandle:
    """A model spec that loads on first use, so fully cached runs never pay for loading the model.

    Pass `model`/`tokenizer` to wrap objects already in memory (tests, notebooks); `name` then keys the cache.
    """

    spec: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    model: Any = None
    tokenizer: Any = None
    name: str | None = None

    def get(self) -> tuple[Any, Any]:
        if self.model is None:
            from sparsekv.models import load_model  # late: transformers loads only when a model is needed

            self.model, self.tokenizer = load_model(self.spec, dtype=self.dtype, device=self.device)
        return self.model, self.tokenizer

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.get()
        return self.tokenizer

    @property
    def label(self) -> str:
        """The model as the JSON outputs name it."""
        return self.spec if self.name is None else self.name

    @property
    def key(self) -> dict:
        """Identifies the model in cache keys: the spec plus, for local files/dirs, their size and mtime."""
        if self.name is not None:
            return {"model": self.name, "dtype": self.dtype}
        path = Path(self.spec).expanduser()
        stamp = None
        if path.exists():
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
            stamp = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]
        return {"model": self.spec, "dtype": self.dtype, "files": stamp}


# ------------------------------------------------------------------------------------------------ config keys


def _source_digest(target: str | type) -> str:
    try:
        if isinstance(target, str):
            from sparsekv.registry import load

            target = load(target)
        text = Path(inspect.getsourcefile(target)).read_bytes()
    except (OSError, TypeError, ModuleNotFoundError, AttributeError):
        return "unavailable"
    return hashlib.sha256(text).hexdigest()[:12]


def is_dense(config: SparseConfig) -> bool:
    return bool(get_method_class(config.method).dense)


def config_key(config: SparseConfig) -> dict:
    """A JSON-able identity of a config, including a digest of the method's source file (and of the top-p
    pruner's when it is used), so an edited method never reuses stale cached cells. A dense config reduces to
    {"method": "dense"}: its budget and options change nothing."""
    cls = get_method_class(config.method)
    # a prompt filter (GemFilter) decodes densely but its options change the output: only a plain dense method
    # may drop them from the key
    if cls.dense and not cls.rewrites_prompt:
        return {"method": config.method}
    key = {
        "method": config.method,
        "budget": config.budget,
        "top_p": config.top_p,
        "dense_layers": list(config.dense_layers),
        "sink": config.sink,
        "local": config.local,
        "gqa": config.gqa,
        "options": {k: config.options[k] for k in sorted(config.options)},
        "source": _source_digest(cls),
    }
    if config.top_p is not None and not cls.consumes_top_p:
        key["pruner_source"] = _source_digest(TOP_P_PRUNER)
    files = _file_stamps([v for v in config.options.values() if isinstance(v, str)])
    if files:
        key["option_files"] = files
    key["data"] = _data_stamp(config.method, cls.__module__.rsplit(".", 1)[-1])
    return key


def _file_stamps(values: list[str]) -> list:
    """(name, size, mtime) of option values that are existing files (checkpoints), so a retrained one counts."""
    stamps = []
    for value in values:
        path = Path(value).expanduser()
        if len(value) < 1024 and path.is_file():
            stat = path.stat()
            stamps.append((str(path.resolve()), stat.st_size, int(stat.st_mtime)))
    return stamps


def _data_stamp(*prefixes: str) -> str:
    """Digest of the names, sizes and mtimes of the method's shipped files in sparsekv/data (checkpoints that
    options like checkpoint="auto" pick up), found by name: they start with the method or module name
    (e.g. spotlight-smollm2-135m.safetensors). "none" when the method ships nothing."""
    folder = Path(__file__).resolve().parent.parent / "data"
    if not folder.is_dir():
        return "none"
    names = tuple({p.lower() for p in prefixes} | {p.lower().replace("-", "_") for p in prefixes})
    entries = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(folder.rglob("*"))
               if p.is_file() and p.name.lower().startswith(names)]  # fmt: skip
    return digest(entries) if entries else "none"


def describe(config: SparseConfig) -> str:
    """Short human label: 'quest@0.02', 'twilight@0.25 p=0.9', 'dense'."""
    if is_dense(config):
        return config.method
    budget = config.budget
    label = f"{config.method}@{budget:g}" if isinstance(budget, float) else f"{config.method}@{budget}"
    if config.top_p is not None:
        label += f" p={config.top_p:g}"
    if config.options:
        label += " " + ",".join(f"{k}={v}" for k, v in sorted(config.options.items()))
    return label


def config_dict(config: SparseConfig) -> dict:
    """What the JSON outputs report about a config: the settings given, and in `effective_options` every option
    the method ran with (its defaults included, e.g. twilight's base and p)."""
    return {
        "method": config.method,
        "budget": None if is_dense(config) else config.budget,
        "top_p": config.top_p,
        "dense_layers": list(config.dense_layers),
        "sink": config.sink,
        "local": config.local,
        "gqa": config.gqa,
        "options": dict(config.options),
        "effective_options": get_method_class(config.method).effective_options(config),
    }


# ------------------------------------------------------------------------------------------------ result cache


def default_cache_dir() -> Path:
    from sparsekv.assets import cache_dir

    return cache_dir() / "eval"


def digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CellNotCached(RuntimeError):
    """A cell that an only-cached run did not find."""


@dataclass
class ResultCache:
    """One JSON file per evaluated cell under root/<task>/<digest of its key>.json; root None disables it.

    A cell is written atomically when it finishes, so an interrupted run resumes at the first missing cell.
    """

    root: Path | None
    hits: int = 0
    misses: int = 0
    #: report a missing cell (CellNotCached) instead of computing it: assembles tables from finished work
    only_cached: bool = False
    #: with only_cached: also accept a cell computed with an older version of the method's code/checkpoint
    #: (same key apart from the source/data stamps); the newest such cell is used and counted in `stale`
    stale_ok: bool = False
    stale: int = 0

    def path(self, task: str, key: dict) -> Path | None:
        if self.root is None:
            return None
        return self.root / task / f"{digest({'protocol': PROTOCOL_VERSION, 'task': task, **key})}.json"

    def get(self, task: str, key: dict) -> dict | None:
        path = self.path(task, key)
        if path is None or not path.is_file():
            self.misses += 1
            return None
        try:
            result = json.loads(path.read_text())["result"]
        except (OSError, ValueError, KeyError):
            self.misses += 1
            return None
        self.hits += 1
        return result

    def _stale_match(self, task: str, key: dict) -> dict | None:
        if self.root is None or not (self.root / task).is_dir():
            return None
        wanted = _without_stamps(json.loads(json.dumps(key, default=str)))
        for path in sorted((self.root / task).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if _without_stamps(stored.get("key", {})) == wanted:
                return stored["result"]
        return None

    def put(self, task: str, key: dict, result: dict) -> None:
        path = self.path(task, key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "result": result}, indent=1, default=str) + "\n")
        tmp.replace(path)

    def cached(self, task: str, key: dict, compute: Callable[[], dict]) -> dict:
        hit = self.get(task, key)
        if hit is not None:
            return hit
        if self.only_cached:
            if self.stale_ok:
                older = self._stale_match(task, key)
                if older is not None:
                    self.stale += 1
                    return older
            raise CellNotCached(f"{task} cell not computed yet (--only-cached)")
        result = compute()
        self.put(task, key, result)
        return result


NO_CACHE = ResultCache(None)

_STAMPS = ("source", "pruner_source", "data")


def _without_stamps(key: dict) -> dict:
    out = dict(key)
    if isinstance(out.get("config"), dict):
        out["config"] = {k: v for k, v in out["config"].items() if k not in _STAMPS}
    return out


# ------------------------------------------------------------------------------------------------ misc


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sample_rng(*parts: Any) -> random.Random:
    """A random.Random seeded from the parts' text (stable across runs and Python hash seeds)."""
    return random.Random(":".join(str(p) for p in parts))


def mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def weighted_budget(parts: list[tuple[float | None, int]]) -> float | None:
    """Mean of per-run avg budgets weighted by their row counts (None entries are dense runs)."""
    total = sum(n for b, n in parts if b is not None)
    if total == 0:
        return None
    return sum(b * n for b, n in parts if b is not None) / total


@dataclass
class Progress:
    """A rich progress bar (or nothing when quiet); `advance(label)` after each cell."""

    total: int
    description: str
    quiet: bool = False
    _progress: Any = field(default=None, init=False)
    _task: Any = field(default=None, init=False)

    def __enter__(self) -> Self:
        if not self.quiet:
            from rich import get_console  # the CLI's console (`sparsekv.cli_options.console`)
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[label]}"),
                console=get_console(), transient=False,
            )  # fmt: skip
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, label="")
        return self

    def label(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, label=text)

    def advance(self, text: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, label=text)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


# ------------------------------------------------------------------------------------------------ optional extras

EVAL_EXTRA = "this needs the eval extra: pip install 'sparsekv[eval]'"


def require_extra(module: str) -> ModuleType:
    """Imports `module` of a package of the eval extra (matplotlib, rouge_score); when the package is not installed,
    a ConfigError whose message is the install line (the CLI prints it as one line; the ModuleNotFoundError that
    names the package is its cause)."""
    package = module.partition(".")[0]
    try:
        importlib.import_module(package)  # first: a submodule imported earlier would hide a package gone since
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.partition(".")[0] != package:
            raise  # the package is there but something it needs is missing: not the extra's business
        raise ConfigError(EVAL_EXTRA) from error


# ------------------------------------------------------------------------------------------------ the task skeleton


def default_text(text: str | None) -> str:
    """`text`, else the embedded Paul Graham essays: every task's default data."""
    if text is not None:
        return text
    from sparsekv.assets import haystack_text

    return haystack_text()


class TaskRun:
    """The loop of a task: cells keyed by the model, the cell's own fields and the config, each computed through
    the result cache (`compute` runs only on a miss, so a fully cached run never loads the model), one progress
    bar over them, and the header of the task's JSON payload.

        with TaskRun("niah", handle, cache, len(grid), f"niah {describe(config)}", quiet) as run:
            for length, depth in grid:
                cell = run.cell(config, {"length": length, ...}, compute, label=f"{length} tokens")
                run.advance(f"{length}: {score:.2f}")
        return run.payload(config, score=...)

    `cells` names the result-cache folder when it is not the task's own (fidelity stores plain generations).
    """

    def __init__(self, task: str, handle: ModelHandle, cache: ResultCache = NO_CACHE, total: int = 0,
                 description: str | None = None, quiet: bool = True, cells: str | None = None):  # fmt: skip
        self.task = task
        self.handle = handle
        self.cache = cache
        self.cells = cells or task
        self.progress = Progress(total, description or task, quiet=quiet)

    def __enter__(self) -> Self:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def cell(self, config: SparseConfig, fields: dict, compute: Callable[[], dict], label: str | None = None) -> dict:
        """The cached result of one cell; its key is {model..., **fields, "config": config_key(config)}."""
        if label is not None:
            self.progress.label(label)
        key = {**self.handle.key, **fields, "config": config_key(config)}
        return self.cache.cached(self.cells, key, compute)

    def advance(self, text: str = "") -> None:
        self.progress.advance(text)

    def payload(self, config: SparseConfig, **fields: Any) -> dict:
        """The task's JSON: task, model and config first, then the task's own fields."""
        return {"task": self.task, "model": self.handle.label, "config": config_dict(config), **fields}


def budget_summary(cells: list[dict], weight: str = "new_tokens",
                   names: tuple[str, ...] = ("avg_budget_tokens", "avg_budget_fraction")) -> dict:  # fmt: skip
    """The cells' budgets (`names`), each a mean of the cells' values weighted by the cells' `weight` field."""
    return {name: weighted_budget([(c[name], c[weight]) for c in cells]) for name in names}


# window tasks (ppl, iou): windows of a text, each decoded through one fresh SparseCache


def token_windows(tokenizer, text: str, context: int, windows: int = 1, start: int = 0) -> list[torch.Tensor]:
    """`windows` consecutive non-overlapping windows of `context` token ids ([1, context] each), the first at
    token `start` of the text."""
    needed = start + windows * context
    # tokenize only as much text as needed (about 3-5 characters per token for English), growing if short
    chars = needed * 6 + 1000
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, return_tensors="pt").input_ids[0]
        if len(ids) >= needed + 1 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise ConfigError(
            f"the text has {len(ids)} tokens, fewer than start + windows x context = {needed}; "
            "use a longer text or fewer/shorter windows"
        )
    return [ids[start + i * context : start + (i + 1) * context][None] for i in range(windows)]


class TextWindows:
    """The data of a window task: `text` (default: the essays, named "haystack") cut into `windows` windows of
    `context` tokens from token `start`, tokenized on first use (a fully cached run never loads the tokenizer)."""

    def __init__(self, handle: ModelHandle, text: str | None, name: str, context: int, windows: int = 1,
                 start: int = 0):  # fmt: skip
        self.handle = handle
        self.name = "haystack" if text is None else name
        self.text = default_text(text)
        self.digest = digest(self.text)
        self.context, self.windows, self.start = context, windows, start

    @functools.cached_property
    def ids(self) -> list[torch.Tensor]:
        return token_windows(self.handle.get_tokenizer(), self.text, self.context, self.windows, self.start)

    def fields(self, settings: dict, window: int) -> dict:
        """A window cell's own key fields: the text, the task's settings, the window."""
        return {"text": self.digest, "settings": settings, "window": window}


@dataclass
class SparsePass:
    """One window's forward passes through the model with a method enabled and one fresh SparseCache:
    `run(ids)` feeds a chunk (its queries select from their own causal past); `seconds` is set on exit."""

    model: Any
    cache: SparseCache
    seconds: float = 0.0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=ids, **cache_kwargs(self.model, self.cache), use_cache=True, **kwargs)


@contextlib.contextmanager
def sparse_pass(model, config: SparseConfig, prompt_length: int | None = None) -> Iterator[SparsePass]:
    """A SparsePass of `config` on `model`, timed from the first forward to the end of the block.
    `prompt_length`: the prompt may be fed in chunks (as transformers' `prefill_chunk_size` does); forwards up to
    that length are its chunks (dense attention), later ones decode sparsely."""
    run = SparsePass(model, SparseCache.for_model(model, config, prompt_length=prompt_length))
    start = time.perf_counter()
    with torch.inference_mode(), sparsekv.enabled(model, config):
        yield run
        run.seconds = time.perf_counter() - start


# prompt tasks (niah, ruler, fidelity): one seeded greedy generation per cell


def greedy(handle: ModelHandle, config: SparseConfig, prompt: str, max_new_tokens: int, seed: int):
    """`sparsekv.generate` of `prompt` (already chat-formatted) with torch seeded: a GenerationResult."""
    model, tokenizer = handle.get()
    seed_everything(seed)
    if config.dense_below is None:
        # an evaluation measures the method itself: on CUDA generation would otherwise attend densely below the
        # method's measured speed crossover (`SparseConfig.dense_below`), i.e. at every context a GPU eval runs
        config = dataclasses.replace(config, dense_below=0)
    return sparsekv.generate(model, tokenizer, prompt, config, max_new_tokens=max_new_tokens)
