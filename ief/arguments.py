"""Keyword arguments that say what they are: a misspelled keyword names the closest valid one.

Python's own message for ``IEF(model, dampning=1e-3)`` is ``TypeError: __init__() got an unexpected keyword argument
'dampning'``, from the innermost constructor, with no hint. :func:`suggest_keywords` wraps a function so that a call
with an unknown keyword raises ``TypeError`` naming the function as the user called it, the unknown keyword, the
closest accepted ones (by edit distance, at most 2; else :func:`difflib.get_close_matches`) and every accepted keyword; ``inspect.signature`` and
``help()`` still show the wrapped function's own, explicit signature.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def edit_distance(a: str, b: str) -> int:
    """The Levenshtein distance of ``a`` and ``b`` (insertions, deletions, substitutions).

    Args:
        a: one word.
        b: the other.

    Returns:
        The least number of single-character edits turning ``a`` into ``b``.
    """
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def unknown_keyword_message(owner: str, signature: inspect.Signature, unknown: str) -> str:
    """The sentence for ``unknown``, a keyword ``owner``'s ``signature`` does not take.

    Args:
        owner: how the user called it, e.g. ``"IEF"``.
        signature: the accepted signature.
        unknown: the keyword given.

    Returns:
        ``"IEF got an unexpected keyword argument 'dampning' (did you mean 'damping'?); it takes: ..."``.
    """
    accepted = [name for name, p in signature.parameters.items()
                if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    distances = {name: edit_distance(unknown, name) for name in accepted}
    best = min(distances.values(), default=None)
    close = [n for n in accepted if distances[n] == best] if best is not None and best <= 2 else \
        difflib.get_close_matches(unknown, accepted, n=1, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(n) for n in close[:2])}?)" if close else ""
    return f"{owner} got an unexpected keyword argument {unknown!r}{hint}; it takes: {', '.join(accepted)}"


def suggest_keywords(function: F | None = None, *, notes: dict[str, str] | None = None) -> F:
    """Wrap ``function`` (a constructor or method) so that an unknown keyword raises ``TypeError`` with a suggestion.

    Args:
        function: the function; for ``__init__``, the class's name is used in the message. Omitted:
            ``suggest_keywords(notes=...)`` returns the decorator.
        notes: a sentence to add for a keyword that is known not to be taken (e.g. another class's argument), by
            keyword.

    Returns:
        The wrapper (``functools.wraps``: the same name, docstring and signature).
    """
    if function is None:
        return functools.partial(suggest_keywords, notes=notes)  # type: ignore[return-value]
    signature = inspect.signature(function)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not takes_any:
            unknown = [k for k in kwargs if k not in signature.parameters]
            if unknown:
                owner = function.__qualname__.rsplit("<locals>.", 1)[-1]  # "fit", "IEF.step"
                if function.__name__ == "__init__":
                    owner = type(args[0]).__name__ if args else owner.rsplit(".", 1)[0]
                note = f" ({notes[unknown[0]]})" if notes and unknown[0] in notes else ""
                raise TypeError(unknown_keyword_message(owner, signature, unknown[0]) + note)
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


__all__ = ["edit_distance", "suggest_keywords", "unknown_keyword_message"]
