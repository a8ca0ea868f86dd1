"""ARCHITECTURE.md's layers hold: no module imports from a layer above its own, every module of ``ief/`` is in a
layer, and ``ief.paper`` imports the standard library only.

Read with ``ast``, nothing imported: every ``.py`` file of ``ief/``, ``benchmarks/``, ``tools/`` and ``book/_ext/`` and
the code cells of ``notebooks/*.ipynb``; every import of the project's own packages (``ief``, ``benchmarks``,
``tools``), lazy ones inside functions included, relative ones resolved against the file's package. The layer table
is parsed from ARCHITECTURE.md itself, so the document and the check cannot drift apart.
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

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PACKAGES = ("ief", "benchmarks", "tools")  # whose imports are the project's own
SOURCES = ("ief", "benchmarks", "tools", "book/_ext")  # the folders whose .py files are checked
LEAF = "ief.paper"  # imports the standard library only


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


def violations(sources: list[Source], layers: dict[str, int]) -> list[str]:
    """One line per import that reaches a higher layer than its file's or, from ``ief/``, reaches ``benchmarks/`` or
    ``tools/`` at all, and one per module of ``ief/`` in no layer; empty: none.

    Args:
        sources: the code to check (:func:`project_sources`, or made-up sources in a test).
        layers: ``{module name: layer}`` (:func:`parse_layers`).

    Returns:
        ``"<path>:<line>: <import> reaches <module> (layer <n>: <entry>) from layer <m> (<entry>)"`` lines,
        ``"<path>:<line>: <import> reaches <module>: the package imports nothing of benchmarks/ or tools/"`` and
        ``"<path>: <module> is in no layer of ARCHITECTURE.md: place it"``.
    """
    known = {s.module for s in sources}
    found = []
    for source in sources:
        own = layer_of(source.module, layers)
        if own is None:
            if source.module.startswith("ief."):
                found.append(f"{source.path}: {source.module} is in no layer of ARCHITECTURE.md: place it")
            continue
        for line, written, reached in imports(source, known):
            theirs = layer_of(reached, layers)
            if source.module.startswith("ief.") and not reached.startswith("ief."):
                found.append(f"{source.path}:{line}: {written} reaches {reached}: the package imports nothing of "
                             "benchmarks/ or tools/")
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


# ------------------------------------------------------------------------------------------------ the checks
LAYERS = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return project_sources()


def test_no_module_imports_from_a_higher_layer_and_every_module_is_placed(sources):
    assert {s.path for s in sources} >= {"ief/__init__.py", "ief/chapters/common.py", "notebooks/train.ipynb"}
    found = violations(sources, LAYERS)
    assert not found, "imports against ARCHITECTURE.md's layers:\n" + "\n".join(found)


def test_the_paper_package_imports_the_standard_library_only(sources):
    assert any(s.module.startswith(LEAF) for s in sources)
    found = leaf_violations(sources)
    assert not found, "\n".join(found)


def test_the_table_states_the_rooms_lowest_first():
    assert LAYERS["ief.paper"] < LAYERS["ief.rows"] < LAYERS["ief.directions"] < LAYERS["ief.jacobian"]
    assert LAYERS["ief.__init__"] < LAYERS["ief.experiments"] < LAYERS["ief.chapters"] < LAYERS["tools"]
    assert LAYERS["ief.chapters"] == LAYERS["benchmarks"] == LAYERS["ief.__main__"]
    assert LAYERS["notebooks"] == LAYERS["book._ext"] == max(LAYERS.values())
    assert len(ARCHITECTURE.read_text().splitlines()) <= 60, "ARCHITECTURE.md is meant to stay short"


# ------------------------------------------------------------------------------------------ the check can fail
_FAKE = [Source("ief.__init__", "ief/__init__.py", "from . import losses\n"),
         Source("ief.losses", "ief/losses.py", "import math\n"),
         Source("ief.experiments.__init__", "ief/experiments/__init__.py", ""),
         Source("ief.experiments.runner", "ief/experiments/runner.py", "from ..losses import Loss\n"),
         Source("ief.chapters.__init__", "ief/chapters/__init__.py", ""),
         Source("ief.chapters.style", "ief/chapters/style.py", ""),
         Source("tools.book", "tools/book.py", ""),
         Source("benchmarks.harness", "benchmarks/harness.py", "import ief\nfrom ief.experiments import runner\n")]


@pytest.mark.parametrize("module, path, code, expected", [
    ("ief.directions", "ief/directions.py", "def f():\n    from .experiments.runner import train\n",
     "ief/directions.py:2: from .experiments.runner import train reaches ief.experiments.runner (layer 7: "
     "ief.experiments) from layer 2 (ief.directions)"),
    ("ief.experiments.data", "ief/experiments/data.py", "from ..chapters import style\n",
     "ief/experiments/data.py:1: from ..chapters import style reaches ief.chapters.style (layer 8: ief.chapters) "
     "from layer 7 (ief.experiments)"),
    ("ief.losses", "ief/losses.py", "import tools.book\n",
     "ief/losses.py:1: import tools.book reaches tools.book: the package imports nothing of benchmarks/ or tools/"),
    ("ief.chapters.style", "ief/chapters/style.py", "from benchmarks import harness\n",
     "ief/chapters/style.py:1: from benchmarks import harness reaches benchmarks.harness: the package imports nothing "
     "of benchmarks/ or tools/"),
    ("ief.losses", "ief/losses.py", "from ief import experiments\n",
     "ief/losses.py:1: from ief import experiments reaches ief.experiments.__init__ (layer 7: ief.experiments) "
     "from layer 0 (ief.losses)"),
    ("ief.optim.exact", "ief/optim/exact.py", "from .. import __version__\n",
     "ief/optim/exact.py:1: from .. import __version__ reaches ief.__init__ (layer 6: ief.__init__) from layer 4 "
     "(ief.optim)"),
    ("ief.newcomer", "ief/newcomer.py", "import math\n",
     "ief/newcomer.py: ief.newcomer is in no layer of ARCHITECTURE.md: place it"),
])
def test_an_upward_or_unplaced_import_is_named(module, path, code, expected):
    assert violations(_FAKE, LAYERS) == []  # the made-up package alone is sound
    assert violations(_FAKE + [Source(module, path, code)], LAYERS) == [expected]


def test_a_downward_or_sideways_import_passes():
    ok = [Source("ief.chapters.train", "ief/chapters/train.py",
                 "from ..experiments import runner\nfrom .style import x\nfrom ief import losses\nimport numpy\n"),
          Source("notebooks.train", "notebooks/train.ipynb", "from ief.chapters import train\nimport tools.book\n")]
    assert violations(_FAKE + ok, LAYERS) == []


@pytest.mark.parametrize("code", ["import torch\n", "from ..experiments import resolve\n", "import ief.losses\n",
                                  "def f():\n    import numpy\n"])
def test_the_leaf_may_not_import_beyond_the_standard_library(code):
    fake = [Source("ief.paper.__init__", "ief/paper/__init__.py", "import json\nfrom . import numbers\n"),
            Source("ief.paper.numbers", "ief/paper/numbers.py", "from __future__ import annotations\n")]
    assert leaf_violations(fake) == []
    found = leaf_violations(fake + [Source("ief.paper.extra", "ief/paper/extra.py", code)])
    assert len(found) == 1 and found[0].startswith("ief/paper/extra.py:") and "standard library only" in found[0]


def test_a_malformed_table_is_refused():
    with pytest.raises(ValueError, match="lowest first"):
        parse_layers("| 1 | `a` | x |\n| 0 | `b` | y |\n")
    with pytest.raises(ValueError, match="is in layers 0 and 1"):
        parse_layers("| 0 | `a` | x |\n| 1 | `a` | y |\n")
    with pytest.raises(ValueError, match="no layer table"):
        parse_layers("no table here\n")
