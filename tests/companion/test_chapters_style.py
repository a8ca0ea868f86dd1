"""companion.chapters.style's palette, checked with companion.chapters.colour (itself checked against published
reference values): every method visible on the white page, every two methods told apart, every two that share a figure
told apart by colour-blind readers too and not by lightness alone, and the non-method colours apart from every method
colour."""
from __future__ import annotations

import itertools
import math

import pytest

from companion.chapters import colour
from companion.chapters.style import (CONTOUR_COLOR, FIELD_COLORS, FIGURE_GROUPS, METHOD_COLORS, SEQUENCE_COLORS,
                                      method_color)

OLD_PALETTE = {  # the earlier palette: tab10 with light blue ieKFAC beside blue iEF
    "SGD": "#7f7f7f", "NGD": "#000000", "iEF": "#1f77b4", "EF": "#d62728", "SF": "#2ca02c", "AdamW": "#9467bd",
    "Adafactor": "#8c564b", "Adam": "#e377c2", "HF": "#17becf", "KFAC": "#bcbd22", "eKFAC": "#ff7f0e",
    "ieKFAC": "#aec7e8"}


def _chroma_hue(color):
    _, a, b = colour.lab(color)
    return math.hypot(a, b), math.degrees(math.atan2(b, a)) % 360


def palette_problems(palette: dict[str, str]) -> list[str]:
    """What makes a method palette fail the rules stated in companion.chapters.style's docstring (empty: it passes)."""
    problems = [f"{m} {c}: contrast {colour.contrast(c):.2f} < 3 against white" for m, c in palette.items()
                if colour.contrast(c) < 3]
    for a, b in itertools.combinations(palette, 2):
        ca, cb = palette[a], palette[b]
        normal = colour.difference(ca, cb)
        together = any(a in g and b in g for g in FIGURE_GROUPS)
        if normal < (20 if together else 15):
            problems.append(f"{a}/{b}: CIEDE2000 {normal:.1f}")
        if not together:
            continue
        for vision in ("deuteranopia", "protanopia"):
            if (d := colour.difference(ca, cb, vision)) < 10:
                problems.append(f"{a}/{b}: CIEDE2000 {d:.1f} under {vision}")
        (c1, h1), (c2, h2) = _chroma_hue(ca), _chroma_hue(cb)
        if c1 > 15 and c2 > 15 and min(abs(h1 - h2), 360 - abs(h1 - h2)) < 35:
            problems.append(f"{a}/{b}: hues {h1:.0f} and {h2:.0f} degrees apart by < 35")
    return problems


def test_the_method_palette_passes_its_rules():
    assert set().union(*FIGURE_GROUPS) <= set(METHOD_COLORS)
    assert palette_problems(METHOD_COLORS) == []


def test_the_rules_fail_the_old_palette_light_blue_iekfac_beside_blue_ief():
    problems = palette_problems(OLD_PALETTE)
    assert any(p.startswith("ieKFAC #aec7e8: contrast 1.73") for p in problems), problems
    assert any(p.startswith("iEF/ieKFAC: hues") for p in problems), problems


def test_non_method_colours_differ_from_every_method_colour_and_from_each_other():
    for c in SEQUENCE_COLORS:
        nearest = min(METHOD_COLORS.values(), key=lambda m: colour.difference(c, m))
        assert colour.difference(c, nearest) >= 15, (c, nearest)
    for a, b in itertools.combinations(SEQUENCE_COLORS, 2):
        assert colour.difference(a, b) >= 15, (a, b)
    for s, f in itertools.product(SEQUENCE_COLORS[:5], FIELD_COLORS.values()):  # a toy panel: 5 paths on a field
        assert colour.difference(s, f) >= 15, (s, f)
    assert all(colour.contrast(c) >= 2 for c in SEQUENCE_COLORS)  # thin trajectories stay visible
    for c in (*FIELD_COLORS.values(), CONTOUR_COLOR):  # greys: no hue a trajectory could share
        assert _chroma_hue(c)[0] < 1, c
    for vision in ("deuteranopia", "protanopia"):  # NGD's and iEF's fields are drawn over each other
        assert colour.difference(FIELD_COLORS["NGD"], FIELD_COLORS["iEF"], vision) >= 10
    assert colour.lab(CONTOUR_COLOR)[0] > max(colour.lab(c)[0] for c in FIELD_COLORS.values())  # contours under all


def test_method_color_is_case_insensitive_and_names_the_known_methods():
    assert method_color("ief") == method_color("iEF") == METHOD_COLORS["iEF"]
    with pytest.raises(ValueError, match="no colour for method 'lbfgs'; known methods: SGD, NGD, iEF"):
        method_color("lbfgs")


# ------------------------------------------------------------------------------------- companion.chapters.colour
SHARMA_2005 = [  # CIEDE2000 test data of Sharma, Wu & Dalal (2005), Table 1: pairs 1, 2, 7, 17-20
    ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
    ((50.0, 3.1571, -77.2803), (50.0, 0.0, -82.7485), 2.8615),
    ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669), ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
    ((50.0, 2.5, 0.0), (61.0, -5.0, 29.0), 22.8977), ((50.0, 2.5, 0.0), (56.0, -27.0, -3.0), 31.9030),
    ((50.0, 2.5, 0.0), (58.0, 24.0, 15.0), 19.4535)]


@pytest.mark.parametrize("lab1, lab2, expected", SHARMA_2005)
def test_ciede2000_matches_sharma_2005_and_is_symmetric(lab1, lab2, expected):
    assert colour.delta_e2000(lab1, lab2) == pytest.approx(expected, abs=1e-4)
    assert colour.delta_e2000(lab2, lab1) == pytest.approx(expected, abs=1e-4)


def test_lab_contrast_and_simulated_dichromacy_reference_values():
    assert colour.lab("#ffffff") == pytest.approx((100, 0, 0), abs=1e-3)
    assert colour.lab("#ff0000") == pytest.approx((53.2408, 80.0925, 67.2032), abs=1e-3)  # CIE 15 / Lindbloom
    assert colour.contrast("#000000") == pytest.approx(21.0)
    assert colour.contrast("#777777") == pytest.approx(4.48, abs=0.01)  # WebAIM's value for #777 on white
    # a dichromat confuses red and green: the two differ far less under the simulation than in normal vision
    assert colour.difference("#ff0000", "#00aa00", "deuteranopia") < 0.5 * colour.difference("#ff0000", "#00aa00")
    for vision in colour.VISIONS:  # greys are seen as greys
        assert colour.lab("#808080", vision) == pytest.approx(colour.lab("#808080"), abs=0.5)


@pytest.mark.parametrize("bad", ["red", "#12345", "#gggggg", None])
def test_a_bad_colour_or_vision_is_named(bad):
    with pytest.raises(ValueError, match="colour must be '#rrggbb'"):
        colour.hex_to_rgb(bad)
    with pytest.raises(ValueError, match="unknown vision 'achromatopsia'; accepted: normal, deuteranopia"):
        colour.lab("#000000", "achromatopsia")
