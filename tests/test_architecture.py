"""The layering of src/sparsekv (docs/ARCHITECTURE.md, "Layers"), checked on the import graph.

The graph is read with `ast` from every `import` / `from ... import` of every module, those inside functions and
under `if TYPE_CHECKING:` included (a late import is still a dependency), with relative imports resolved. Imports
made by name through `importlib` (the method registry, `cli.COMMAND_MODULES`) are the designed plug-in points and
are not arrows. Each module gets a layer from LAYERS; the test fails on
  (a) an import from a lower layer to a higher one,
  (b) a cycle between modules (also inside one layer),
  (c) an import of a CLI module (a feature area's `cli.py`, cli_options.py) from outside the CLI layer,
  (d) any import of the app itself (sparsekv/cli.py): the command groups share cli_options.py instead.
"""

from __future__ import annotations

import ast
from fnmatch import fnmatchcase
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "sparsekv"

#: top to bottom: a module may import its own layer and the layers below it, never one above. Entries are paths
#: under src/sparsekv/: "dir/" covers the folder, other entries are file globs; the first layer that covers a
#: file wins (so the feature areas' cli.py files are CLI layer). docs/ARCHITECTURE.md shows this table.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("cli.py", "cli_*.py", "*/cli.py")),
    ("tools", ("eval/", "bench/", "training/")),
    ("api", ("__init__.py", "api.py", "lossless.py")),
    ("decode", ("cache.py", "stats.py", "attention.py", "graph_decode.py")),
    ("methods", ("selectors/", "pruners/", "prefill/", "step.py")),
    ("kernels", ("kernels/",)),
    ("platform", ("models.py", "assets.py", "hf_compat.py", "fingerprint.py")),
    ("config", ("config.py",)),
    ("registry", ("registry.py",)),
    ("core", ("errors.py", "budget.py")),
]
CLI_LAYER = "cli"
#: the `sparsekv` app: it registers the command groups by name and nothing imports it
APP_FILE = "cli.py"

#: known violations whose owners are fixing them now; each entry is one arrow (importer, imported).
#: Remove an entry when its fix lands: the test then guards the fix.
PENDING: set[tuple[str, str]] = set()


# ------------------------------------------------------------------------------------------------ the checker


def module_files(root: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file for every .py of the package (a package is named by its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules) -> str | None:
    """`name`, or its nearest enclosing module of the tree (None outside the tree)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str, modules, is_package: bool = False) -> set[str]:
    """The modules of the tree that `source` (the code of `module`) imports, anywhere in the file."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph(root: Path = SRC, package: str = PACKAGE) -> tuple[dict[str, set[str]], dict[str, str]]:
    """(module -> the modules of the tree it imports, module -> its file as a path under the package folder)."""
    modules = module_files(root, package)
    graph = {
        name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
        for name, path in modules.items()
    }
    return graph, {name: path.relative_to(root / package).as_posix() for name, path in modules.items()}


def layer_of(file: str, layers=LAYERS) -> str | None:
    """The layer of a file given as a path under the package folder ("selectors/base.py")."""
    for layer, entries in layers:
        for entry in entries:
            if file.startswith(entry) if entry.endswith("/") else fnmatchcase(file, entry):
                return layer
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(
    graph: dict[str, set[str]], files: dict[str, str], layers=LAYERS, pending=frozenset()
) -> list[str]:
    """Every broken rule, one line each; arrows in `pending` are left out (also of the cycle search)."""
    rank = {layer: len(layers) - i for i, (layer, _) in enumerate(layers)}
    layer = {module: layer_of(files[module], layers) for module in graph}
    problems = [
        f"{module} ({files[module]}): in no layer (add it to LAYERS and to docs/ARCHITECTURE.md)"
        for module in sorted(graph)
        if layer[module] is None
    ]
    edges = {m: {t for t in targets if (m, t) not in pending} for m, targets in graph.items()}
    for module in sorted(edges):
        src = layer[module]
        for target in sorted(edges[module]):
            dst = layer[target]
            if src is None or dst is None:
                continue
            if rank[dst] > rank[src]:
                problems.append(f"upward import: {module} ({src}) -> {target} ({dst})")
            if dst == CLI_LAYER and src != CLI_LAYER:
                problems.append(f"CLI used as a library: {module} -> {target}")
            if files[target] == APP_FILE:
                problems.append(f"the app imported: {module} -> {target}")
    for component in cycles(edges):
        problems.append(f"import cycle: {' <-> '.join(component)}")
    return problems


# ------------------------------------------------------------------------------------------------ the tests


def test_every_module_is_in_a_layer_and_no_rule_is_broken():
    problems = violations(*import_graph(), pending=PENDING)
    assert not problems, "\n".join(problems)


def test_pending_entries_are_still_real():
    """A PENDING arrow that no longer exists must leave the set, so that it cannot come back unnoticed."""
    graph, _ = import_graph()
    gone = sorted((a, b) for a, b in PENDING if b not in graph.get(a, set()))
    assert not gone, f"fixed, remove from PENDING: {gone}"


def test_the_checker_reports_upward_imports_cycles_and_cli_use(tmp_path):
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "cli.py": "from toy import low\n",
        "high.py": "import toy.low\n",
        "low.py": "def f():\n    from toy.high import x\n",  # a late import is an arrow too: upward, and a cycle
        "sub/__init__.py": "",
        "sub/a.py": "from . import b\n",  # relative: toy.sub.b
        "sub/b.py": "from ..sub.a import y\nfrom toy import cli\n",  # cycle a <-> b, and uses the CLI
        "cli_extra.py": "from toy.cli import app\n",  # a command group importing the app
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    layers = [("cli", ("cli.py", "cli_*.py")), ("high", ("high.py",)), ("low", ("__init__.py", "low.py", "sub/"))]
    graph, where = import_graph(tmp_path, "toy")
    assert graph["toy.sub.a"] == {"toy.sub.b"} and graph["toy.sub.b"] == {"toy.sub.a", "toy.cli"}
    assert where["toy.sub"] == "sub/__init__.py" and layer_of(where["toy.sub.b"], layers) == "low"
    assert sorted(violations(graph, where, layers)) == [
        "CLI used as a library: toy.sub.b -> toy.cli",
        "import cycle: toy.high <-> toy.low",
        "import cycle: toy.sub.a <-> toy.sub.b",
        "the app imported: toy.cli_extra -> toy.cli",
        "the app imported: toy.sub.b -> toy.cli",
        "upward import: toy.low (low) -> toy.high (high)",
        "upward import: toy.sub.b (low) -> toy.cli (cli)",
    ]
    # pending arrows are left out, of the cycle search too
    pending = {("toy.sub.b", "toy.sub.a"), ("toy.sub.b", "toy.cli"), ("toy.low", "toy.high"), ("toy.cli_extra", "toy.cli")}
    assert violations(graph, where, layers, pending) == []
    # a file that no layer covers is reported
    (pkg / "stray.py").write_text("")
    assert "toy.stray (stray.py): in no layer (add it to LAYERS and to docs/ARCHITECTURE.md)" in violations(
        *import_graph(tmp_path, "toy"), layers
    )
