"""The tests follow the products in tiers (ARCHITECTURE.md): ``tests/ief`` tests the library alone, so that
``make test-lib`` runs without the companion, the tools or the benchmarks, and a library change is judged by library
tests. Read with ``ast`` (importing nothing): every import of every file of ``tests/ief``, lazy ones inside functions
included, and of the shared helpers in ``tests/`` that those files import, transitively. No helper is exempt: the
route matrix's smoke-size setups (``tests/route_models.py``) are built from the library and third-party packages."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LIBRARY_TIER = TESTS / "ief"
OUTSIDE_THE_LIBRARY = ("companion", "tools", "benchmarks")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative imports skipped (a test folder is not a package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _where(path: Path) -> str:
    return str(path.relative_to(TESTS.parent)) if path.is_relative_to(TESTS.parent) else str(path)


def _offences(path: Path, seen: set[Path]) -> list[str]:
    """The imports of ``path`` (and of the helpers in tests/ it imports) that reach outside the library."""
    seen.add(path)
    out = []
    for line, module in _imports(path):
        top = module.split(".")[0]
        if top in OUTSIDE_THE_LIBRARY:
            out.append(f"{_where(path)}:{line} imports {module}")
        helper = TESTS / f"{top}.py"
        if helper.exists() and helper not in seen:
            out += [f"{o} (through {_where(path)}:{line})" for o in _offences(helper, seen)]
    return out


def test_the_library_tier_imports_nothing_but_the_library():
    files = sorted(LIBRARY_TIER.glob("*.py"))
    assert files, "tests/ief holds no test file"
    offences = [o for f in files for o in _offences(f, set())]
    assert not offences, ("tests/ief is the library's tier (make test-lib); a test that needs the companion, the "
                          "tools or the benchmarks belongs in tests/companion or tests/book:\n" + "\n".join(offences))


def test_the_tier_check_sees_a_lazy_import(tmp_path):
    """So that the check can fail: a lazy ``from companion...`` inside a function is found, with its line."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import torch\n\n\ndef test_x():\n    from companion.experiments import resolve\n")
    assert _offences(probe, set()) == [f"{probe}:5 imports companion.experiments"]
    helper_user = tmp_path / "test_helper_user.py"  # a shared helper of tests/ that imports the tools is seen too
    helper_user.write_text("import nbrun\n")
    assert any("imports tools" in o and "through" in o for o in _offences(helper_user, set()))
