"""Peak memory of a call on the CPU, from the profiler's tensor events: what the memory tests measure with."""
from __future__ import annotations

import itertools

import torch


def peak_added_bytes(fn) -> int:
    """The peak of live CPU tensor memory above the start while ``fn()`` runs (the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    return max(0, max(itertools.accumulate(e.nbytes() for e in events), default=0))
