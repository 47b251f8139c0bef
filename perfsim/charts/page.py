"""Self-contained HTML pages: plotly.js embedded once, then the figures; nothing fetched from the
network, so a page opens offline (an HPC login node, a laptop on a train)."""

from __future__ import annotations

import html

import plotly.io as pio
from plotly.offline import get_plotlyjs

from perfsim.files import write_output

CONFIG = {"displaylogo": False, "responsive": True, "toImageButtonOptions": {"format": "png", "scale": 2}}

_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1500px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
p.lead, p.note { color: #555; max-width: 70em; }
section.chart { margin-bottom: 2em; }
"""


def page_html(sections: list, heading: str, lead: str = "", h1: bool = True) -> str:
    """One HTML document. `sections`: (heading or "", figure or None, note) per chart, the note a
    string or a list of paragraphs; a section without a figure shows its note only (what is
    missing and why)."""
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{html.escape(heading)}</title>",
             f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<style>{_STYLE}</style>",
             f"<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>\n<body>",
             f"<h1>{html.escape(heading)}</h1>" if h1 else ""]
    if lead:
        parts.append(f"<p class=\"lead\">{html.escape(lead)}</p>")
    for n, (name, fig, note) in enumerate(sections):
        parts.append(f"<section class=\"chart\" id=\"section-{n}\">")
        if name:
            parts.append(f"<h2>{html.escape(name)}</h2>")
        for paragraph in [note] if isinstance(note, str) else note:
            if paragraph:
                parts.append(f"<p class=\"note\">{html.escape(paragraph)}</p>")
        if fig is not None:
            parts.append(pio.to_html(fig, include_plotlyjs=False, full_html=False, config=CONFIG,
                                     div_id=f"chart-{n}"))
        parts.append("</section>")
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)


def write_page(path: str, sections: list, heading: str, lead: str = "", h1: bool = True) -> int:
    """Write the page; returns its size in bytes. Problems with `path` are PerfsimErrors."""
    text = page_html(sections, heading, lead, h1)
    write_output(path, "--out", text, example="chart.html")
    return len(text.encode("utf-8"))


def write_figure(path: str, fig, heading: str = "") -> int:
    """One figure as a page (the heading is the window title; the figure carries its own)."""
    name = heading or _plain(fig.layout.title.text or "perfsim chart")
    return write_page(path, [("", fig, "")], name, h1=False)


def _plain(text: str) -> str:
    import re

    return re.sub(r"<[^>]+>", " ", text.split("<br>")[0]).strip()
