"""What the rules of peft's adapter wrappers share (:mod:`.peft_ia3`, :mod:`.peft_adalora`, :mod:`.peft_loha`,
:mod:`.peft_lokr`, :mod:`.peft_vera`, :mod:`.peft_lora_embedding`).

A peft wrapper (``ia3.layer.Linear``, ``adalora.layer.SVDLinear``, ...) holds its frozen ``base_layer`` and, per
adapter, trainable tensors in ``nn.ParameterDict`` entries (``ia3_l["default"]``) that its own ``forward`` uses, out
of reach of any hooked submodule. Its rule owns those entries (``owns_submodules``) and gives their per-sample
gradients in closed form from the wrapper's call: its input ``x`` and the gradient ``g`` of its output.

A rule applies only where that form is exact, otherwise the wrapper's parameters take the exact per-sample loop:
adapters neither merged nor disabled, every active adapter present once, no trainable parameter in the wrapper but
the adapter tensors the rule fills (a trainable base layer: the loop), no dropout that draws a mask inside the
wrapper unless the rule records the dropped input (:attr:`PeftAdapterRule.dropout_dict`: AdaLoRA and VeRA, one
active adapter: a forward hook on its ``nn.Dropout`` keeps the dropout's output, which the call's record holds in
place of the wrapper's input; the sample-axis proof then compares dropout-free forwards), and no call with peft's
``adapter_names`` (mixed-adapter batches: such a call is recorded without an input, so it has no sample axis and its
wrapper is demoted to the loop). Inactive adapters' entries get zero rows (their forward does not use them).
"""
from __future__ import annotations

import torch

from .registry import LayerRule, recording_hook, write_block


def base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost base layer of a peft wrapper (``get_base_layer()``, or ``base_layer`` followed down)."""
    get = getattr(module, "get_base_layer", None)
    if callable(get):
        return get()
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def dropout_is_identity(module: torch.nn.Module, dropout: torch.nn.Module | None) -> bool:
    """Whether ``dropout`` (an adapter's dropout submodule) returns its input: ``nn.Identity``, ``None``, an
    ``nn.Dropout`` with ``p = 0`` or not in training mode."""
    if dropout is None or type(dropout) is torch.nn.Identity:
        return True
    return type(dropout) is torch.nn.Dropout and (not dropout.training or dropout.p == 0)


class PeftAdapterRule(LayerRule):
    """The rule of one peft wrapper type: owns the wrapper's ``nn.ParameterDict`` entries named in
    :attr:`adapter_dicts` and fills each active adapter's rows with :meth:`adapter_grads` (subclasses).

    Args:
        features: trailing feature dimensions of the wrapper's input (1 for linear wrappers, 0 for an embedding's
            ids).
    """

    owns_submodules = True
    adapter_dicts: tuple[str, ...] = ()  # the wrapper's ParameterDicts whose entries this rule fills
    # the wrapper's ModuleDict of adapter dropouts, for a rule that needs only the dropped input (then recorded)
    dropout_dict: str | None = None

    def applies(self, module: torch.nn.Module) -> bool:
        """Whether the closed form is exact for ``module`` (see the module docstring), and :meth:`adapter_applies`
        for every active adapter.

        Args:
            module: a peft wrapper of the registered type.

        Returns:
            ``True`` to hook it, ``False`` to leave its parameters to the exact per-sample loop.
        """
        try:
            if module.merged or module.disable_adapters:
                return False
            active = list(module.active_adapters)
        except AttributeError:
            return False
        if len(set(active)) != len(active):
            return False
        for name, p in module.named_parameters():
            if p.requires_grad and name.split(".")[0] not in self.adapter_dicts:
                return False  # a trainable base layer (or ranknum): the loop
        present = [a for a in active if self.has_adapter(module, a)]
        if not all(self.adapter_applies(module, a) for a in present):
            return False
        dropping = self._dropping(module)
        return not dropping or (self.dropout_dict is not None and len(present) == 1
                                and all(type(d) is torch.nn.Dropout for d in dropping))

    def _dropping(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The active adapters' dropout submodules that draw a mask (``[]`` without :attr:`dropout_dict`)."""
        if self.dropout_dict is None:
            return []
        dropouts = getattr(module, self.dropout_dict)
        active = [a for a in module.active_adapters if self.has_adapter(module, a)]
        return [dropouts[a] for a in active if a in dropouts and not dropout_is_identity(module, dropouts[a])]

    def has_adapter(self, module: torch.nn.Module, adapter: str) -> bool:
        """Whether the wrapper's forward uses ``adapter`` when it is active (peft skips unknown names).

        Args:
            module: the wrapper.
            adapter: an adapter name.

        Returns:
            ``True`` if the first of :attr:`adapter_dicts` holds it.
        """
        return adapter in getattr(module, self.adapter_dicts[0])

    def adapter_applies(self, module: torch.nn.Module, adapter: str) -> bool:
        """Whether the closed form covers this active adapter's configuration (default ``True``).

        Args:
            module: the wrapper.
            adapter: an active adapter it holds.

        Returns:
            ``False`` sends the wrapper to the loop.
        """
        return True

    def grads(self, module, x, g, dests, accumulate):
        """Split ``dests`` (``"<dict>.<adapter>"`` -> block) per adapter; active adapters' rows by
        :meth:`adapter_grads`, inactive adapters' rows zero.

        Args:
            module: the wrapper.
            x: its call's input, sample axis first.
            g: the gradient of its output, sample axis first.
            dests: ``"<dict>.<adapter>"`` -> ``[M, numel]`` block.
            accumulate: add to the blocks (a later call).

        Returns:
            Nothing: the rows are written in place.

        Raises:
            ValueError: a parameter name that is not an entry of :attr:`adapter_dicts`.
        """
        per_adapter: dict[str, dict[str, torch.Tensor]] = {}
        for name, dest in dests.items():
            table, _, adapter = name.partition(".")
            if table not in self.adapter_dicts or not adapter:
                raise ValueError(f"{type(self).__name__} has no per-sample rows for {name!r} of "
                                 f"{type(module).__name__} (it fills {', '.join(self.adapter_dicts)})")
            per_adapter.setdefault(adapter, {})[table] = dest
        active = [a for a in module.active_adapters if self.has_adapter(module, a)]
        for adapter, blocks in per_adapter.items():
            if adapter in active:
                self.adapter_grads(module, adapter, active, x, g, blocks, accumulate)
            elif not accumulate:
                for dest in blocks.values():
                    dest.zero_()

    def adapter_grads(self, module: torch.nn.Module, adapter: str, active: list[str], x: torch.Tensor,
                      g: torch.Tensor, blocks: dict[str, torch.Tensor], accumulate: bool) -> None:
        """Write one active adapter's rows (subclasses).

        Args:
            module: the wrapper.
            adapter: the adapter's name.
            active: every active adapter the wrapper holds (IA3 multiplies their vectors).
            x: the call's input, sample axis first.
            g: the gradient of its output, sample axis first.
            blocks: ParameterDict name (``"lora_A"``) -> the adapter entry's ``[M, numel]`` block.
            accumulate: add to the blocks.

        Returns:
            Nothing.

        Raises:
            NotImplementedError: a subclass that does not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define adapter_grads")

    def call_recorder(self, calls: list, edges: list):
        """Records ``[x, dL/d output, axis]`` per call like the capture's own hook, and its output's gradient edge;
        ``x`` is the adapter dropout's output of that call where :meth:`inner_hooks` kept one. A call with peft's
        ``adapter_names`` (samples routed to different adapters), or whose dropout did not run exactly once, is
        recorded without an input, so it gets no sample axis and the wrapper takes the exact loop."""
        record = recording_hook(calls, slots=3)
        dropped: list[torch.Tensor] = []  # filled by the dropout's hook during the call (see inner_hooks)

        def hook(module, args, kwargs, output):
            n = len(calls)
            record(module, args, output)
            if len(calls) > n:
                edges.append(torch.autograd.graph.get_gradient_edge(output))
                if kwargs.get("adapter_names") is not None:
                    calls[-1][0] = None
                elif dropped:  # the dropout ran once (else no input: no sample axis, the loop)
                    one = len(dropped) == 1 and calls[-1][0] is not None and dropped[0].shape == calls[-1][0].shape
                    calls[-1][0] = dropped[0] if one else None
            dropped.clear()

        hook.dropped = dropped
        return hook

    def inner_hooks(self, module: torch.nn.Module, hook) -> list:
        """Forward hooks on the adapter dropouts that draw a mask: each call's dropped input goes to ``hook``'s
        record of the wrapper's call (called by the capture after registering :meth:`call_recorder`'s hook).

        Args:
            module: the wrapper.
            hook: the wrapper's recording hook (its ``dropped`` list receives the dropout's output).

        Returns:
            The hooks' handles (the capture removes them on exit).
        """

        def keep(dropout, args, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor):
                hook.dropped.append(output.detach())

        return [d.register_forward_hook(keep) for d in self._dropping(module)]


def rows_of(blocks: dict[str, torch.Tensor], name: str, value: torch.Tensor, accumulate: bool) -> None:
    """Write ``value`` (``[M, ...]``) into ``blocks[name]`` if it is being differentiated."""
    if name in blocks:
        write_block(blocks[name], value, accumulate)


def flat_positions(x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``g`` as ``[M, T, features]`` in ``dtype`` (positions flattened)."""
    m = x.shape[0]
    return x.reshape(m, -1, x.shape[-1]).to(dtype), g.reshape(m, -1, g.shape[-1]).to(dtype)
