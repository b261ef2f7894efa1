"""Plain-text tables of metrics (AReaL's ``tabulate_stats``)."""

from __future__ import annotations

from typing import Any

__all__ = ["tabulate_stats"]


def _fmt(v: Any, floatfmt: str) -> str:
    if isinstance(v, float):
        return format(v, floatfmt)
    return str(v)


def tabulate_stats(data: dict[str, Any], col: int = 4, floatfmt: str = ".4e") -> str:
    """``data`` as a grid of ``col`` (key, value) pairs per row, filled column by column."""
    if col < 1:
        raise ValueError(f"col={col}; must be >= 1")
    items = list(data.items())
    if not items:
        return ""
    n_rows = (len(items) + col - 1) // col
    rows = []
    for i in range(n_rows):
        row: list[str] = []
        for j in range(col):
            k = i + j * n_rows
            if k < len(items):
                row += [str(items[k][0]), _fmt(items[k][1], floatfmt)]
        rows.append(row)
    n_cells = max(len(r) for r in rows)
    widths = [max(len(r[c]) for r in rows if c < len(r)) for c in range(n_cells)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [rule]
    for r in rows:
        cells = [f" {r[c] if c < len(r) else '':<{widths[c]}} " for c in range(n_cells)]
        lines += ["|" + "|".join(cells) + "|", rule]
    return "\n".join(lines)
