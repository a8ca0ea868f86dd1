"""Whose state this is: the optimisers' record of what saved a ``state_dict``, and the refusal of anything else's.

``state_dict()["ief_optimizer"]`` records the class and the settings that change the method (``normalize``,
``loss``, ``reduction``; K-FAC's kind and approximation). ``load_state_dict`` refuses, with
:class:`ForeignStateError` naming both, another method's or settings' state (e.g. IEF's into EF, which would run with
IEF's saved ``normalize`` and ``damping``), a torch optimiser's (AdamW's), and a state whose tensors do not fit the
parameters they belong to (another model's optimiser state with the same number of tensors: every momentum buffer and
``lr="auto"`` change is checked against its parameter's shape, and must be a floating-point tensor; the first that
does not fit is named). A
state saved before the class was recorded loads when its ``normalize`` matches. ``"generator_state"`` carries a label
generator's state (SF, K-FAC's sampled kind), so a resumed run draws the same labels as an uninterrupted one.
"""
from __future__ import annotations

from typing import Any

import torch

STATE_KEY = "ief_optimizer"  # state_dict()'s record of the optimiser that saved it
AUTO_KEY = "auto_lr"  # state_dict()'s adapted rate (lr="auto")
GENERATOR_KEY = "generator_state"


class ForeignStateError(ValueError):
    """Another optimiser's state (another ief method or settings, a torch optimiser's, e.g. AdamW's, or another
    model's: tensors whose shapes or dtypes do not fit the parameters), refused before anything loads; the message
    names both. A ``ValueError``.

    Raised by ``load_state_dict`` of :class:`ief.optim.IEF`, ``EF``, ``SF`` and :class:`ief.optim.KFAC`
    (:class:`ief.hf.IEFTrainer` turns it into a ``ValueError`` naming the checkpoint on resume)."""


def describe(identity: dict) -> str:
    """``EF(normalize=True, loss='mse', reduction='sum')`` from an optimiser's identity record.

    Args:
        identity: ``{"class": name, setting: value, ...}`` (:meth:`ief.optim.base.PreconditionedOptimizer.identity`).

    Returns:
        The constructor call it describes.
    """
    settings = ", ".join(f"{key}={value!r}" for key, value in identity.items() if key != "class")
    return f"{identity['class']}({settings})"


def _foreign_groups(groups: Any) -> str | None:
    """The keys of a state's ``param_groups`` that show it is not an ief optimiser's (``None`` when they are)."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return "no param_groups"
    missing = [key for key in ("damping", "normalize") if key not in groups[0]]
    if not missing:
        return None
    others = sorted(key for key in groups[0] if key not in ("params", "lr", "weight_decay", "initial_lr"))
    return f"param_groups without {' or '.join(map(repr, missing))}" + (
        f" but with {', '.join(map(repr, others[:6]))}" if others else "")


def check_origin(mine: dict, state_dict: Any) -> None:
    """Refuse a state saved by another method or settings, or by a torch optimiser.

    Args:
        mine: the loading optimiser's identity record.
        state_dict: what was given to ``load_state_dict``. A state saved before the class was recorded (no
            ``"ief_optimizer"`` entry) passes when its ``param_groups`` are an ief optimiser's with this one's
            ``normalize``, the setting it holds (IEF and EF(normalize=False) cannot be told apart there).

    Raises:
        ForeignStateError: naming both.
    """
    if not isinstance(state_dict, dict):
        raise ForeignStateError(f"{describe(mine)}.load_state_dict takes a dict from state_dict(), got "
                                f"{type(state_dict).__name__}")
    saved = state_dict.get(STATE_KEY)
    if saved is None:
        foreign = _foreign_groups(state_dict.get("param_groups"))
        if foreign is not None:
            raise ForeignStateError(
                f"this state_dict is not an ief optimiser's ({foreign}: e.g. torch.optim.AdamW(...).state_dict()) "
                f"and cannot be loaded into {describe(mine)}; start {mine['class']} fresh (do not load it)")
        saved_normalize = bool(state_dict["param_groups"][0]["normalize"])
        if saved_normalize != mine["normalize"]:
            raise ForeignStateError(
                f"this state_dict records no optimiser class (saved before ief recorded it) and was saved with "
                f"normalize={saved_normalize}, but this optimiser is {describe(mine)}: load it into the "
                f"optimiser that saved it (constructed with normalize={saved_normalize}), or start "
                f"{mine['class']} fresh")
        return
    if dict(saved) != mine:
        raise ForeignStateError(f"this state_dict is {describe(dict(saved))}'s and cannot be loaded into "
                                f"{describe(mine)} (another method or settings: loading it would run with the "
                                f"saved lr, damping and normalize); construct {describe(dict(saved))} to "
                                f"resume it, or start {mine['class']} fresh")


def _fits(tensor: Any, param: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be ``param``'s state (``None`` when it can: the parameter's shape, a floating dtype)."""
    if not isinstance(tensor, torch.Tensor):
        return f"is a {type(tensor).__name__}, not a tensor"
    if tuple(tensor.shape) != tuple(param.shape):
        return f"has shape {tuple(tensor.shape)} where the parameter has {tuple(param.shape)}"
    if not tensor.is_floating_point():  # a floating one is cast to the parameter's dtype on load, as torch's own are
        return f"has dtype {tensor.dtype}, not a floating-point one (the parameter's is {param.dtype})"
    return None


def check_tensors(state_dict: dict, names: list[str], params: list[torch.Tensor], describe_mine: str) -> None:
    """Refuse a state whose per-parameter tensors do not fit the parameters (another model's state).

    Checks the number of parameters, every ``state[i]["momentum_buffer"]`` against parameter ``i`` (torch's
    ``state_dict`` numbers the parameters in ``param_groups`` order) and ``lr="auto"``'s last change, each against
    its parameter's shape; each must be a floating-point tensor (``torch.optim.Optimizer.load_state_dict`` casts a
    floating one to its parameter's dtype, as for torch's own optimisers).

    Args:
        state_dict: what was given to ``load_state_dict``.
        names: the parameters' names in the model (for the message), in ``param_groups`` order.
        params: the parameters, in the same order.
        describe_mine: the loading optimiser, for the message.

    Raises:
        ForeignStateError: naming the first parameter whose state does not fit, and both shapes (or dtypes).
    """
    groups = state_dict.get("param_groups")
    counted = sum(len(g.get("params", ())) for g in groups) if isinstance(groups, list) else None
    if counted is not None and counted != len(params):
        raise ForeignStateError(f"this state_dict is for {counted} parameters, {describe_mine} has {len(params)} (the "
                                f"state of another model's optimiser); start it fresh")
    per_param = state_dict.get("state", {})
    for index, (name, p) in enumerate(zip(names, params)):
        entry = per_param.get(index) if isinstance(per_param, dict) else None
        if isinstance(entry, dict) and "momentum_buffer" in entry:
            why = _fits(entry["momentum_buffer"], p)
            if why is not None:
                raise ForeignStateError(f"this state_dict's momentum buffer of parameter {index} ({name!r}) {why} "
                                        f"(the state of another model's optimiser): it cannot be loaded into "
                                        f"{describe_mine}; start it fresh")
    auto = state_dict.get(AUTO_KEY)
    delta = auto.get("delta") if isinstance(auto, dict) else None
    if delta is not None:
        if len(delta) != len(params):
            raise ForeignStateError(f"this state_dict's lr='auto' change has {len(delta)} tensors, {describe_mine} has "
                                    f"{len(params)} parameters (the state of another model's optimiser)")
        for index, (name, d, p) in enumerate(zip(names, delta, params)):
            why = _fits(d, p)
            if why is not None:
                raise ForeignStateError(f"this state_dict's lr='auto' change of parameter {index} ({name!r}) {why} "
                                        f"(the state of another model's optimiser): it cannot be loaded into "
                                        f"{describe_mine}; start it fresh")


def store_generator(state: dict, generator: torch.Generator | None) -> dict:
    """``state`` with the label generator's state under ``"generator_state"`` (when there is a generator).

    Args:
        state: the state dict being built.
        generator: the optimiser's label generator, or ``None``.

    Returns:
        ``state``.
    """
    if generator is not None:
        state[GENERATOR_KEY] = generator.get_state()
    return state


def pop_generator_state(state_dict: dict, generator: torch.Generator | None, owner: str) -> torch.Tensor | None:
    """Take ``"generator_state"`` out of ``state_dict`` (a copy the caller owns).

    Args:
        state_dict: the state being loaded.
        generator: the optimiser's label generator, or ``None``.
        owner: the optimiser's class name, for the message.

    Returns:
        The generator's saved state, or ``None``.

    Raises:
        ValueError: it holds one and there is no generator to restore it into.
    """
    generator_state = state_dict.pop(GENERATOR_KEY, None)
    if generator_state is not None and generator is None:
        raise ValueError(f"this state_dict holds the state of {owner}'s generator, but this {owner} has none (it "
                         f"would draw labels from the global RNG): construct it with generator=torch.Generator() to "
                         f"resume")
    return generator_state


def restore_generator(generator: torch.Generator | None, generator_state: torch.Tensor | None) -> None:
    """Set the label generator's state. A generator's state is a CPU byte tensor whatever its device; a state dict
    moved to the GPU (accelerate's ``AcceleratedOptimizer`` does) comes back to the CPU here.

    Args:
        generator: the optimiser's label generator.
        generator_state: its saved state, or ``None`` (nothing to do).
    """
    if generator_state is not None:
        generator.set_state(generator_state.to("cpu", torch.uint8))


__all__ = ["AUTO_KEY", "STATE_KEY", "ForeignStateError", "check_origin", "check_tensors", "describe",
           "pop_generator_state", "restore_generator", "store_generator"]
