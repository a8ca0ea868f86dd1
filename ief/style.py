"""One colour per method, used by every figure of the project (the notebooks import it; nothing here plots).

Colours follow the method, never the figure: SGD is always grey, NGD always black, and so on.
"""
from __future__ import annotations

METHOD_COLORS: dict[str, str] = {
    "SGD": "#7f7f7f",  # grey
    "NGD": "#000000",  # black (the exact natural gradient / Fisher)
    "iEF": "#1f77b4",  # blue
    "EF": "#d62728",  # red
    "SF": "#2ca02c",  # green
    "AdamW": "#9467bd",  # purple
    "Adafactor": "#8c564b",  # brown
    "Adam": "#e377c2",  # pink
    "HF": "#17becf",  # cyan (Hessian-free / CG iterates)
    "KFAC": "#bcbd22",  # olive
    "eKFAC": "#ff7f0e",  # orange
    "ieKFAC": "#aec7e8",  # light blue
}

# A qualitative sequence for things that are not methods (trajectories from different starts, samples, ...).
SEQUENCE_COLORS: tuple[str, ...] = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6")


def method_color(name: str) -> str:
    """The project's colour for a method name (case-insensitive); ``ValueError`` listing the known names otherwise."""
    for key, color in METHOD_COLORS.items():
        if key.lower() == name.lower():
            return color
    raise ValueError(f"no colour for method {name!r}; known methods: {', '.join(METHOD_COLORS)}")
