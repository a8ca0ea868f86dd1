"""ARCHITECTURE.md's rule and layers hold: ``ief`` never imports the companion, ``tools/`` or ``benchmarks/``; the
companion imports only ``ief``'s public names; no module imports from a layer above its own; every module of ``ief/``
and ``companion/`` is in a layer; ``companion.paper`` imports the standard library only; no import circle, inside a
package or across packages of one layer (which the layers alone cannot see); and no module of ``ief/`` or
``companion/`` is over 700 lines.

Read with ``ast``, nothing imported: every ``.py`` file of ``ief/``, ``companion/``, ``benchmarks/``, ``tools/`` and
``book/_ext/`` and the code cells of ``notebooks/*.ipynb``; every import of the project's own packages, lazy ones
inside functions included, relative ones resolved against the file's package. The layer table and the list of public
modules are parsed from ARCHITECTURE.md itself, and the public names from the ``__all__`` of those modules' sources,
so the document, the library and the check cannot drift apart.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PACKAGES = ("ief", "companion", "benchmarks", "tools")  # whose imports are the project's own
SOURCES = ("ief", "companion", "benchmarks", "tools", "book/_ext")  # the folders whose .py files are checked
PLACED = ("ief.", "companion.")  # every module of these packages must be in a layer
LEAF = "companion.paper"  # imports the standard library only
MAX_LINES = 700  # the longest a module of ief/ or companion/ may be (DEVELOPERS.md: one concern per module)


# ------------------------------------------------------------------------------------------------ the table
def parse_layers(text: str) -> dict[str, int]:
    """``{module name: layer}`` from the rows ``| <layer> | `name`, `name` | room |`` of ARCHITECTURE.md's table.

    Raises:
        ValueError: no row, a layer number out of order, or a name in two rows.
    """
    layers: dict[str, int] = {}
    previous = -1
    for line in text.splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if not row:
            continue
        layer = int(row.group(1))
        if layer <= previous:
            raise ValueError(f"layer {layer} listed after layer {previous}: list the layers lowest first")
        previous = layer
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            if name in layers:
                raise ValueError(f"{name} is in layers {layers[name]} and {layer}")
            layers[name] = layer
    if not layers:
        raise ValueError("no layer table (rows '| <layer> | `module`, ... | room |')")
    return layers


def layer_of(module: str, layers: dict[str, int]) -> tuple[str, int] | None:
    """The table entry that covers ``module`` (itself, or the longest name it is inside) and its layer."""
    covering = [name for name in layers if module == name or module.startswith(name + ".")]
    if not covering:
        return None
    name = max(covering, key=len)
    return name, layers[name]


def parse_public_modules(text: str) -> list[str]:
    """The public modules ARCHITECTURE.md names: ``ief`` and those of its sentence "... the public modules `a`, `b`"."""
    match = re.search(r"public modules\s+((?:`[^`]+`,?\s*(?:and\s+)?)+)", text)
    if not match:
        raise ValueError("ARCHITECTURE.md names no public modules ('... the public modules `ief.optim`, ...')")
    return ["ief", *re.findall(r"`([^`]+)`", match.group(1))]


def exported(code: str) -> set[str]:
    """The names of a module's literal ``__all__`` (read with ``ast``); empty when it has none."""
    for node in ast.parse(code).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


# ------------------------------------------------------------------------------------------------ the sources
@dataclass(frozen=True)
class Source:
    """A file's code: ``module`` its dotted name (``ief/optim/__init__.py`` -> ``ief.optim.__init__``; a notebook
    ``notebooks.<stem>``), ``path`` where it is (for the message), ``code`` its text."""

    module: str
    path: str
    code: str


def module_name(path: Path) -> str:
    """``ief/optim/exact.py`` -> ``ief.optim.exact``; a package's ``__init__.py`` keeps ``.__init__``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def notebook_code(path: Path) -> str:
    """A notebook's code cells, one after the other; IPython's ``%magic`` and ``!shell`` lines left out."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines += [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines) + "\n"


def project_sources() -> list[Source]:
    """Every checked file of the repository, and every notebook."""
    sources = [Source(module_name(p), str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
               for folder in SOURCES for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    sources += [Source(f"notebooks.{p.stem}", str(p.relative_to(ROOT)), notebook_code(p))
                for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    return sources


def _is_package(module: str, known: set[str]) -> bool:
    return f"{module}.__init__" in known


def _target(module: str, known: set[str]) -> str:
    """The source an import of ``module`` runs: a package's ``__init__``, else the module itself."""
    return f"{module}.__init__" if _is_package(module, known) else module


def imports(source: Source, known: set[str]) -> Iterator[tuple[int, str, str]]:
    """``(line, the import as written, the module it reaches)`` for each import of a project package in ``source``.

    ``from X import a`` reaches ``X.a`` when that is a module of the project, else ``X`` itself; relative imports are
    resolved against ``source``'s package.

    Raises:
        SyntaxError: ``source`` does not parse (the message names its path).
    """
    tree = ast.parse(source.code, filename=source.path)
    package = source.module.split(".")[:-1]  # a package's __init__ is inside the package, like its modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield node.lineno, f"import {alias.name}", _target(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                written = "." * node.level + (node.module or "")
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                written = module = node.module or ""
            if module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                inner = f"{module}.{alias.name}"
                reached = inner if inner in known or _is_package(inner, known) else module
                yield node.lineno, f"from {written} import {alias.name}", _target(reached, known)


def public_names(sources: list[Source], public_modules: list[str]) -> dict[str, set[str]]:
    """``{public module: the names of its __all__}``, read from ``sources``."""
    code = {s.module: s.code for s in sources}
    return {m: exported(code.get(f"{m}.__init__", code.get(m, ""))) for m in public_modules}


def private_uses(source: Source, public: dict[str, set[str]]) -> Iterator[str]:
    """The imports of a companion module that reach ``ief`` other than by a public name: ``import ief`` and
    ``import <public module>`` pass; ``from <public module> import name`` passes when ``name`` is in its ``__all__``
    (or is itself a public module)."""
    for node in ast.walk(ast.parse(source.code, filename=source.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ief" and alias.name not in public:
                    yield f"{source.path}:{node.lineno}: import {alias.name}: not a public module of ief"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ief":
            module = node.module
            for alias in node.names:
                if module not in public:
                    yield f"{source.path}:{node.lineno}: from {module} import {alias.name}: not a public module of ief"
                elif alias.name not in public[module] and f"{module}.{alias.name}" not in public:
                    yield (f"{source.path}:{node.lineno}: from {module} import {alias.name}: not in {module}.__all__ "
                           "(promote it, or use a public name)")


def violations(sources: list[Source], layers: dict[str, int], public_modules: list[str] | None = None) -> list[str]:
    """One line per import that reaches a higher layer than its file's, that reaches the companion, ``benchmarks/``
    or ``tools/`` from ``ief/``, or a private name of ``ief`` from the companion, and one per module of ``ief/`` or
    ``companion/`` in no layer; empty: none.

    Args:
        sources: the code to check (:func:`project_sources`, or made-up sources in a test).
        layers: ``{module name: layer}`` (:func:`parse_layers`).
        public_modules: ief's public modules (:func:`parse_public_modules`; default ARCHITECTURE.md's).

    Returns:
        ``"<path>:<line>: <import> reaches <module> (layer <n>: <entry>) from layer <m> (<entry>)"`` lines,
        ``"<path>:<line>: <import> reaches <module>: the library imports nothing of the companion, benchmarks/ or
        tools/"``, ``"<path>:<line>: from <module> import <name>: not in <module>.__all__ ..."`` and
        ``"<path>: <module> is in no layer of ARCHITECTURE.md: place it"``.
    """
    known = {s.module for s in sources}
    public = public_names(sources, PUBLIC_MODULES if public_modules is None else public_modules)
    found = []
    for source in sources:
        own = layer_of(source.module, layers)
        if own is None:
            if source.module.startswith(PLACED):
                found.append(f"{source.path}: {source.module} is in no layer of ARCHITECTURE.md: place it")
            continue
        if source.module.startswith("companion."):
            found += private_uses(source, public)
        for line, written, reached in imports(source, known):
            theirs = layer_of(reached, layers)
            if source.module.startswith("ief.") and not reached.startswith("ief."):
                found.append(f"{source.path}:{line}: {written} reaches {reached}: the library imports nothing of the "
                             "companion, benchmarks/ or tools/")
            elif theirs is None:
                found.append(f"{source.path}:{line}: {written} reaches {reached}, which is in no layer of "
                             "ARCHITECTURE.md")
            elif theirs[1] > own[1]:
                found.append(f"{source.path}:{line}: {written} reaches {reached} (layer {theirs[1]}: {theirs[0]}) "
                             f"from layer {own[1]} ({own[0]})")
    return found


def leaf_violations(sources: list[Source], leaf: str = LEAF) -> list[str]:
    """Imports of anything but the standard library and ``leaf`` itself in ``leaf``'s modules; empty: none."""
    found = []
    for source in sources:
        if not (source.module == leaf or source.module.startswith(leaf + ".")):
            continue
        for node in ast.walk(ast.parse(source.code, filename=source.path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module or ""]
                if node.level and node.level > 1:  # from .. : out of the leaf package
                    names = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if not (top in sys.stdlib_module_names or top == "__future__" or name == leaf
                        or name.startswith(leaf + ".")):
                    found.append(f"{source.path}:{node.lineno}: {leaf} imports {name}: it may import the standard "
                                 "library only")
    return found


def import_graph(sources: list[Source]) -> dict[str, dict[str, tuple[str, int, str]]]:
    """``{module: {module it imports: (its path, the line, the import as written)}}`` over ``sources``' own modules:
    every import, lazy ones inside functions included (a lazy import closes a circle as surely as a top-level one,
    only later), the first of several imports of the same module kept. Notebooks import nothing of each other."""
    known = {s.module for s in sources}
    graph: dict[str, dict[str, tuple[str, int, str]]] = {}
    for source in sources:
        edges = graph.setdefault(source.module, {})
        for line, written, reached in imports(source, known):
            if reached in known and reached != source.module:
                edges.setdefault(reached, (source.path, line, written))
    return graph


def _strongly_connected(graph: dict[str, dict[str, tuple]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, dict[str, tuple]], start: str, members: set[str]) -> list[str]:
    """The shortest path of imports from ``start`` back to ``start`` inside ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, {})):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{start} is on no circle of {sorted(members)}")


def circles(sources: list[Source]) -> list[str]:
    """One line per import circle among ``sources``' modules (a set of modules each of which imports, directly or
    through the others, every other one), with the shortest circle through its first module spelled out import by
    import; empty: none.

    Returns:
        ``"import circle of <n> modules (<modules>): <path>:<line> <import> -> <module> -> ... -> <first module>"``.
    """
    graph = import_graph(sources)
    found = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _shortest_cycle(graph, component[0], set(component))
        steps = []
        for here, there in zip(cycle, cycle[1:]):
            path, line, written = graph[here][there]
            steps.append(f"{path}:{line} {written} -> {there}")
        found.append(f"import circle of {len(component)} modules ({', '.join(component)}): " + "; ".join(steps))
    return found


def long_modules(sources: list[Source], limit: int = MAX_LINES) -> list[str]:
    """``"<path>: <n> lines (more than <limit>)"`` for every module of ``ief/`` or ``companion/`` over ``limit``."""
    return [f"{s.path}: {len(s.code.splitlines())} lines (more than {limit}): split it by concern"
            for s in sources if s.module.startswith(PLACED) and s.path.endswith(".py")
            and len(s.code.splitlines()) > limit]


# ------------------------------------------------------------------------------------------------ the checks
LAYERS = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))
PUBLIC_MODULES = parse_public_modules(ARCHITECTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return project_sources()


def test_no_module_imports_from_a_higher_layer_and_every_module_is_placed(sources):
    assert {s.path for s in sources} >= {"ief/__init__.py", "companion/chapters/common.py", "notebooks/train.ipynb"}
    found = violations(sources, LAYERS)
    assert not found, "imports against ARCHITECTURE.md's layers:\n" + "\n".join(found)


def test_the_paper_package_imports_the_standard_library_only(sources):
    assert any(s.module.startswith(LEAF) for s in sources)
    found = leaf_violations(sources)
    assert not found, "\n".join(found)


def test_the_table_states_the_rooms_lowest_first():
    assert LAYERS["ief.losses"] < LAYERS["ief.rows"] < LAYERS["ief.directions"] < LAYERS["ief.jacobian"]
    assert max(v for k, v in LAYERS.items() if k.startswith("ief")) == LAYERS["ief.__init__"]
    assert LAYERS["ief.__init__"] < LAYERS["companion.paper"] < LAYERS["companion.experiments"]
    assert LAYERS["companion.experiments"] < LAYERS["companion.chapters"] < LAYERS["tools"]
    assert LAYERS["companion.chapters"] == LAYERS["benchmarks"] == LAYERS["companion.__main__"]
    assert LAYERS["notebooks"] == LAYERS["book._ext"] == max(LAYERS.values())
    assert PUBLIC_MODULES == ["ief", "ief.optim", "ief.hf", "ief.woodfisher"]
    assert len(ARCHITECTURE.read_text().splitlines()) <= 70, "ARCHITECTURE.md is meant to stay short"


def test_no_import_circle(sources):
    found = circles(sources)
    assert not found, ("modules that import each other (lazy imports included): move what both need into a module "
                       "below them\n" + "\n".join(found))


def test_no_module_is_over_the_length_limit(sources):
    found = long_modules(sources)
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------------ the check can fail
_FAKE = [Source("ief.__init__", "ief/__init__.py", "from . import losses\n__all__ = ['per_sample']\n"),
         Source("ief.losses", "ief/losses.py", "import math\n"),
         Source("companion.paper.__init__", "companion/paper/__init__.py", "import json\n"),
         Source("companion.experiments.__init__", "companion/experiments/__init__.py", ""),
         Source("companion.experiments.runner", "companion/experiments/runner.py", "from ief import per_sample\n"),
         Source("companion.chapters.__init__", "companion/chapters/__init__.py", ""),
         Source("companion.chapters.style", "companion/chapters/style.py", ""),
         Source("tools.book", "tools/book.py", ""),
         Source("benchmarks.harness", "benchmarks/harness.py", "import ief\nfrom companion.experiments import runner\n")]
_LIBRARY_ONLY = "the library imports nothing of the companion, benchmarks/ or tools/"


@pytest.mark.parametrize("module, path, code, expected", [
    ("ief.directions", "ief/directions.py", "def f():\n    from companion.experiments.runner import train\n",
     f"ief/directions.py:2: from companion.experiments.runner import train reaches companion.experiments.runner: "
     f"{_LIBRARY_ONLY}"),
    ("companion.experiments.data", "companion/experiments/data.py", "from ..chapters import style\n",
     "companion/experiments/data.py:1: from ..chapters import style reaches companion.chapters.style (layer 9: "
     "companion.chapters) from layer 8 (companion.experiments)"),
    ("companion.paper.numbers", "companion/paper/numbers.py", "from ..experiments import runner\n",
     "companion/paper/numbers.py:1: from ..experiments import runner reaches companion.experiments.runner (layer 8: "
     "companion.experiments) from layer 7 (companion.paper)"),
    ("ief.losses", "ief/losses.py", "import tools.book\n", f"ief/losses.py:1: import tools.book reaches tools.book: {_LIBRARY_ONLY}"),
    ("ief.losses", "ief/losses.py", "from companion import experiments\n",
     f"ief/losses.py:1: from companion import experiments reaches companion.experiments.__init__: {_LIBRARY_ONLY}"),
    ("ief.optim.exact", "ief/optim/exact.py", "from .. import __version__\n",
     "ief/optim/exact.py:1: from .. import __version__ reaches ief.__init__ (layer 6: ief.__init__) from layer 4 "
     "(ief.optim)"),
    ("ief.newcomer", "ief/newcomer.py", "import math\n",
     "ief/newcomer.py: ief.newcomer is in no layer of ARCHITECTURE.md: place it"),
    ("companion.newcomer", "companion/newcomer.py", "import math\n",
     "companion/newcomer.py: companion.newcomer is in no layer of ARCHITECTURE.md: place it"),
    ("companion.experiments.data", "companion/experiments/data.py", "from ief.losses import get_loss\n",
     "companion/experiments/data.py:1: from ief.losses import get_loss: not a public module of ief"),
    ("companion.experiments.data", "companion/experiments/data.py", "import ief.losses\n",
     "companion/experiments/data.py:1: import ief.losses: not a public module of ief"),
    ("companion.chapters.train", "companion/chapters/train.py", "from ief import losses\n",
     "companion/chapters/train.py:1: from ief import losses: not in ief.__all__ (promote it, or use a public name)"),
])
def test_an_upward_unplaced_or_private_import_is_named(module, path, code, expected):
    assert violations(_FAKE, LAYERS) == []  # the made-up package alone is sound
    assert violations(_FAKE + [Source(module, path, code)], LAYERS) == [expected]


def test_a_downward_or_sideways_import_passes():
    ok = [Source("companion.chapters.train", "companion/chapters/train.py",
                 "from ..experiments import runner\nfrom .style import x\nfrom ief import per_sample\nimport ief\nimport numpy\n"),
          Source("notebooks.train", "notebooks/train.ipynb", "from companion.chapters import train\nimport tools.book\n")]
    assert violations(_FAKE + ok, LAYERS) == []


@pytest.mark.parametrize("code", ["import torch\n", "from ..experiments import resolve\n", "import ief.losses\n",
                                  "def f():\n    import numpy\n"])
def test_the_leaf_may_not_import_beyond_the_standard_library(code):
    fake = [Source("companion.paper.__init__", "companion/paper/__init__.py", "import json\nfrom . import numbers\n"),
            Source("companion.paper.numbers", "companion/paper/numbers.py", "from __future__ import annotations\n")]
    assert leaf_violations(fake) == []
    found = leaf_violations(fake + [Source("companion.paper.extra", "companion/paper/extra.py", code)])
    assert len(found) == 1 and found[0].startswith("companion/paper/extra.py:") and "standard library only" in found[0]


def test_a_malformed_table_is_refused():
    with pytest.raises(ValueError, match="lowest first"):
        parse_layers("| 1 | `a` | x |\n| 0 | `b` | y |\n")
    with pytest.raises(ValueError, match="is in layers 0 and 1"):
        parse_layers("| 0 | `a` | x |\n| 1 | `a` | y |\n")
    with pytest.raises(ValueError, match="no layer table"):
        parse_layers("no table here\n")


# a rule that lazily imported the capture above it, as peft_common once did: the capture imports the rules' package,
# which imports every rule, one of which imports the shared peft module, which imports the capture again
_CIRCLE = [Source("ief.jacobian.__init__", "ief/jacobian/__init__.py", "from .capture import PerSampleCapture\n"),
           Source("ief.jacobian.capture", "ief/jacobian/capture.py", "import torch\nfrom .rules import LayerRule\n"),
           Source("ief.jacobian.rules.__init__", "ief/jacobian/rules/__init__.py",
                  "from . import linear, peft_ia3\nfrom .registry import LayerRule\n"),
           Source("ief.jacobian.rules.registry", "ief/jacobian/rules/registry.py", "import torch\n"),
           Source("ief.jacobian.rules.linear", "ief/jacobian/rules/linear.py", "from .registry import LayerRule\n"),
           Source("ief.jacobian.rules.peft_ia3", "ief/jacobian/rules/peft_ia3.py",
                  "from .peft_common import PeftAdapterRule\n"),
           Source("ief.jacobian.rules.peft_common", "ief/jacobian/rules/peft_common.py",
                  "from .registry import LayerRule\n\n\nclass PeftAdapterRule(LayerRule):\n"
                  "    def recorder(self):\n        from ..capture import recording_hook\n")]


def test_a_lazy_import_that_closes_a_circle_inside_a_package_is_named():
    assert circles(_CIRCLE) == [
        "import circle of 4 modules (ief.jacobian.capture, ief.jacobian.rules.__init__, ief.jacobian.rules.peft_common, "
        "ief.jacobian.rules.peft_ia3): ief/jacobian/capture.py:2 from .rules import LayerRule -> "
        "ief.jacobian.rules.__init__; ief/jacobian/rules/__init__.py:1 from . import peft_ia3 -> "
        "ief.jacobian.rules.peft_ia3; ief/jacobian/rules/peft_ia3.py:1 from .peft_common import PeftAdapterRule -> "
        "ief.jacobian.rules.peft_common; ief/jacobian/rules/peft_common.py:6 from ..capture import recording_hook -> "
        "ief.jacobian.capture"]
    assert violations(_CIRCLE, LAYERS) == []  # every import stays in its layer: only the circle check sees it
    fixed = [s if s.module != "ief.jacobian.rules.peft_common" else
             Source(s.module, s.path, "from .registry import LayerRule, recording_hook\n") for s in _CIRCLE]
    assert circles(fixed) == []


def test_a_circle_of_two_sibling_modules_is_named():
    pair = [Source("companion.experiments.data", "companion/experiments/data.py",
                   "def load():\n    from .asset_folder import local_item\n"),
            Source("companion.experiments.asset_folder", "companion/experiments/asset_folder.py",
                   "def local_item():\n    from .data import MissingResource\n")]
    assert circles(pair) == [
        "import circle of 2 modules (companion.experiments.asset_folder, companion.experiments.data): "
        "companion/experiments/asset_folder.py:2 from .data import MissingResource -> companion.experiments.data; "
        "companion/experiments/data.py:2 from .asset_folder import local_item -> companion.experiments.asset_folder"]


def test_a_long_module_is_named_with_its_length():
    code = "x = 1\n" * (MAX_LINES + 1)
    fake = [Source("ief.optim.exact", "ief/optim/exact.py", code), Source("tools.big", "tools/big.py", code),
            Source("ief.losses", "ief/losses.py", "x = 1\n" * MAX_LINES)]
    assert long_modules(fake) == [f"ief/optim/exact.py: {MAX_LINES + 1} lines (more than {MAX_LINES}): split it by "
                                  "concern"]
