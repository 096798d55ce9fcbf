"""Draw the installable app's icons (issue 17): ``python consumers/web/icons.py``.

Writes ``static/icons/icon-192.png``, ``icon-512.png`` (purpose "any": the
shield on a rounded dark square) and ``icon-maskable-512.png`` (purpose
"maskable": full-bleed background, the shield inside the central 80 % safe
zone a launcher may crop to a circle). Standard library only (zlib, struct):
the output is deterministic, byte for byte, and committed; run this again
only when the drawing changes.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

OUT = Path(__file__).resolve().parent / "static" / "icons"
BG = (15, 27, 51)  # #0f1b33, the page header and theme_color
FG = (143, 176, 255)  # #8fb0ff, the logo colour in the header
SAMPLES = 4  # supersampling per axis (anti-aliased edges)


def _cubic(p0: tuple[float, float], p1: tuple[float, float], p2: tuple[float, float], p3: tuple[float, float], n: int = 16) -> list[tuple[float, float]]:
    out = []
    for i in range(1, n + 1):
        t = i / n
        u = 1 - t
        out.append((
            u**3 * p0[0] + 3 * u * u * t * p1[0] + 3 * u * t * t * p2[0] + t**3 * p3[0],
            u**3 * p0[1] + 3 * u * u * t * p1[1] + 3 * u * t * t * p2[1] + t**3 * p3[1],
        ))
    return out


def shield() -> list[tuple[float, float]]:
    """The header logo's path (index.html: M12 2 4 5v6c0 5 3.4 9.3 8 11 4.6-1.7 8-6 8-11V5l-8-3Z) on a 24-unit grid."""
    pts = [(12.0, 2.0), (4.0, 5.0), (4.0, 11.0)]
    pts += _cubic((4, 11), (4, 16), (7.4, 20.3), (12, 22))
    pts += _cubic((12, 22), (16.6, 20.3), (20, 16), (20, 11))
    pts += [(20.0, 5.0)]
    return pts


def _inside(poly: list[tuple[float, float]], x: float, y: float) -> bool:
    hit = False
    j = len(poly) - 1
    for i, (xi, yi) in enumerate(poly):
        xj, yj = poly[j]
        if (yi > y) != (yj > y) and x < (xj - xi) * (y - yi) / (yj - yi) + xi:
            hit = not hit
        j = i
    return hit


def _in_rounded_square(x: float, y: float, size: int, radius: float) -> bool:
    cx = min(max(x, radius), size - radius)
    cy = min(max(y, radius), size - radius)
    return (x - cx) ** 2 + (y - cy) ** 2 <= radius**2


def draw(size: int, *, maskable: bool) -> bytes:
    """RGBA rows of one icon: the shield scaled to 62 % (maskable: 50 %) of the side, centred."""
    scale = size * (0.50 if maskable else 0.62) / 20.0  # the shield spans 20 units (2..22)
    ox = size / 2 - 12 * scale
    oy = size / 2 - 12 * scale
    poly = [(ox + x * scale, oy + y * scale) for x, y in shield()]
    xs = [p[0] for p in poly]
    ys = [p[1] for p in poly]
    box = (min(xs) - 1, max(xs) + 1, min(ys) - 1, max(ys) + 1)
    radius = size * 0.18
    n = SAMPLES * SAMPLES
    rows = bytearray()
    for py in range(size):
        rows.append(0)  # filter type 0 for this scanline
        for px in range(size):
            bg = fg = 0
            for sy in range(SAMPLES):
                for sx in range(SAMPLES):
                    x = px + (sx + 0.5) / SAMPLES
                    y = py + (sy + 0.5) / SAMPLES
                    if maskable or _in_rounded_square(x, y, size, radius):
                        bg += 1
                        if box[0] <= x <= box[1] and box[2] <= y <= box[3] and _inside(poly, x, y):
                            fg += 1
            if bg == 0:
                rows += b"\0\0\0\0"
                continue
            # Colour over the covered part; alpha is the covered fraction (edges of the rounded square).
            r, g, b = (round((c_fg * fg + c_bg * (bg - fg)) / bg) for c_fg, c_bg in zip(FG, BG, strict=True))
            rows += bytes((r, g, b, round(255 * bg / n)))
    return bytes(rows)


def png(size: int, rgba_rows: bytes) -> bytes:
    """A PNG (RFC 2083): 8-bit RGBA, no interlace, one IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rgba_rows, 9)) + chunk(b"IEND", b"")


ICONS = {"icon-192.png": (192, False), "icon-512.png": (512, False), "icon-maskable-512.png": (512, True)}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (size, maskable) in ICONS.items():
        (OUT / name).write_bytes(png(size, draw(size, maskable=maskable)))
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
