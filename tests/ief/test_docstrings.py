"""Every exported name is documented at the name, Google style (what the book's API page renders with napoleon):

- a function: ``Args:`` (every parameter of its signature named) and ``Returns:``;
- a class with a constructor (the optimisers, ``FisherOperator``): ``Args:`` naming every constructor argument, the
  ones forwarded through ``**kwargs`` to a base class included, each optional one with its default; its public
  methods (``step``, ``matvec``, ...): ``Args:`` and ``Returns:``;
- a result record (a dataclass or named tuple): ``Attributes:`` naming its fields, and so every public record type
  any module of ``ief/`` defines (what an exported name returns or takes, exported itself or not);
- an exception or warning: a ``Raised by`` sentence saying where it comes from.

The exported modules are read from ``__all__`` when the test runs (``ief``, ``ief.optim`` and any later exported
module such as ``ief.hf`` or ``ief.woodfisher`` when present), so a new name is covered without editing this file.
A docstring states cost models, never one machine's timings (those live in ``benchmarks/results/``)."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import ief

MODULES = ["ief", "ief.optim", "ief.hf", "ief.woodfisher"]
PACKAGE = Path(ief.__file__).resolve().parent


def _exported() -> list[tuple[str, object]]:
    names = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:  # not (yet) part of the package
                continue
            raise
        if not Path(module.__file__).resolve().is_relative_to(PACKAGE):
            continue  # a module of another checkout found through an editable install's finder, not this tree's
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue  # constants (METHODS) and submodules are documented by the module that holds them
            names.append((f"{module_name}.{name}", obj))
    return names


def _section(doc: str, title: str) -> str:
    """The text of a Google-style section: from ``title:`` to the next unindented line."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n?|\n)+)", doc, flags=re.M)
    return match.group(1) if match else ""


def _documented_args(doc: str) -> dict[str, str]:
    """``{name: its description}`` of the ``Args:`` section (entries start at the section's first indentation)."""
    body = _section(doc, "Args")
    entries: dict[str, str] = {}
    indent = None
    current = None
    for line in body.splitlines():
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        indent = width if indent is None else indent
        entry = re.match(r"\s*\**(\w+)(?: \(.*?\))?:", line) if width == indent else None
        if entry:
            current = entry.group(1)
            entries[current] = line
        elif current:
            entries[current] += " " + line.strip()
    return entries


def _constructor_parameters(cls: type) -> list[inspect.Parameter]:
    """The constructor's parameters, following ``**kwargs`` into the base classes that receive them."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "ief":
            break  # a base from another library (torch.optim.Optimizer, transformers.Trainer) documents its own
        if "__init__" not in vars(klass):
            continue
        try:
            params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        except (TypeError, ValueError):
            break
        forwards = False
        for p in params:
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.kind is not p.VAR_POSITIONAL:
                out.setdefault(p.name, p)
        if not forwards:
            break
    return list(out.values())


def _is_record(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def _library_records() -> list[tuple[str, type]]:
    """Every public record type (dataclass or named tuple, its name without a leading underscore) that a module of
    ``ief/`` defines, read by importing every module of the package."""
    found = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], "ief."):
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == info.name and not attr.startswith("_") and _is_record(obj):
                found[f"{info.name}.{attr}"] = obj
    return sorted(found.items())


EXPORTED = _exported()
FUNCTIONS = [(n, o) for n, o in EXPORTED if inspect.isfunction(o)]
CLASSES = [(n, o) for n, o in EXPORTED if inspect.isclass(o)]
CONSTRUCTED = [(n, c) for n, c in CLASSES if not issubclass(c, BaseException) and not _is_record(c)]


def test_the_export_lists_are_read():
    names = {n for n, _ in EXPORTED}
    assert {"ief.per_sample", "ief.optim.IEF", "ief.optim.KFAC", "ief.FisherOperator", "ief.CGResult"} <= names


@pytest.mark.parametrize("name,func", FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_functions_document_args_and_returns(name, func):
    doc = inspect.getdoc(func) or ""
    assert _section(doc, "Returns"), f"{name}: no Returns: section"
    documented = _documented_args(doc)
    params = [p.name for p in inspect.signature(func).parameters.values()]
    assert documented or not params, f"{name}: no Args: section"
    missing = [p for p in params if p not in documented]
    assert not missing, f"{name}: Args: does not name {missing}"


@pytest.mark.parametrize("name,cls", CONSTRUCTED, ids=[n for n, _ in CONSTRUCTED])
def test_classes_document_constructor_arguments_with_defaults(name, cls):
    doc = inspect.getdoc(cls) or ""
    documented = _documented_args(doc)
    assert documented, f"{name}: no Args: section on the class"
    for p in _constructor_parameters(cls):
        assert p.name in documented, f"{name}: constructor argument {p.name!r} is not in Args:"
        if p.default is not p.empty:
            text = documented[p.name]
            shown = {repr(p.default), str(p.default), f"``{p.default!r}``"}
            assert "default" in text.lower() or any(s in text for s in shown), (
                f"{name}: Args: {p.name!r} does not state its default ({p.default!r}): {text!r}")


@pytest.mark.parametrize("name,cls", CONSTRUCTED, ids=[n for n, _ in CONSTRUCTED])
def test_public_methods_document_args_and_returns(name, cls):
    own = {}
    for klass in reversed(cls.__mro__):  # the methods the package defines, inherited ones included (IEF.step)
        if klass.__module__.split(".")[0] == "ief":
            own.update({a: m for a, m in vars(klass).items() if inspect.isfunction(m)})
    for attr, member in own.items():
        if attr.startswith("_"):
            continue
        if attr in ("state_dict", "load_state_dict", "add_param_group", "zero_grad"):
            continue  # torch.optim.Optimizer's own protocol, documented by torch
        doc = inspect.getdoc(member) or ""
        params = [n for n, p in inspect.signature(member).parameters.items()
                  if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # pass-through *args, **kwargs
        assert not params or _section(doc, "Args"), f"{name}.{attr}: no Args: section"
        assert _section(doc, "Returns"), f"{name}.{attr}: no Returns: section"


@pytest.mark.parametrize("name,cls", [(n, c) for n, c in CLASSES if _is_record(c)],
                         ids=[n for n, c in CLASSES if _is_record(c)])
def test_records_document_their_fields(name, cls):
    doc = inspect.getdoc(cls) or ""
    fields = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else list(cls._fields)
    body = _section(doc, "Attributes")
    missing = [f for f in fields if not re.search(rf"^\s+{f}\b", body, flags=re.M)]
    assert body and not missing, f"{name}: Attributes: does not name {missing}"


RECORDS = _library_records()


def test_the_library_records_are_found():
    names = {n for n, _ in RECORDS}
    assert {"ief.hessian_free.CGResult", "ief.jacobian.api.PerSample", "ief.kfac.KroneckerBlock"} <= names


@pytest.mark.parametrize("name,cls", RECORDS, ids=[n for n, _ in RECORDS])
def test_every_record_of_the_library_documents_its_fields(name, cls):
    test_records_document_their_fields(name, cls)


@pytest.mark.parametrize("name,cls", [(n, c) for n, c in CLASSES if issubclass(c, BaseException)],
                         ids=[n for n, c in CLASSES if issubclass(c, BaseException)])
def test_exceptions_say_where_they_are_raised(name, cls):
    doc = inspect.getdoc(cls) or ""
    assert re.search(r"\b(Raised|Issued|Warned) by\b", doc), f"{name}: the docstring does not say what raises it"


@pytest.mark.parametrize("name,obj", EXPORTED, ids=[n for n, _ in EXPORTED])
def test_docstrings_carry_no_measured_timings(name, obj):
    """Cost models (passes, flops) belong at the name; milliseconds of one machine go to benchmarks/results/."""
    docs = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj):
        docs += [inspect.getdoc(m) or "" for a, m in vars(obj).items() if inspect.isfunction(m)]
    timed = [t for d in docs for t in re.findall(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us)\b|\b\d+(?:\.\d+)?\s?s per\b", d)]
    assert not timed, f"{name}: measured timings in the docstring: {timed}"


def test_the_checks_fail_on_an_undocumented_name():
    def bare(model, inputs):
        """Something."""

    def documented(model, inputs):
        """Something.

        Args:
            model: the model.
            inputs: its inputs.

        Returns:
            Nothing useful.
        """

    with pytest.raises(AssertionError, match="Returns"):
        test_functions_document_args_and_returns("bare", bare)
    test_functions_document_args_and_returns("documented", documented)

    class Opt:
        """An optimiser.

        Args:
            lr: the rate (default 0.1).
        """

        def __init__(self, lr: float = 0.1, damping: float = 1e-4):
            pass

    Opt.__module__ = "ief.optim.example"  # only the package's own classes are followed

    with pytest.raises(AssertionError, match="damping"):
        test_classes_document_constructor_arguments_with_defaults("Opt", Opt)
    assert ief.__all__  # the package's own list is what the parametrised tests read

    @dataclasses.dataclass
    class Block:
        """A layer's factors.

        Attributes:
            name: the layer.
        """

        name: str
        G: int

    with pytest.raises(AssertionError, match=r"does not name \['G'\]"):
        test_records_document_their_fields("Block", Block)
