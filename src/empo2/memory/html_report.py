"""A self-contained HTML report of a tip memory: tips per task, utility and usage histograms, best and worst tips.

Everything is inline (CSS, PNG histograms as base64 data URIs) so the page can be mailed or archived as one file.
All stored text is HTML-escaped.
"""

from __future__ import annotations

import base64
import io
import time
from html import escape
from pathlib import Path

from .store import Tip, TipMemory

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%;font-size:.9em}th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.figs{display:flex;gap:1em;flex-wrap:wrap}.figs img{max-width:48%;border:1px solid #eee}.muted{color:#777}
"""


def _hist_png(values: list[float], title: str, xlabel: str) -> str:
    """A histogram as an ``<img>`` with a base64 PNG (or a note when there is nothing to plot)."""
    if not values:
        return f'<p class="muted">{escape(title)}: no data yet.</p>'
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=90)
    ax.hist(values, bins=min(30, max(5, len(set(values)))), color="#4c78a8", edgecolor="white")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tips")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{escape(title)}" src="data:image/png;base64,{data}">'


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def _tip_table(tips: list[Tip]) -> str:
    if not tips:
        return '<p class="muted">none</p>'
    rows = "".join(
        f"<tr><td class='n'>{t.id}</td><td>{escape(t.namespace)}</td><td>{escape(t.text)}</td>"
        f"<td class='n'>{_num(t.utility)}</td><td class='n'>{t.utility_n}</td><td class='n'>{t.use_count}</td>"
        f"<td class='n'>{_num(t.score)}</td><td class='n'>{t.step}</td></tr>" for t in tips)
    return ("<table><tr><th>id</th><th>namespace</th><th>tip</th><th>utility</th><th>rated</th><th>uses</th>"
            f"<th>score</th><th>step</th></tr>{rows}</table>")


def render_report(memory: TipMemory, top: int = 10, per_task: int = 20) -> str:
    """The report as an HTML string."""
    stats = memory.stats()
    tips = memory.all_tips()
    rated = sorted((t for t in tips if t.utility is not None), key=lambda t: (t.utility, -t.utility_n, t.id))
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Tip memory — {escape(str(memory.path.name))}</title><style>{_CSS}</style></head><body>",
        f"<h1>Tip memory report</h1><p class='muted'>{escape(str(memory.path))} · generated "
        f"{escape(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))}</p>",
        f"<p>{stats['tips']} tips in {len(stats['namespaces'])} namespaces · {stats['rated_tips']} rated · mean "
        f"utility {_num(stats['mean_utility'])} · {stats['rejected']} rejected · {stats['evicted']} evicted · "
        f"capacity {stats['capacity']}/namespace ({escape(stats['eviction'])} eviction)</p>",
        "<h2>Tips per task</h2><table><tr><th>namespace</th><th>tips</th><th>rated</th><th>mean utility</th>"
        "<th>uses</th></tr>",
    ]
    for ns, s in stats["namespaces"].items():
        parts.append(f"<tr><td>{escape(ns)}</td><td class='n'>{s['tips']}</td><td class='n'>{s['rated']}</td>"
                     f"<td class='n'>{_num(s['mean_utility'])}</td><td class='n'>{s['uses'] or 0}</td></tr>")
    parts.append("</table>")
    if stats["rejections"]:
        parts.append("<h2>Rejected tips by reason</h2><table><tr><th>reason</th><th>count</th></tr>")
        parts += [f"<tr><td>{escape(r)}</td><td class='n'>{n}</td></tr>" for r, n in sorted(stats["rejections"].items())]
        parts.append("</table>")
    parts += [
        "<h2>Distributions</h2><div class='figs'>",
        _hist_png([t.utility for t in rated], "Utility (mean return of episodes using the tip)", "utility"),
        _hist_png([float(t.use_count) for t in tips], "Usage (times shown in a prompt)", "uses"),
        "</div>",
        f"<h2>Most useful tips</h2>{_tip_table(rated[::-1][:top])}",
        f"<h2>Least useful tips</h2>{_tip_table(rated[:top])}",
        "<h2>Tips by task</h2>",
    ]
    for ns in stats["namespaces"]:
        ns_tips = sorted((t for t in tips if t.namespace == ns), key=lambda t: -t.id)
        more = len(ns_tips) - per_task
        parts.append(f"<h3>{escape(ns)}</h3>{_tip_table(ns_tips[:per_task])}")
        if more > 0:
            parts.append(f"<p class='muted'>… and {more} older tips (see <code>empo2 memory export</code>).</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(memory: TipMemory, path: str | Path, **kwargs) -> Path:
    """Write :func:`render_report` to ``path`` (UTF-8) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(memory, **kwargs), encoding="utf-8")
    return out
