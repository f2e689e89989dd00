"""A self-contained HTML picture of a graph dump: where the collectives are and what they move.

A training step is hundreds to tens of thousands of nodes; one node-link diagram of it is unreadable.
The page (inline SVG and CSS, no scripts, no network) shows instead:

1. the job, and the collectives per step on this rank (count and bytes per kind);
2. a timeline: each collective at its position in graph order (forward, backward and optimizer run
   left to right), bar height the log of the bytes it produces, coloured by kind;
3. a map of every node, one square each in graph order, coloured by what it is (input by role,
   compute, collective, wait, write-back); hovering shows the node's line, a collective links to its card;
4. one card per collective: its neighbourhood (two hops up from the collective, two hops down from its
   ``wait_tensor``), laid out left to right by ``networkx.topological_generations``, with the
   placements of each value on its edges.

The graph model is a ``networkx.DiGraph`` built from the parsed text form, so a picture can be made
of any dump file, not only of a live graph.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Optional

import networkx as nx

from .graph_text import DumpNode, GraphDump, collective_kind

__all__ = ["to_networkx", "render_html"]

WAIT_OP = "_c10d_functional.wait_tensor.default"
WRITE_BACK_OP = "aten.copy_.default"
MAX_CARDS = 120  # neighbourhood cards drawn; the map and timeline still show every collective

KIND_COLOURS = {
    "all_gather": "#1f77b4",
    "reduce_scatter": "#ff7f0e",
    "all_reduce": "#d62728",
    "all_to_all": "#9467bd",
    "broadcast": "#2ca02c",
}
CATEGORY_COLOURS = {
    "param": "#3a7d44",
    "state": "#7fb8a4",
    "grad": "#b07aa1",
    "buffer": "#9c9c5c",
    "batch": "#e6c229",
    "input": "#e6c229",
    "compute": "#cfd3d8",
    "redistribute": "#f4b6b6",
    "wait": "#7a7a7a",
    "write-back": "#4a4a4a",
    "output": "#111111",
    **KIND_COLOURS,
}
# Element sizes of torch's dtype abbreviations (torch.fx.graph.dtype_abbrs); the rest are 1 byte.
_BYTES_PER_ELEMENT = {
    **dict.fromkeys(("c128",), 16),
    **dict.fromkeys(("f64", "i64", "u64", "c64"), 8),
    **dict.fromkeys(("f32", "i32", "u32", "c32"), 4),
    **dict.fromkeys(("f16", "bf16", "i16", "u16"), 2),
}
_TENSOR = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _category(node: DumpNode) -> str:
    kind = collective_kind(node.op)
    if kind:
        return kind
    if node.op == "placeholder":
        role = node.name.split(":", 1)[0]
        return role if role in CATEGORY_COLOURS else "input"
    if node.op == WAIT_OP:
        return "wait"
    if node.op == WRITE_BACK_OP:
        return "write-back"
    if node.op == "output":
        return "output"
    return "redistribute" if "->" in node.placements else "compute"


def value_bytes(value: str) -> int:
    """Bytes of a VALUE text (``f32[32,16]`` -> 2048; tuples summed; unknown dtypes as 1 byte)."""
    total = 0
    for dtype, shape in _TENSOR.findall(value):
        total += math.prod(int(s) for s in shape.split(",") if s) * _BYTES_PER_ELEMENT.get(dtype, 1)
    return total


def to_networkx(graph: GraphDump) -> nx.DiGraph:
    """A ``DiGraph`` with one node per dump node (attributes ``index``, ``line`` (the
    :class:`DumpNode`), ``category``) and an edge from each node to every node that reads it."""
    g = nx.DiGraph()
    for index, node in enumerate(graph.nodes):
        g.add_node(node.name, index=index, line=node, category=_category(node))
    for node in graph.nodes:
        for ref in node.refs:
            g.add_edge(ref, node.name)
    return g


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _anchor(name: str) -> str:
    return "n-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def _neighbourhood(g: nx.DiGraph, name: str, hops: int = 2, width: int = 4) -> set[str]:
    """The collective ``name``, its waits, ``hops`` levels of producers above it and of consumers
    below its waits, at most ``width`` nodes a level (the nearest in graph order)."""
    index = lambda n: g.nodes[n]["index"]  # noqa: E731
    waits = [s for s in g.successors(name) if g.nodes[s]["category"] == "wait"]
    keep = {name, *waits}
    for frontier, step, nearest_first in (([name], g.predecessors, True), (waits or [name], g.successors, False)):
        for _ in range(hops):
            found = {n for f in frontier for n in step(f)} - keep
            frontier = sorted(found, key=index, reverse=nearest_first)[:width]
            keep.update(frontier)
    return keep


_BOX_W, _BOX_H, _COL_W, _ROW_H = 178, 38, 278, 52


def _card_svg(g: nx.DiGraph, name: str) -> str:
    index = lambda n: g.nodes[n]["index"]  # noqa: E731
    sub = g.subgraph(_neighbourhood(g, name))
    # Sets order strings differently in every process; graph order keeps the page deterministic.
    layers = [sorted(layer, key=index) for layer in nx.topological_generations(sub)]
    pos = {n: (12 + col * _COL_W, 10 + row * _ROW_H) for col, layer in enumerate(layers) for row, n in enumerate(layer)}
    width = 24 + (len(layers) - 1) * _COL_W + _BOX_W
    height = 20 + max(len(layer) for layer in layers) * _ROW_H
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for src, dst in sorted(sub.edges, key=lambda e: (index(e[0]), index(e[1]))):
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        x1, y1, y2 = x1 + _BOX_W, y1 + _BOX_H / 2, y2 + _BOX_H / 2
        mid = (x1 + x2) / 2
        parts.append(f'<path class="edge" d="M{x1},{y1} C{mid},{y1} {mid},{y2} {x2 - 3},{y2}" marker-end="url(#arrow)"/>')
    # Every edge out of a node carries the same value, so its placements are written once, where the edges leave.
    for src in sorted(sub, key=index):
        label = g.nodes[src]["line"].placements
        if label != "-" and sub.out_degree(src):
            x, y = pos[src]
            text = _esc(_clip(label, 15))
            parts.append(f'<text class="edge-label" x="{x + _BOX_W + 5}" y="{y + _BOX_H / 2 - 4}">{text}</text>')
    for n, (x, y) in sorted(pos.items(), key=lambda item: index(item[0])):
        node: DumpNode = g.nodes[n]["line"]
        category = g.nodes[n]["category"]
        stroke = ' stroke="#000" stroke-width="2"' if n == name else ""
        dark = category in ("param", "wait", "write-back", "output", *KIND_COLOURS)
        parts.append(
            f'<g><title>{_esc(node.text)}</title>'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="5" fill="{CATEGORY_COLOURS[category]}"{stroke}/>'
            f'<text class="{"box dark" if dark else "box"}" x="{x + 6}" y="{y + 15}">%{_esc(_clip(node.name, 27))}</text>'
            f'<text class="{"sub dark" if dark else "sub"}" x="{x + 6}" y="{y + 30}">{_esc(_clip(node.value, 30))}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _timeline_svg(g: nx.DiGraph, collectives: list[str], total: int) -> str:
    width, height, left = 960, 96, 10
    sizes = {n: value_bytes(g.nodes[n]["line"].value) for n in collectives}
    top = math.log2(2 + max(sizes.values(), default=0))
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    parts.append(f'<line x1="{left}" y1="{height - 12}" x2="{width - left}" y2="{height - 12}" stroke="#999"/>')
    for n in collectives:
        x = left + (width - 2 * left) * g.nodes[n]["index"] / max(1, total - 1)
        h = 8 + (height - 30) * math.log2(2 + sizes[n]) / top
        node: DumpNode = g.nodes[n]["line"]
        parts.append(
            f'<a href="#{_anchor(n)}"><rect x="{x - 1.5:.1f}" y="{height - 12 - h:.1f}" width="3" height="{h:.1f}" '
            f'fill="{KIND_COLOURS.get(g.nodes[n]["category"], "#000")}"><title>{_esc(node.text)} '
            f'({sizes[n]:,} B out)</title></rect></a>'
        )
    parts.append(f'<text class="axis" x="{left}" y="{height - 1}">first node</text>')
    parts.append(f'<text class="axis" x="{width - left}" y="{height - 1}" text-anchor="end">last node ({total})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _map_svg(g: nx.DiGraph, graph: GraphDump) -> str:
    cols = 64 if len(graph.nodes) <= 4096 else 128
    cell = 12 if cols == 64 else 7
    rows = math.ceil(len(graph.nodes) / cols)
    width, height = cols * cell + 2, rows * cell + 2
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for index, node in enumerate(graph.nodes):
        x, y = 1 + (index % cols) * cell, 1 + (index // cols) * cell
        category = g.nodes[node.name]["category"]
        rect = (
            f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{CATEGORY_COLOURS[category]}"'
            + (' stroke="#000" stroke-width="1"' if category in KIND_COLOURS else "")
            + f"><title>{_esc(node.text)}</title></rect>"
        )
        parts.append(f'<a href="#{_anchor(node.name)}">{rect}</a>' if category in KIND_COLOURS else rect)
    parts.append("</svg>")
    return "".join(parts)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #ddd; }
th:first-child, td:first-child { text-align: left; }
code, .box, .sub, .edge-label, .axis { font-family: ui-monospace, monospace; }
.legend span { display: inline-block; margin-right: 12px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; margin: 12px 0; overflow-x: auto; }
.card h3 { font-size: 14px; margin: 0 0 6px; font-weight: 600; }
.box { font-size: 11px; fill: #111; } .sub { font-size: 10px; fill: #333; } .dark { fill: #fff; }
.edge { fill: none; stroke: #777; stroke-width: 1.2; }
.edge-label { font-size: 10px; fill: #a01010; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.axis { font-size: 10px; fill: #666; }
"""


# Referenced by every card's edges (url(#arrow)); defined once for the page.
_ARROW_DEFS = (
    '<svg width="0" height="0" style="position:absolute"><defs><marker id="arrow" viewBox="0 0 10 10" refX="9" '
    'refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs></svg>'
)


def _table(rows: list[tuple], head: tuple) -> str:
    cells = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def render_html(graph: GraphDump, summary: Optional[dict[str, Any]] = None) -> str:
    """The picture of ``graph`` (best: a per-rank stage) as one self-contained HTML page.

    ``summary`` (the dump's ``summary.json``) adds nodes per stage and bytes per rank to the header;
    without it the collectives come from the graph's own header.
    """
    g = to_networkx(graph)
    collectives = [n.name for n in graph.nodes if g.nodes[n.name]["category"] in KIND_COLOURS]
    table = (summary or {}).get("collectives_per_step") or {
        k: {"count": c, "bytes": b} for k, (c, b) in graph.collectives.items()
    }
    out = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>spmd-expand dump: {_esc(graph.header.get('job', graph.source))}</title><style>{_CSS}</style></head><body>",
        _ARROW_DEFS,
        f"<h1>{_esc(graph.header.get('stage', 'graph'))}: <code>{_esc(graph.header.get('job', graph.source))}</code></h1>",
        f"<p>{_esc(graph.header.get('description', ''))}; {_esc(graph.header.get('step', ''))}; {len(graph.nodes)} nodes.</p>",
        "<h2>Collectives per step (this rank)</h2>",
        _table(
            [(k, f"{v['count']:,}", f"{v['bytes']:,}") for k, v in sorted(table.items())] or [("none", 0, 0)],
            ("kind", "count", "bytes"),
        ),
    ]
    if summary:
        stages = ", ".join(f"{name} {s['nodes']}" for name, s in summary.get("stages", {}).items())
        persistent = summary.get("persistent_bytes_per_rank", {})
        out.append(
            f"<p>Nodes per stage: {_esc(stages)}. Persistent bytes per rank: "
            + _esc(", ".join(f"{k} {v:,}" for k, v in persistent.items()))
            + f". Peak live bytes per rank: {summary.get('peak_live_bytes_per_rank', 0):,}.</p>"
        )
    legend = "".join(f'<span><i style="background:{c}"></i>{_esc(k)}</span>' for k, c in CATEGORY_COLOURS.items())
    out += [
        "<h2>Timeline: collectives in graph order</h2>",
        "<p>Bar height: log of the bytes a collective produces. Click a bar for its neighbourhood.</p>",
        _timeline_svg(g, collectives, len(graph.nodes)),
        "<h2>Map: every node in graph order</h2>",
        f'<p class="legend">{legend}</p>',
        "<p>Rows read left to right, top to bottom. Hover a square for its line; collectives (outlined) link to their card.</p>",
        _map_svg(g, graph),
        "<h2>Collectives and their neighbourhood</h2>",
        (
            "<p>Two hops of producers and consumers; each edge is labelled with the placements of the value it "
            "carries (<code>SRC-&gt;DST</code> on values a redistribution produced).</p>"
        ),
    ]
    for name in collectives[:MAX_CARDS]:
        node: DumpNode = g.nodes[name]["line"]
        out.append(
            f'<div class="card" id="{_anchor(name)}"><h3>{_esc(g.nodes[name]["category"])} <code>%{_esc(name)}</code>: '
            f"{_esc(node.placements)}, {_esc(node.value)} ({value_bytes(node.value):,} B out)</h3>{_card_svg(g, name)}</div>"
        )
    if len(collectives) > MAX_CARDS:
        out.append(f"<p>{len(collectives) - MAX_CARDS} more collectives are on the map and timeline above.</p>")
    out.append("</body></html>\n")
    return "\n".join(out)
