"""Run as a script inside one module's mutmut work folder (mutmut on ``PYTHONPATH``, cwd = that folder).

``generate``: create the mutants (no test runs) and print their names, one a line.
``diffs NAME...``: print ``{name: unified diff}`` of those mutants as JSON.
``results``: print ``{name: status}`` (mutmut's words: killed, survived, timeout, no tests, ...) as JSON.

Run as a script, not a module, so the repository's own ``ief`` is not importable from here.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    def all_data() -> dict:
        out = {}
        for path in walk_mutatable_files():
            data = SourceFileMutationData(path=path)
            data.load()
            out.update({name: (path, code) for name, code in data.exit_code_by_key.items()})
        return out

    command = argv[0]
    if command == "generate":
        os.makedirs("mutants", exist_ok=True)
        copy_src_dir()
        copy_also_copy_files()
        create_mutants(1)
        print("=== answer ===")
        print("\n".join(sorted(all_data())))
    elif command == "diffs":
        data = all_data()
        print("=== answer ===")
        print(json.dumps({name: get_diff_for_mutant(name, path=data[name][0]) for name in argv[1:]}))
    elif command == "results":
        print("=== answer ===")
        print(json.dumps({name: status_by_exit_code[code] for name, (_, code) in sorted(all_data().items())}))
    else:
        raise SystemExit(f"unknown command {command!r}; accepted: generate, diffs, results")


if __name__ == "__main__":
    main(sys.argv[1:])
