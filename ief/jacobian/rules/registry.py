"""The layer-rule registry: from a module type to the :class:`LayerRule` that gives its per-sample gradients.

The capture (:mod:`ief.jacobian.capture`) asks :func:`rule_for` about every module of the model; a module whose type
has a rule that :meth:`LayerRule.applies` to it is hooked, every other module's parameters take the exact per-sample
loop. Types are matched exactly (``type(module) is cls``, never a subclass, whose ``forward`` may do something else).
The built-in rules live one family per file beside this one (``linear``, ``conv``, ``embedding``,
``scaled_embedding``, ``norms``, ``rmsnorm``, ``attention``) and register themselves when :mod:`ief.jacobian.rules`
is imported; a user's own layer type gets one with :func:`register_rule`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

BATCH_FIRST = -1  # "features" of a layer whose input is [N, C, *] and whose sample axis can only be N (normalisations)
WHOLE_CALL = -1  # the sample "axis" of every call when M = 1: the whole call belongs to sample 0


def recording_hook(records: list, slots: int = 2) -> Callable:
    """A forward hook that appends ``[input, output grad, None, ...]`` (``slots`` entries) to ``records`` for every
    call whose output reaches a loss, and fills in the gradient flowing back into that output (summed if it arrives
    in parts). The per-sample capture's own recorder (:mod:`ief.jacobian.capture`, and through it the K-FAC
    factors), and what a rule's :meth:`LayerRule.call_recorder` may build on.

    Args:
        records: the list the records are appended to, in call order.
        slots: the entries of a record (at least 2: the input and the output gradient; the rest start ``None``).

    Returns:
        ``hook(module, args, output)``; the input is ``None`` when the call had no positional tensor.
    """

    def hook(module, args, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        x = args[0].detach() if args and isinstance(args[0], torch.Tensor) else None
        record = [x] + [None] * (slots - 1)
        records.append(record)

        def keep_grad(grad):
            record[1] = grad if record[1] is None else record[1] + grad

        output.register_hook(keep_grad)

    return hook


def write_block(dest: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    """Write one call's per-sample gradients into their column block of J: copied on a module's first call, added on
    later calls (``accumulate``); what a :class:`LayerRule`'s ``grads`` calls for each parameter it fills.

    Args:
        dest: the parameter's block of ``J``, a strided ``[M, numel]`` view (``dests[name]`` in ``grads``).
        value: the per-sample gradients, ``M * numel`` values in any shape (reshaped to ``dest``'s).
        accumulate: add to ``dest`` (a later call of the same module) instead of overwriting it.

    Returns:
        ``None``; ``dest`` is written in place.
    """
    value = value.reshape(dest.shape)
    dest.add_(value) if accumulate else dest.copy_(value)


class LayerRule:
    """How the per-sample gradients of one layer type's parameters follow from each call's input and output gradient.

    The per-sample hooks record, for every call of a hooked module, its first positional input ``x`` and the gradient
    ``g`` flowing back into its output, both with the sample axis moved first (``[M, ...]``), and hand them to
    :meth:`grads`. Subclass it, override :meth:`grads` (and, for a weight that is a sum over positions of outer
    products, :meth:`factored` / :meth:`factors` for the factored "ghost" form of :func:`ief.per_sample`), and
    register it for the layer type with :func:`register_rule`. The rule must be exact: sample ``n``'s slice of ``x``
    and ``g`` alone give ``grad_theta l_n`` (the guard and ``check="exact"`` catch a rule that is not).

    Args:
        features: how many trailing dimensions of the input are features rather than samples or positions (1 for a
            linear layer ``[..., in]``, 3 for a 2-d convolution ``[M, C, H, W]``, 0 for an embedding's ids), or
            :data:`BATCH_FIRST` (-1) for a layer whose input is ``[N, C, *]`` and whose sample axis can only be its
            first dimension (normalisations). The sample axis is searched for among the other dimensions. Default 1.

    Raises:
        ValueError: ``features`` not an integer >= -1.

    Attributes:
        features: the value given (see Args).
        batched: class attribute, default ``False``: the input is ``[N, C, *]`` with ``N`` the layer's own batch
            (and may be unbatched ``[C, *]``), as for a convolution (see :meth:`one_sample_axis`).
        table: class attribute, default ``False``: an embedding table (ids as input, only the used rows in the
            factored forms, ids that every sample may share).
        owns_submodules: class attribute, default ``False``: the module's call also uses its submodules'
            parameters (``nn.MultiheadAttention``'s ``out_proj``), whose rows this rule writes.

    A layer whose call is not one input tensor in and one output tensor out overrides the capture's tier below
    (:meth:`call_recorder`, :meth:`inner_hooks`, :meth:`one_sample_axis`, :meth:`keep_axis`), as the built-in rules
    for ``nn.MultiheadAttention`` and the peft adapters do.
    """

    batched = False
    table = False
    owns_submodules = False

    def __init__(self, features: int = 1):
        if isinstance(features, bool) or not isinstance(features, int) or features < BATCH_FIRST:
            raise ValueError(f"features must be an integer >= 0 (or BATCH_FIRST, -1), got {features!r}")
        self.features = features

    def applies(self, module: torch.nn.Module) -> bool:
        """Whether this rule is exact for ``module`` (e.g. a configuration it does not cover); default ``True``.

        Args:
            module: a module of the registered type.

        Returns:
            ``True`` to hook it, ``False`` to leave its parameters to the exact per-sample loop.
        """
        return True

    def feature_dims(self, module: torch.nn.Module) -> int:
        """The trailing feature dimensions of ``module``'s input (default: ``features``).

        Args:
            module: the hooked module.

        Returns:
            An integer >= 0, or :data:`BATCH_FIRST`.
        """
        return self.features

    def grads(self, module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests: dict[str, torch.Tensor],
              accumulate: bool) -> None:
        """Write sample ``n``'s gradient of every parameter in ``dests`` from one call of ``module``.

        Args:
            module: the hooked module.
            x: the call's input, sample axis first (``[M, ...]``), detached.
            g: the gradient of the loss with respect to the call's output, sample axis first.
            dests: parameter name in ``module`` (``"weight"``) -> its ``[M, numel]`` column block of ``J`` (a strided
                view, in the parameters' dtype; only the parameters being differentiated are present).
            accumulate: ``False`` on the module's first call (overwrite the block: it is uninitialised memory),
                ``True`` on later calls (add); :func:`write_block` does either.

        Returns:
            Nothing: the rows are written in place.

        Raises:
            NotImplementedError: a rule that does not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define grads")

    def factored(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s ``weight``, viewed ``[O, I]``, has per-sample rows ``G_n^T A_n`` (default ``False``).

        Args:
            module: the hooked module.

        Returns:
            ``True`` if :meth:`factors` gives them: the factored forms may then keep the weight as ``(A, G)``.
        """
        return False

    def factors(self, module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [M, T, I], G [M, T, O])`` of one call, with ``sum_t G[n, t]^T A[n, t]`` sample ``n``'s gradient of the
        weight in its own layout viewed ``[O, I]`` (for a rule with :meth:`factored`).

        Args:
            module: the hooked module.
            x: the call's input, sample axis first.
            g: the gradient of its output, sample axis first.

        Returns:
            The pair ``(A, G)``.

        Raises:
            NotImplementedError: a rule that does not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define factors")

    def positions(self, module: torch.nn.Module, g: torch.Tensor) -> int:
        """``T`` of one call: the positions over which the weight is shared (default: features last).

        Args:
            module: the hooked module.
            g: the gradient of its output, sample axis first.

        Returns:
            The number of positions, which decides whether the factored form is cheaper.
        """
        return g[0].numel() // g.shape[-1]

    def bias_rows(self, module: torch.nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Sample ``n``'s gradient of the ``bias`` from the factors of all calls (default: ``G`` summed over positions).

        Args:
            module: the hooked module.
            a: ``A [M, T, I]`` (all calls concatenated along the positions).
            g: ``G [M, T, O]``.

        Returns:
            ``[M, numel of the bias]``.
        """
        return g.sum(dim=1)

    # ---- what the capture asks beyond the rows: a rule whose calls are not one tensor in, one out overrides these
    def one_sample_axis(self, module: torch.nn.Module, x: torch.Tensor | None, features: int) -> int | None:
        """The sample axis of one call when the batch holds one sample (``M = 1``, no probe forward runs).

        Default: the whole call belongs to the sample (:data:`WHOLE_CALL`), except for a ``[N, C, *]`` layer
        (``features`` :data:`BATCH_FIRST` or :attr:`batched`), whose own batch dimension ``N`` must then be 1.

        Args:
            module: the hooked module.
            x: the call's recorded input (``None`` when the call had no positional tensor).
            features: :meth:`feature_dims` of ``module``.

        Returns:
            The axis, :data:`WHOLE_CALL`, or ``None`` (the call serves several instances of the one sample: the
            module's parameters take the exact per-sample loop).
        """
        batched = features == BATCH_FIRST or self.batched
        if not batched or (x is not None and x.dim() == features):  # flattened rules; unbatched conv
            return WHOLE_CALL
        return 0 if x is not None and x.dim() > 1 and x.shape[0] == 1 else None

    def keep_axis(self, module: torch.nn.Module, axis):
        """An established sample axis of one call (probed and proven, or a broadcast use) as this layer can use it.

        Args:
            module: the hooked module.
            axis: the axis the capture established for the call.

        Returns:
            ``axis`` (the default), or ``None`` when the rule cannot use it (``nn.MultiheadAttention``: its samples
            must be its own batch dimension); a call without an axis sends the module to the per-sample loop.
        """
        return axis

    def call_recorder(self, calls: list, edges: list) -> Callable | None:
        """A forward hook of this rule's own that records each call, for a layer whose call is not one input tensor
        in and one output tensor out (``nn.MultiheadAttention``, peft's adapter wrappers, DoRA's magnitude).

        The hook is registered ``with_kwargs=True`` (``hook(module, args, kwargs, output)``) and appends one record
        ``[x, g, axis, ...]`` per call to ``calls``: ``x`` the input :meth:`grads` receives (``None``: no sample axis,
        the loop), ``g`` filled in by a gradient hook on the output, ``axis`` left ``None`` for the capture; and the
        output's gradient edge to ``edges`` (``torch.autograd.graph.get_gradient_edge``). :func:`recording_hook`
        is the capture's own recorder, to build on.

        Args:
            calls: the module's records, appended to in call order.
            edges: the gradient edges of the recorded outputs.

        Returns:
            The hook, or ``None`` (the default): the capture records ``[first positional input, output gradient,
            axis]`` itself.
        """
        return None

    def inner_hooks(self, module: torch.nn.Module, recorder: Callable) -> list:
        """Hooks on modules inside ``module``'s call that feed what ``recorder`` (this rule's :meth:`call_recorder`)
        records, registered after it (peft wrappers: the adapter dropout's output is the input of the rows).

        Args:
            module: the hooked module.
            recorder: the hook :meth:`call_recorder` returned for it.

        Returns:
            The hooks' handles (the capture removes them on exit); default none.
        """
        return []

    @property
    def records_own_calls(self) -> bool:
        """Whether this rule records its calls itself (it overrides :meth:`call_recorder`); the capture then reads the
        first element of a tuple output as the call's output."""
        return type(self).call_recorder is not LayerRule.call_recorder


_RULES: dict[type, LayerRule] = {}
_BY_NAME: dict[str, LayerRule] = {}  # "module.qualname" -> rule, for types of optional libraries (HF Conv1D)


def register_rule(layer_type: type, rule: LayerRule) -> LayerRule | None:
    """Register the per-sample rule of a layer type, so that :func:`ief.per_sample` hooks its modules.

    Without a rule, a module's parameters take the exact per-sample loop (``M`` backward passes) with a
    :class:`~ief.SlowPathWarning`. A rule is one subclass of :class:`ief.LayerRule` (see its docstring);
    modules are matched by exact type, so a subclass of a registered type needs its own registration. Registering a
    type again replaces its rule (the previous one is returned). Example, a linear layer with a fixed output scale::

        class ScaledLinear(torch.nn.Module):  # y = s (x W^T + b)
            ...

        class ScaledLinearRule(ief.LayerRule):
            def grads(self, module, x, g, dests, accumulate):
                m = x.shape[0]
                a, g = x.reshape(m, -1, x.shape[-1]), module.scale * g.reshape(m, -1, g.shape[-1])
                if "weight" in dests:
                    ief.write_block(dests["weight"], g.transpose(1, 2) @ a, accumulate)
                if "bias" in dests:
                    ief.write_block(dests["bias"], g.sum(dim=1), accumulate)

            def factored(self, module):  # optional: the "ghost" form keeps the weight as (A, G)
                return True

            def factors(self, module, x, g):
                m = x.shape[0]
                return x.reshape(m, -1, x.shape[-1]), module.scale * g.reshape(m, -1, g.shape[-1])

        ief.register_rule(ScaledLinear, ScaledLinearRule())

    Args:
        layer_type: a subclass of ``torch.nn.Module``.
        rule: an instance of a :class:`~ief.LayerRule` subclass that overrides ``grads``.

    Returns:
        The rule ``layer_type`` had before, or ``None``.

    Raises:
        TypeError: ``layer_type`` is not a ``torch.nn.Module`` subclass, or ``rule`` is not a ``LayerRule`` instance
            overriding ``grads`` (and ``factors`` where it overrides ``factored``), naming what it got.
    """
    if not isinstance(layer_type, type) or not issubclass(layer_type, torch.nn.Module):
        raise TypeError(f"register_rule needs a torch.nn.Module subclass as layer_type, got {layer_type!r}")
    if isinstance(rule, type):
        raise TypeError(f"register_rule needs a LayerRule instance, got the class {rule.__name__} (call it: "
                        f"{rule.__name__}())")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"register_rule needs an instance of an ief.LayerRule subclass, got "
                        f"{type(rule).__name__}")
    if type(rule).grads is LayerRule.grads:
        raise TypeError(f"{type(rule).__name__} does not override LayerRule.grads (the per-sample rows of one call)")
    if type(rule).factored is not LayerRule.factored and type(rule).factors is LayerRule.factors:
        raise TypeError(f"{type(rule).__name__} overrides factored but not factors (the (A, G) pair of one call)")
    previous = _RULES.get(layer_type)
    _RULES[layer_type] = rule
    return previous


def unregister_rule(layer_type: type) -> LayerRule | None:
    """Remove ``layer_type``'s rule (its modules then take the per-sample loop); returns it, or ``None``."""
    return _RULES.pop(layer_type, None)


def register_by_name(qualified_name: str, rule: LayerRule) -> None:
    """Register ``rule`` for the type named ``"module.QualName"``, without importing its library."""
    _BY_NAME[qualified_name] = rule


def _unsharded_class(cls: type) -> type:
    """The class that FSDP2's ``fully_shard`` derived ``cls`` from (it turns a module's class ``Name`` into
    ``FSDPName(FSDPModule, Name)``, whose calls are ``Name``'s), else ``cls``."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def rule_for(module: torch.nn.Module) -> LayerRule | None:
    """The rule that hooks ``module`` (an FSDP2 module: its own class's), or ``None`` (its parameters take the
    per-sample loop)."""
    cls = _unsharded_class(type(module))
    rule = _RULES.get(cls)
    if rule is None and _BY_NAME:
        rule = _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
    return rule if rule is not None and rule.applies(module) else None
