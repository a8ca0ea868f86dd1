"""One colour per method, used by every figure of the project (the notebooks import it; nothing here plots).

Colours follow the method, never the figure: NGD is always black, SGD always grey, iEF always blue, EF always
vermillion, and so on. The palette is colour-blind-safe by construction and by test
(``tests/companion/test_chapters_style.py``, with the colour science of :mod:`companion.chapters.colour`):

* **Method colours** (:data:`METHOD_COLORS`): black, grey, Paul Tol's vibrant blue (iEF) and red (EF), Okabe-Ito's
  bluish green (eKFAC) and reddish purple (Adafactor), and darker shades of Tol's and Okabe-Ito's colours for the
  others, chosen (by a max-min search over those palettes and their 85/70/55 % shades) so that

  - every colour has a WCAG 2.1 contrast of at least 3:1 against the white page (non-text contrast, SC 1.4.11: no
    pale line beside a saturated one);
  - every two methods differ by CIEDE2000 >= 15;
  - every two methods that share a figure (:data:`FIGURE_GROUPS`) differ by CIEDE2000 >= 20 in normal vision and
    >= 10 under simulated deuteranopia and protanopia (Machado et al. 2009), and, both coloured (chroma > 15), by at
    least 35 degrees of CIELAB hue: no "light blue beside blue".

  Lines drawn per method also carry a marker and a dash of their own (the plotting modules), so colour is never the
  only cue.
* **Non-method colours**: :data:`SEQUENCE_COLORS` for series that are not methods (trajectories from different
  starts, setups, samples) and :data:`FIELD_COLORS` for the vector field drawn for a method in the toy chapter (greys:
  no hue, so a trajectory drawn over it never takes the field's hue). Each sequence colour differs from every method
  colour by CIEDE2000 >= 15, so a trajectory never takes the hue of the method beside it.
"""
from __future__ import annotations

METHOD_COLORS: dict[str, str] = {
    "SGD": "#777777",  # grey
    "NGD": "#000000",  # black (the exact natural gradient / Fisher)
    "iEF": "#0077BB",  # blue (Tol vibrant)
    "EF": "#CC3311",  # vermillion (Tol vibrant red)
    "SF": "#09411C",  # dark green
    "AdamW": "#332288",  # indigo (Tol muted)
    "Adafactor": "#CC79A7",  # reddish purple (Okabe-Ito)
    "Adam": "#4A122E",  # dark wine
    "HF": "#C38700",  # ochre (Okabe-Ito orange, 85 %)
    "KFAC": "#AA3377",  # purple (Tol bright)
    "eKFAC": "#009E73",  # bluish green (Okabe-Ito)
    "ieKFAC": "#6B5300",  # dark olive
    "iEF+M": "#661100",  # dark rust: iEF with momentum and weight decay (the practical chapter)
}

# Which methods share a figure of the book (their colours must be told apart in it, also by colour-blind readers):
# the E2 curves and the learning-rate search (a setup's baselines with SGD and the three curvature methods), the
# block-diagonal study, the toy vector fields, and E1/E3 with their Hessian-free reference.
FIGURE_GROUPS: tuple[frozenset[str], ...] = (
    frozenset({"Adam", "AdamW", "SGD", "EF", "SF", "iEF"}),
    frozenset({"Adafactor", "AdamW", "SGD", "EF", "SF", "iEF"}),
    frozenset({"iEF", "ieKFAC", "KFAC", "eKFAC"}),
    frozenset({"SGD", "NGD", "iEF", "EF"}),
    frozenset({"SGD", "EF", "SF", "iEF", "HF"}),
    # the practical chapter (beyond the paper): iEF with and without momentum beside each method's baseline (its
    # K-FAC family is drawn beside iEF, the block-diagonal study's group)
    frozenset({"AdamW", "iEF", "iEF+M"}),
    frozenset({"Adam", "iEF", "iEF+M"}),
    frozenset({"Adafactor", "iEF", "iEF+M"}),
)

# A qualitative sequence for things that are not methods (trajectories from different starts, setups, samples).
SEQUENCE_COLORS: tuple[str, ...] = ("#00BBCC", "#9944FF", "#447700", "#884400", "#006666", "#999966", "#444455")



def _grey(white: float) -> str:
    """Black mixed with ``white`` parts of white (0: black, 1: white), as ``"#rrggbb"``."""
    return "#" + f"{round(255 * white):02x}" * 3


# The vector field of a method in the toy chapter, and the loss contours under it: greys (no hue at all), so they
# cannot share a hue with the chromatic per-start trajectory colours (SEQUENCE_COLORS). NGD's field is drawn wide and
# pale under iEF's thin dark one where the two coincide (least squares): told apart by lightness, for every reader.
FIELD_COLORS: dict[str, str] = {"SGD": _grey(0.5), "NGD": _grey(0.65), "iEF": _grey(0.3), "EF": _grey(0.5)}
CONTOUR_COLOR = _grey(0.82)


def method_color(name: str) -> str:
    """The project's colour for a method.

    Args:
        name: a method name of :data:`METHOD_COLORS`, any case (``"ief"``, ``"iEF"``).

    Returns:
        Its colour, ``"#rrggbb"``.

    Raises:
        ValueError: an unknown method, listing the known ones.
    """
    for key, color in METHOD_COLORS.items():
        if key.lower() == name.lower():
            return color
    raise ValueError(f"no colour for method {name!r}; known methods: {', '.join(METHOD_COLORS)}")
