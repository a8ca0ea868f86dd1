"""``make mutation``: mutation testing (mutmut 3) of the core numerical modules against their own test files.

For every module group (``--modules``, default all of :data:`MODULES`) it copies ``ief/``, ``tests/`` and
``pyproject.toml`` into ``<work>/<slug>/``, writes mutmut's ``setup.cfg`` there (mutate only that group; run only its
test files), generates the mutants, draws at most ``--budget`` of them with ``random.Random(seed)`` (all of them
where there are fewer), runs them (one worker, niced by the Makefile) and reads the outcome. Survivors whose
mutation is listed in ``tools/mutation/equivalent.txt`` (with the reason it cannot change behaviour) leave the
denominator:

    score = detected / (tested - equivalent),   detected = killed + timeout

and the exit status is 1 when a module's score is under ``--threshold`` (90 %). ``no tests`` (no test of the file
reaches the function) and every other outcome count as not detected. The report (per module: counts, score, the
diff of every non-equivalent survivor) goes to ``--report`` (text) and ``<report>.json``.

An equivalent entry is one line ``<mutant name> | <the mutant's changed line, stripped> | <why>``: the name
alone would go stale when the function is edited (mutmut numbers the mutants of a function in order), so an
entry counts only while the named mutant still changes exactly that line; stale entries are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EQUIVALENT = HERE / "equivalent.txt"

# module group -> the test files it is measured against (tests/ mirrors ief/).
MODULES: dict[str, list[str]] = {
    "ief/damping_sweep.py": ["tests/ief/test_damping_sweep.py"],
    "ief/rows.py": ["tests/ief/test_rows.py", "tests/ief/test_directions.py", "tests/ief/test_jacobian.py"],
    "ief/directions.py": ["tests/ief/test_directions.py"],
    "ief/curvature.py": ["tests/ief/test_curvature.py"],
    "ief/kfac.py": ["tests/ief/test_kfac.py"],
    # the per-sample package: its layer rules (conv, norms, attention, the registry) and its guard have their own
    # test files
    "ief/jacobian/": ["tests/ief/test_jacobian.py", "tests/ief/test_conv.py", "tests/ief/test_guard.py",
                      "tests/ief/test_layer_rules.py", "tests/ief/test_rule_registry.py"],
    "ief/optim/": ["tests/ief/test_optim.py", "tests/ief/test_optim_update.py"],
}
DETECTED = ("killed", "timeout")


@dataclass
class Outcome:
    module: str
    generated: int
    statuses: dict[str, str]
    diffs: dict[str, str]
    equivalent: dict[str, str] = field(default_factory=dict)  # name -> reason
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for status in self.statuses.values():
            out[status] = out.get(status, 0) + 1
        return out

    @property
    def survivors(self) -> list[str]:
        return sorted(n for n, s in self.statuses.items() if s not in DETECTED and n not in self.equivalent)

    @property
    def score(self) -> float:
        detected = sum(s in DETECTED for s in self.statuses.values())
        denominator = len(self.statuses) - len(self.equivalent)
        return detected / denominator if denominator else 1.0


def changed_line(diff: str) -> str:
    """The mutant's changed line(s) (the diff's ``+`` lines, stripped, joined by `` / ``)."""
    lines = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(lines)


def read_equivalent(path: Path = EQUIVALENT) -> dict[str, tuple[str, str]]:
    """``{mutant name: (changed line, reason)}`` from ``equivalent.txt`` (``#`` comments, blank lines skipped)."""
    out = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]  # the changed line may itself hold " | "; the reason may not
        if len(parts) < 3 or not parts[0] or not parts[-1]:
            raise ValueError(f"{path}:{number}: expected '<mutant name> | <changed line> | <why>', got {raw!r}")
        out[parts[0]] = (" | ".join(parts[1:-1]), parts[-1])
    return out


def slug(module: str) -> str:
    return module.rstrip("/").removeprefix("ief/").removesuffix(".py").replace("/", "_")


def prepare(module: str, tests: list[str], work: Path) -> None:
    """A fresh copy of the code and tests in ``work`` and mutmut's config for ``module``."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("ief", "tests"):
        shutil.copytree(ROOT / name, work / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")
    pattern = module + "*" if module.endswith("/") else module
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = ief\n"
        f"only_mutate = {pattern}\n"
        "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests) +
        "pytest_add_cli_args = -p no:cacheprovider\n"
        "use_git_change_detection = false\n"
    )


def query(work: Path, env: dict[str, str], *args: str) -> str:
    """Run ``mutmut_query.py`` in ``work``; its answer is the stdout after the marker line."""
    proc = subprocess.run([sys.executable, str(HERE / "mutmut_query.py"), *args], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"mutmut_query {args[0]} failed in {work}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout.split("=== answer ===\n", 1)[1]


def measure(module: str, tests: list[str], work: Path, budget: int, seed: int, env: dict[str, str],
            equivalent: dict[str, tuple[str, str]], log) -> Outcome:
    start = time.monotonic()
    prepare(module, tests, work)
    names = query(work, env, "generate").split()
    chosen = sorted(names) if len(names) <= budget else sorted(random.Random(seed).sample(sorted(names), budget))
    log(f"==> {module}: {len(names)} mutants, running {len(chosen)} against {' '.join(tests)}")
    (work / "chosen.txt").write_text("\n".join(chosen) + "\n")
    with open(work / "mutmut.log", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", *chosen], cwd=work,
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"mutmut run failed for {module} (exit {proc.returncode}); see {work / 'mutmut.log'}")
    statuses = {n: s for n, s in json.loads(query(work, env, "results")).items() if n in set(chosen)}
    missing = set(chosen) - set(statuses)
    if missing:
        raise RuntimeError(f"mutmut reported no result for {len(missing)} mutants of {module}: {sorted(missing)[:5]}")
    undetected = [n for n, s in statuses.items() if s not in DETECTED]
    diffs = json.loads(query(work, env, "diffs", *undetected)) if undetected else {}
    outcome = Outcome(module, len(names), statuses, diffs, seconds=time.monotonic() - start)
    for name in undetected:
        if name in equivalent:
            line, reason = equivalent[name]
            if changed_line(diffs[name]) == line:
                outcome.equivalent[name] = reason
            else:
                log(f"    stale equivalent entry {name}: listed {line!r}, the mutant now changes "
                    f"{changed_line(diffs[name])!r}")
    return outcome


def report(outcomes: list[Outcome], threshold: float, budget: int, seed: int) -> str:
    lines = [f"mutation testing (mutmut 3, budget {budget} mutants per module, seed {seed}); "
             f"score = (killed + timeout) / (tested - equivalent), threshold {threshold:.0%}", ""]
    lines.append(f"{'module':24} {'mutants':>7} {'tested':>6} {'killed':>6} {'timeout':>7} {'survived':>8} "
                 f"{'other':>5} {'equiv':>5} {'score':>6} {'time':>6}")
    for o in outcomes:
        c = o.counts()
        other = len(o.statuses) - c.get("killed", 0) - c.get("timeout", 0) - c.get("survived", 0)
        lines.append(f"{o.module:24} {o.generated:7} {len(o.statuses):6} {c.get('killed', 0):6} "
                     f"{c.get('timeout', 0):7} {c.get('survived', 0):8} {other:5} {len(o.equivalent):5} "
                     f"{o.score:6.1%} {o.seconds:5.0f}s {'ok' if o.score >= threshold else 'UNDER'}")
    for o in outcomes:
        if o.survivors:
            lines += ["", f"--- {o.module}: undetected, not listed as equivalent ({len(o.survivors)})"]
            for name in o.survivors:
                lines += [f"{name} [{o.statuses[name]}]: {changed_line(o.diffs[name])}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modules", default=" ".join(MODULES),
                        help=f"space-separated module groups; accepted: {' '.join(MODULES)}")
    parser.add_argument("--budget", type=int, default=400, help="most mutants run per module (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--work", type=Path, default=ROOT / "_build" / "mutation" / "work")
    parser.add_argument("--report", type=Path, default=ROOT / "_build" / "mutation" / "report.txt")
    args = parser.parse_args(argv)
    modules = args.modules.split()
    unknown = [m for m in modules if m not in MODULES]
    if unknown or not modules:
        parser.error(f"unknown module(s) {unknown}; accepted: {' '.join(MODULES)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    equivalent = read_equivalent()
    outcomes = []
    for module in modules:
        outcomes.append(measure(module, MODULES[module], args.work / slug(module), args.budget, args.seed, env,
                                equivalent, lambda s: print(s, flush=True)))
        print(f"    {outcomes[-1].counts()} score {outcomes[-1].score:.1%}", flush=True)
    text = report(outcomes, args.threshold, args.budget, args.seed)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    args.report.with_suffix(".json").write_text(json.dumps(
        [{"module": o.module, "generated": o.generated, "statuses": o.statuses, "equivalent": o.equivalent,
          "score": o.score, "seconds": o.seconds, "survivors": {n: o.diffs[n] for n in o.survivors}}
         for o in outcomes], indent=1))
    print(text)
    return 0 if all(o.score >= args.threshold for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
