"""Small inline SVG bar charts for the explorer's pages (no script, no download).

Example::

    >>> svg = bar_chart([("a", 3.0), ("b", 1.0)], title="codes")
    >>> svg.startswith("<svg")
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT, MARGIN = 640, 180, 28


def bar_chart(
    bars: Sequence[tuple[str, float]], title: str = "", value_format: str = "{:g}"
) -> str:
    """An SVG of one bar per (label, value), tallest scaled to the chart; a bar's tooltip
    (``<title>``) names its label and value. Labels are drawn when there are few bars."""
    if not bars:
        return f'<svg class="chart" width="{WIDTH}" height="40"><text x="4" y="24">no data</text></svg>'
    top = max(value for _, value in bars) or 1.0
    slot = (WIDTH - 2 * MARGIN) / len(bars)
    body = HEIGHT - 2 * MARGIN
    parts = [
        f'<svg class="chart" role="img" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}"><title>{escape(title)}</title>',
        f'<text x="{MARGIN}" y="16" class="chart-title">{escape(title)}</text>',
    ]
    for i, (label, value) in enumerate(bars):
        height = body * max(value, 0.0) / top
        x, y = MARGIN + i * slot, MARGIN + body - height
        tip = f"{label}: {value_format.format(value)}"
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(slot - 1, 0.5):.1f}" '
            f'height="{height:.1f}"><title>{escape(tip)}</title></rect>'
        )
        if len(bars) <= 16:
            parts.append(
                f'<text x="{x + slot / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle">'
                f"{escape(label)}</text>"
            )
    parts.append(
        f'<text x="{WIDTH - MARGIN}" y="16" text-anchor="end">max {value_format.format(top)}</text>'
    )
    return "".join(parts) + "</svg>"
