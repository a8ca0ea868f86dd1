"""requirements/ci.lock (a reproducible install): every transitive dependency of the CPU install pinned with hashes, and
the environment `make env` built from it holding exactly what the lock and requirements/no-deps.txt say."""
from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
SELF = {canonicalize_name("ief"), canonicalize_name("ief-companion")}  # this checkout's two distributions, editable


def _entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    """``{name: (version, [hashes])}`` of a requirements file whose every requirement is ``name==version`` (continued
    lines joined); an entry that is not an exact pin fails."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split(" --")
        req = Requirement(spec.strip())
        pins = [s for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1 and len(req.specifier) == 1, f"{path.name}: {spec!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in out, f"{path.name}: {name} twice"
        out[name] = (pins[0].version, [o.split("=", 1)[1].strip() for o in options if o.startswith("hash=")])
    return out


LOCK = _entries(REQUIREMENTS / "ci.lock")
NO_DEPS = {**_entries(REQUIREMENTS / "no-deps.txt"), **_entries(REQUIREMENTS / "cpu-assets.txt")}


def test_every_locked_package_is_pinned_with_hashes():
    for name, (version, hashes) in {**LOCK, **NO_DEPS}.items():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), f"{name}=={version}: no hash"
    assert not set(LOCK) & set(NO_DEPS), "a no-deps package is in the lock: it would pull in its declared deps"


def test_the_lock_holds_the_top_level_pins():
    """requirements/ci.txt (what is asked for) -> ci.lock (what it resolved to): every top-level pin kept."""
    for line in (REQUIREMENTS / "ci.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            assert name in LOCK, f"{name} (requirements/ci.txt) is not in requirements/ci.lock: run make lock"
            assert req.specifier.contains(LOCK[name][0], prereleases=True), \
                f"{name}: ci.txt asks {req.specifier}, the lock has {LOCK[name][0]}: run make lock"


def _made_by_make_env() -> bool:
    return (Path(sys.prefix) / ".installed").exists()


@pytest.mark.skipif(not _made_by_make_env(), reason="not the venv `make env` built from the lock (PYTHON=... given)")
def test_the_venv_holds_exactly_what_is_locked():
    """Every distribution of this interpreter's environment is in the lock (or no-deps.txt) at its locked version, and
    every locked one is installed: `make env` installed nothing unpinned, and the lock names nothing extra."""
    installed = {}
    for dist in importlib.metadata.distributions():
        installed[canonicalize_name(dist.metadata["Name"])] = dist.version
    for name in SELF:
        installed.pop(name, None)
    locked = {name: version for name, (version, _) in {**LOCK, **NO_DEPS}.items()}
    unlocked = {n: v for n, v in installed.items() if n not in locked}
    assert not unlocked, f"installed but not in requirements/ci.lock or no-deps.txt: {unlocked}"
    differ = {n: (v, locked[n]) for n, v in installed.items() if locked[n] != v}
    assert not differ, f"installed version != locked version: {differ}"
    missing = sorted(set(locked) - set(installed))
    assert not missing, f"locked but not installed: {missing}"
