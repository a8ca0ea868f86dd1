"""``python -m ief``: what is installed (``--version``: the version alone).

The library has no command line of its own beyond this; the paper's experiments are the companion's
(``python -m companion``, the sibling distribution ``ief-companion``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys

OPTIONAL = ("transformers", "peft", "accelerate", "datasets")


def _version_of(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """The library's version, torch's (and its CUDA), and the optional packages ``ief.hf`` uses, one per line.

    Returns:
        The report, as printed by ``python -m ief``.
    """
    import torch

    import ief

    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s) visible" if torch.version.cuda
            else "CPU build")
    lines = [f"ief {ief.__version__} (distribution 'ief', imported as 'ief'; MIT licence)",
             f"torch {torch.__version__} ({cuda})"]
    lines += [f"{name} {_version_of(name)}" for name in OPTIONAL]
    lines.append("cite: the paper (arXiv:2406.06420) and this software, see CITATION.cff")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report, or the version alone with ``--version``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    import ief

    parser = argparse.ArgumentParser(prog="python -m ief", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ief {ief.__version__}")
    parser.parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
