"""The colour science behind :mod:`companion.chapters.style`'s palette: sRGB -> CIELAB, CIEDE2000 colour differences,
simulated colour-vision deficiency and the WCAG contrast of a colour against the page.

Nothing here plots; :mod:`companion.chapters.style` states the palette and ``tests/companion/test_chapters_style.py``
checks it with these functions. References: the sRGB standard (IEC 61966-2-1: its transfer function and D65 matrix), CIE
15:2004 (CIELAB), Sharma, Wu & Dalal 2005 (the CIEDE2000 formula and its test data), Machado, Oliveira & Fernandes 2009
(the dichromacy matrices, severity 1, applied to linear RGB as in their paper) and WCAG 2.1 (relative luminance,
contrast ratio, success criterion 1.4.11 "non-text contrast" >= 3:1).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

# Machado et al. 2009, severity 1.0: linear RGB -> linear RGB as a dichromat sees it
CVD_MATRICES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602),
                   (0.004733, 0.691367, 0.303900)),
}
VISIONS = ("normal",) + tuple(CVD_MATRICES)
_XYZ = ((0.4124564, 0.3575761, 0.1804375), (0.2126729, 0.7151522, 0.0721750), (0.0193339, 0.1191920, 0.9503041))
_WHITE = (0.95047, 1.0, 1.08883)  # D65, Y = 1


def hex_to_rgb(color: str) -> tuple[float, float, float]:
    """``"#rrggbb"`` -> sRGB in [0, 1]. Raises ``ValueError`` naming the value for anything else."""
    text = color.lstrip("#") if isinstance(color, str) else ""
    if len(text) != 6 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise ValueError(f"colour must be '#rrggbb', got {color!r}")
    return tuple(int(text[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def _linear(c: float) -> float:
    return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4


def linear_rgb(color: str) -> tuple[float, float, float]:
    """The linear-light RGB of an sRGB ``"#rrggbb"`` (the sRGB transfer function undone)."""
    return tuple(_linear(c) for c in hex_to_rgb(color))  # type: ignore[return-value]


def _mat(m, v):
    return tuple(sum(a * b for a, b in zip(row, v)) for row in m)


def lab_from_linear(rgb: Sequence[float]) -> tuple[float, float, float]:
    """CIELAB (D65) of a linear RGB triple (clipped to [0, 1] first: a simulated colour may leave the gamut)."""
    xyz = _mat(_XYZ, [min(1.0, max(0.0, c)) for c in rgb])

    def f(t):
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    fx, fy, fz = (f(v / w) for v, w in zip(xyz, _WHITE))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def lab(color: str, vision: str = "normal") -> tuple[float, float, float]:
    """CIELAB of ``color`` as seen with ``vision`` (one of :data:`VISIONS`; a dichromacy is simulated first).

    Raises:
        ValueError: an unknown ``vision``, naming the accepted ones.
    """
    if vision not in VISIONS:
        raise ValueError(f"unknown vision {vision!r}; accepted: {', '.join(VISIONS)}")
    rgb = linear_rgb(color)
    return lab_from_linear(rgb if vision == "normal" else _mat(CVD_MATRICES[vision], rgb))


def delta_e2000(lab1: Sequence[float], lab2: Sequence[float]) -> float:
    """The CIEDE2000 colour difference of two CIELAB colours (k_L = k_C = k_H = 1; Sharma et al. 2005)."""
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    c_bar = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_bar**7 / (c_bar**7 + 25**7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dlp, dcp = l2 - l1, c2p - c1p
    dh = 0.0 if c1p * c2p == 0 else h2p - h1p - 360 * (h2p - h1p > 180) + 360 * (h2p - h1p < -180)
    dhp = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    lbp, cbp = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        hbp = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        hbp = (h1p + h2p) / 2
    else:
        hbp = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(hbp - 30)) + 0.24 * math.cos(math.radians(2 * hbp))
         + 0.32 * math.cos(math.radians(3 * hbp + 6)) - 0.20 * math.cos(math.radians(4 * hbp - 63)))
    d_theta = 30 * math.exp(-(((hbp - 275) / 25) ** 2))
    rc = 2 * math.sqrt(cbp**7 / (cbp**7 + 25**7))
    sl = 1 + 0.015 * (lbp - 50) ** 2 / math.sqrt(20 + (lbp - 50) ** 2)
    sc, sh = 1 + 0.045 * cbp, 1 + 0.015 * cbp * t
    rt = -math.sin(math.radians(2 * d_theta)) * rc
    return math.sqrt((dlp / sl) ** 2 + (dcp / sc) ** 2 + (dhp / sh) ** 2 + rt * (dcp / sc) * (dhp / sh))


def difference(color1: str, color2: str, vision: str = "normal") -> float:
    """CIEDE2000 between two ``"#rrggbb"`` colours as seen with ``vision`` (:data:`VISIONS`)."""
    return delta_e2000(lab(color1, vision), lab(color2, vision))


def relative_luminance(color: str) -> float:
    """WCAG 2.1 relative luminance of an sRGB colour (0: black, 1: white)."""
    r, g, b = linear_rgb(color)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(color1: str, color2: str = "#ffffff") -> float:
    """WCAG 2.1 contrast ratio of two colours (1 to 21), by default of ``color1`` against a white page."""
    y1, y2 = sorted((relative_luminance(color1), relative_luminance(color2)))
    return (y2 + 0.05) / (y1 + 0.05)
