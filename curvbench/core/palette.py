"""The colours and markers methods are drawn in, colour-blind safe.

Thirteen hues: Paul Tol's "muted" qualitative scheme (nine; Tol,
"Colour Schemes", SRON technical note SRON/EPS/TN/09-002, 2021,
https://personal.sron.nl/~pault/) and four of Okabe & Ito's ("Color
Universal Design", 2008, https://jfly.uni-koeln.de/color/): orange,
yellow, blue and vermillion, the ones at least `MIN_DELTA_E` from every
muted hue. Black and a mid grey are the exact matrices'. Each component
declares one hue (`Component.colour`) and one marker (`Component.marker`),
so a method looks the same in every figure and report; where two methods
share a hue (more methods than hues), their markers tell them apart, and
bars carry the marker's hatch (`HATCHES`), so greyscale prints and
colour-blind readers still can.
"""

from __future__ import annotations

import numpy as np

INDIGO = "#332288"
CYAN = "#88CCEE"
TEAL = "#44AA99"
GREEN = "#117733"
OLIVE = "#999933"
SAND = "#DDCC77"
ROSE = "#CC6677"
WINE = "#882255"
PURPLE = "#AA4499"
ORANGE = "#E69F00"  # Okabe-Ito
YELLOW = "#F0E442"  # Okabe-Ito
BLUE = "#0072B2"  # Okabe-Ito
VERMILLION = "#D55E00"  # Okabe-Ito
BLACK = "#000000"
GREY = "#777777"

HUES = (
  ROSE,
  INDIGO,
  ORANGE,
  TEAL,
  VERMILLION,
  GREEN,
  BLUE,
  WINE,
  OLIVE,
  CYAN,
  PURPLE,
  SAND,
  YELLOW,
)

# Filled markers first (they read at small sizes), then line ones.
MARKERS = (
  "o",
  "s",
  "^",
  "v",
  "D",
  "P",
  "X",
  "h",
  "*",
  "p",
  "<",
  ">",
  "d",
  "H",
  "8",
  "+",
  "x",
  "1",
  "2",
  "3",
  "4",
)
# A bar's hatch, by its method's marker (same position in `MARKERS`).
HATCHES = (
  "",
  "//",
  "\\\\",
  "..",
  "xx",
  "||",
  "--",
  "oo",
  "++",
  "**",
  "/.",
  "\\.",
  "|-",
  "O",
  "x.",
  "-\\",
  "/|",
  "o-",
  "*.",
  "+/",
  "O.",
)

# The least CIELAB distance (CIE76 Delta E) between two methods' hues that
# counts as telling them apart by colour alone: the closest pair Tol
# admits in his muted scheme is 22.8 (olive, sand); 20 is about nine
# times the just-noticeable difference, 2.3 (Sharma, "Digital Color
# Imaging Handbook", 2003), since lines and bars are small marks.
MIN_DELTA_E = 20.0


def lab(colour: str) -> np.ndarray:
  """CIELAB (D65) of a `#rrggbb` sRGB colour."""
  h = colour.lstrip("#")
  rgb = np.array([int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)])
  linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
  to_xyz = np.array(
    [
      [0.4124, 0.3576, 0.1805],
      [0.2126, 0.7152, 0.0722],
      [0.0193, 0.1192, 0.9505],
    ]
  )
  xyz = to_xyz @ linear / np.array([0.95047, 1.0, 1.08883])
  d = 6 / 29
  f = np.where(xyz > d**3, np.cbrt(xyz), xyz / (3 * d**2) + 4 / 29)
  return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def delta_e(a: str, b: str) -> float:
  """The CIE76 colour difference of two `#rrggbb` colours."""
  return float(np.linalg.norm(lab(a) - lab(b)))


def hatch(marker: str) -> str:
  """The bar hatch that goes with `marker`."""
  return HATCHES[MARKERS.index(marker)] if marker in MARKERS else ""
