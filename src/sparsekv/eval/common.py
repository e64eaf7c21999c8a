"""What every evaluation task shares: lazy model loading, config keys, the per-cell result cache, progress."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from sparsekv.config import SparseConfig
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
    """What the JSON outputs report about a config."""
    return {
        "method": config.method,
        "budget": None if is_dense(config) else config.budget,
        "top_p": config.top_p,
        "dense_layers": list(config.dense_layers),
        "sink": config.sink,
        "local": config.local,
        "gqa": config.gqa,
        "options": dict(config.options),
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
            from rich import get_console  # the CLI's console (`sparsekv.cli.console`)
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


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    box = [0.0]
    start = time.perf_counter()
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - start
