"""Markdown helpers shared by the benchmark reports."""

from __future__ import annotations


def cell(value, spec: str) -> str:
    """``value`` formatted with ``spec`` for a table cell, ``-`` when there is none."""
    return "-" if value is None else spec.format(value)


def text_cell(text: str, limit: int = 160) -> str:
    """Free text (an error message) made safe for a table cell."""
    return text.replace("|", "\\|")[:limit]
