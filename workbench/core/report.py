"""Self-contained HTML report pages: sections of text, tables and (plotly) figures in one file; a file
format like `io`, used by the analysis and quality reports and the CLI."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from workbench.core.io import write_text


def table_html(rows: list[dict[str, Any]], digits: int = 3, css: str = "") -> str:
    """An HTML table of `rows` (columns: the first row's keys; floats with `digits` decimals)."""
    cols = list(rows[0]) if rows else []

    def fmt(v: Any) -> str:
        return f"{v:.{digits}f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    cls = f" class='{html.escape(css)}'" if css else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Report:
    """Collect sections, then `write(path)`. Figures are plotly figures; plotly.js is embedded once,
    so the page works offline."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self._js_included = False

    def heading(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def text(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def table(self, rows: list[dict[str, Any]], digits: int = 3) -> None:
        if rows:
            self.parts.append(table_html(rows, digits))

    def figure(self, fig: Any) -> None:
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=not self._js_included))
        self._js_included = True

    def write(self, path: str | Path) -> Path:
        style = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
                 "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}")
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body><h1>{html.escape(self.title)}</h1>{''.join(self.parts)}</body></html>")
        return write_text(path, page)
