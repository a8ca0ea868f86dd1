"""One entry point: ``python -m benchmarks NAME [ARGS...]`` runs ``python -m benchmarks.NAME [ARGS...]``.

``python -m benchmarks`` (no name) lists the benchmarks with their first docstring line; ``python -m benchmarks
report benchmarks/README.md`` rewrites that file's benchmark block from ``benchmarks/results/*.json``.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("step", "paper_mlp", "conv2d", "evaluation", "damping_sweep", "hf_layers", "fvp", "gpt2_full",
              "slow_paths", "distributed", "auto_lr", "defaults")
COMMANDS = BENCHMARKS + ("report",)


def _first_line(name: str) -> str:
    import ast
    from pathlib import Path

    doc = ast.get_docstring(ast.parse((Path(__file__).parent / f"{name}.py").read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def usage() -> str:
    lines = ["usage: python -m benchmarks NAME [ARGS...]   (or python -m benchmarks.NAME; --help for a NAME's options)",
             ""]
    lines += [f"  {name:<14} {_first_line(name)}" for name in COMMANDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0].replace("-", "_"), argv[1:]
    if name not in COMMANDS:
        print(f"unknown benchmark {argv[0]!r}; choose from {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m benchmarks.{name}", *rest]
    result = importlib.import_module(f"benchmarks.{name}").main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
