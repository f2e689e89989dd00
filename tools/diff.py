"""``spmd-expand diff A B``: a structural diff of two graph dumps (text files, summaries, or folders).

Nodes are aligned by role, not by position or name, so one inserted node shows as one added node
rather than as a renumbering of everything after it. The alignment, in order:

1. *same ancestry*: a node's forward key hashes its op, its literal arguments and the keys of its
   inputs (placeholders: their role name). Nodes with equal keys pair up, in graph order;
2. *same descendants*: the backward key hashes op, literals and the keys of the node's users (and the
   argument position it takes there). It pairs nodes downstream of a change, whose forward keys differ;
3. *anchored by neighbours*, repeated until nothing changes: a remaining node pairs with one of the
   same op whose inputs are all paired with its inputs, or whose users are; failing that, with one of
   the same op and literals whose inputs lead, through a short chain of unpaired single-input nodes,
   to the same paired nodes (a reader whose input gained or lost a redistribution).

Paired nodes whose arguments (through the pairing), placements or value differ are *changed*; the rest
are *added* (only in B) or *removed* (only in A). An input that now goes through an added node which
reads the old input (an insertion on that edge) does not count as a change of the reader.

Reads only its own formats (:mod:`spmd_expand.tools.graph_text`, ``summary.json``), never pickles.
Exit status: 0 equal, 1 different, 2 bad input (what could not be parsed is printed).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .graph_text import (
    MAGIC,
    DumpFormatError,
    DumpNode,
    GraphDump,
    parse_graph_text,
    parse_summary,
)

__all__ = ["NodeChange", "GraphDiff", "align", "diff_graphs", "diff_texts", "diff_paths", "add_arguments", "run"]

DEFAULT_LIMIT = 50
# Longest chain of unpaired single-input nodes a reader's input may gain or lose and still pair
# (a redistribution is a collective, its wait, and at most a reshape or two).
_MAX_HOPS = 4


@dataclass
class NodeChange:
    """A node present in both dumps whose ``fields`` differ: ``(field, text in A, text in B)``."""

    a: DumpNode
    b: DumpNode
    fields: list[tuple[str, str, str]]


@dataclass
class GraphDiff:
    """The difference of two graph dumps; nodes in graph order of the dump they come from."""

    added: list[DumpNode] = field(default_factory=list)
    removed: list[DumpNode] = field(default_factory=list)
    changed: list[NodeChange] = field(default_factory=list)
    header: list[tuple[str, str, str]] = field(default_factory=list)
    collectives_differ: bool = False

    @property
    def equal(self) -> bool:
        return not (self.added or self.removed or self.changed or self.header or self.collectives_differ)


# ---------------------------------------------------------------------------------------- alignment
def _users(graph: GraphDump) -> dict[str, list[tuple[str, int]]]:
    users: dict[str, list[tuple[str, int]]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for position, ref in enumerate(n.refs):
            users[ref].append((n.name, position))
    return users


def _forward_keys(graph: GraphDump) -> dict[str, int]:
    keys: dict[str, int] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            keys[n.name] = hash((n.op, n.name))
        else:
            keys[n.name] = hash((n.op, n.template, tuple(keys[r] for r in n.refs)))
    return keys


def _backward_keys(graph: GraphDump, users: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    keys: dict[str, int] = {}
    for n in reversed(graph.nodes):
        keys[n.name] = hash((n.op, n.template, tuple(sorted((keys[u], pos) for u, pos in users[n.name]))))
    return keys


class _Pairing:
    def __init__(self, a: GraphDump, b: GraphDump):
        self.a, self.b = a, b
        self.a2b: dict[str, str] = {}
        self.b2a: dict[str, str] = {}

    def pair(self, a_name: str, b_name: str) -> None:
        self.a2b[a_name] = b_name
        self.b2a[b_name] = a_name

    def by_keys(self, a_keys: dict[str, Any], b_keys: dict[str, Any]) -> None:
        """Pair unpaired nodes of equal key, the k-th of A with the k-th of B in graph order."""
        buckets: dict[Any, deque] = defaultdict(deque)
        for n in self.a.nodes:
            if n.name not in self.a2b and n.name in a_keys:
                buckets[a_keys[n.name]].append(n.name)
        for n in self.b.nodes:
            if n.name not in self.b2a and n.name in b_keys and buckets.get(b_keys[n.name]):
                self.pair(buckets[b_keys[n.name]].popleft(), n.name)

    def effective(self, name: str, graph: dict[str, DumpNode], paired: dict[str, str]) -> Optional[str]:
        """The paired node ``name`` reads its data from: itself if paired, else, through at most
        :data:`_MAX_HOPS` unpaired nodes that each read one node (e.g. an inserted all_gather and its
        wait), the paired node they read; None if there is none."""
        for _ in range(_MAX_HOPS + 1):
            if name in paired:
                return name
            refs = graph[name].refs
            if len(set(refs)) != 1:
                return None
            name = refs[0]
        return None

    def by_inputs(self, through_unpaired: bool) -> None:
        """Pair each unpaired B node, in graph order, with an unpaired A node of the same op whose
        inputs are paired with its inputs. One sweep pairs whole chains: a node paired here makes
        its readers eligible later in the same sweep.

        With ``through_unpaired``, inputs are compared by :meth:`effective` node and the ops' literals
        must agree too: a reader whose input gained or lost a redistribution still pairs.
        """
        a_graph, b_graph = self.a.by_name(), self.b.by_name()

        def key(n: DumpNode, graph: dict[str, DumpNode], paired: dict[str, str], to_a) -> Optional[tuple]:
            if through_unpaired:
                refs = tuple(self.effective(r, graph, paired) for r in n.refs)
            else:
                refs = tuple(r if r in paired else None for r in n.refs)
            if not refs or None in refs:
                return None
            return (n.op, n.template if through_unpaired else None, tuple(to_a(r) for r in refs))

        # A's keys are in A's names, so an A node is a candidate before its inputs are paired: a B
        # node only asks for it once B's inputs are paired with exactly those A nodes.
        candidates: dict[tuple, deque] = defaultdict(deque)
        for n in self.a.nodes:
            if n.name not in self.a2b and n.refs:
                k = key(n, a_graph, self.a2b, lambda r: r) if through_unpaired else (n.op, None, n.refs)
                if k is not None:
                    candidates[k].append(n.name)
        for n in self.b.nodes:
            if n.name in self.b2a:
                continue
            k = key(n, b_graph, self.b2a, self.b2a.get)
            queue = candidates.get(k) if k is not None else None
            while queue and queue[0] in self.a2b:
                queue.popleft()
            if queue:
                self.pair(queue.popleft(), n.name)

    def by_users(self, a_users, b_users) -> None:
        """Pair each unpaired B node, in reverse graph order, with an unpaired A node of the same op
        whose users (and the argument positions it takes there) are paired with its users."""
        candidates: dict[tuple, deque] = defaultdict(deque)
        for n in reversed(self.a.nodes):
            if n.name not in self.a2b and a_users[n.name]:
                candidates[(n.op, tuple(sorted(a_users[n.name])))].append(n.name)
        for n in reversed(self.b.nodes):
            users = b_users[n.name]
            if n.name in self.b2a or not users or not all(u in self.b2a for u, _ in users):
                continue
            queue = candidates.get((n.op, tuple(sorted((self.b2a[u], pos) for u, pos in users))))
            while queue and queue[0] in self.a2b:
                queue.popleft()
            if queue:
                self.pair(queue.popleft(), n.name)


def align(a: GraphDump, b: GraphDump) -> dict[str, str]:
    """Pair the nodes of ``a`` and ``b`` by role (see the module docstring); returns B name -> A name."""
    pairing = _Pairing(a, b)
    pairing.by_keys(_forward_keys(a), _forward_keys(b))
    a_users, b_users = _users(a), _users(b)
    pairing.by_keys(_backward_keys(a, a_users), _backward_keys(b, b_users))
    while True:
        before = len(pairing.b2a)
        pairing.by_inputs(through_unpaired=False)
        pairing.by_users(a_users, b_users)
        if len(pairing.b2a) == before:
            pairing.by_inputs(through_unpaired=True)
            if len(pairing.b2a) == before:
                return pairing.b2a


def _reaches(start: str, graph: dict[str, DumpNode], paired: dict[str, str], target: str) -> bool:
    """Whether unpaired ``start`` reads, through unpaired nodes only, a node paired with ``target``."""
    stack, seen = [start], {start}
    while stack:
        for ref in graph[stack.pop()].refs:
            if ref in paired:
                if paired[ref] == target:
                    return True
            elif ref not in seen:
                seen.add(ref)
                stack.append(ref)
    return False


def diff_graphs(a: GraphDump, b: GraphDump) -> GraphDiff:
    """Added, removed and changed nodes of ``b`` against ``a``, and header differences."""
    b2a = align(a, b)
    a2b = {v: k for k, v in b2a.items()}
    a_nodes, b_nodes = a.by_name(), b.by_name()
    result = GraphDiff()
    keys = list(dict.fromkeys([*a.header, *b.header]))
    result.header = [(k, a.header.get(k, "-"), b.header.get(k, "-")) for k in keys if a.header.get(k) != b.header.get(k)]
    result.collectives_differ = a.collectives != b.collectives
    result.added = [n for n in b.nodes if n.name not in b2a]
    result.removed = [n for n in a.nodes if n.name not in a2b]

    def same_input(ra: str, rb: str) -> bool:
        if b2a.get(rb) == ra:
            return True
        if rb not in b2a:  # inserted on the edge: rb is new and reads what ra was
            return ra in a2b and _reaches(rb, b_nodes, b2a, ra)
        return ra not in a2b and _reaches(ra, a_nodes, a2b, rb)  # removed from the edge

    for nb in b.nodes:
        if nb.name not in b2a:
            continue
        na = a_nodes[b2a[nb.name]]
        fields = []
        if na.template != nb.template or len(na.refs) != len(nb.refs) or not all(map(same_input, na.refs, nb.refs)):
            fields.append(("args", na.args, nb.args))
        if na.placements != nb.placements:
            fields.append(("placements", na.placements, nb.placements))
        if na.value != nb.value:
            fields.append(("value", na.value, nb.value))
        if fields:
            result.changed.append(NodeChange(na, nb, fields))
    return result


# ---------------------------------------------------------------------------------------- report
def collectives_table(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> list[str]:
    """Collectives of A and B side by side (count and bytes per kind per step); ``*`` marks a difference."""
    lines = [f"{'collectives per step':<20} {'A count':>8} {'A bytes':>14} {'B count':>8} {'B bytes':>14}"]
    for kind in sorted(set(a) | set(b)) or ["none"]:
        (ca, ba), (cb, bb) = a.get(kind, (0, 0)), b.get(kind, (0, 0))
        mark = "" if (ca, ba) == (cb, bb) else "  *"
        lines.append(f"{kind:<20} {ca:>8,} {ba:>14,} {cb:>8,} {bb:>14,}{mark}")
    return lines


def _limited(items: list[str], limit: int, what: str) -> list[str]:
    if limit and len(items) > limit:
        return items[:limit] + [f"  ... and {len(items) - limit} more {what}"]
    return items


def graph_report(a: GraphDump, b: GraphDump, d: GraphDiff, limit: int = DEFAULT_LIMIT, table: bool = True) -> list[str]:
    """Lines describing ``d``: optional collectives table, header, counts, then +, -, ~ per node."""
    lines: list[str] = []
    if table and (d.collectives_differ or a.collectives or b.collectives):
        lines += collectives_table(a.collectives, b.collectives)
    for key, va, vb in d.header:
        lines.append(f"header {key}: {va} -> {vb}")
    lines.append(
        f"nodes: {len(a.nodes)} -> {len(b.nodes)}: {len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed"
    )
    lines += _limited([f"+ {n.text}" for n in d.added], limit, "added")
    lines += _limited([f"- {n.text}" for n in d.removed], limit, "removed")
    changes = []
    for c in d.changed:
        renamed = "" if c.a.name == c.b.name else f" (A: %{c.a.name})"
        changes.append(f"~ %{c.b.name}{renamed}: " + "; ".join(f"{f} {va} -> {vb}" for f, va, vb in c.fields))
    lines += _limited(changes, limit, "changed")
    return lines


def diff_texts(a_text: str, b_text: str, a_label: str = "A", b_label: str = "B", limit: int = DEFAULT_LIMIT) -> tuple[bool, str]:
    """Diff two graph dump texts. Returns ``(equal, report)``.

    Raises:
        DumpFormatError: either text is not a well-formed graph dump.
    """
    a, b = parse_graph_text(a_text, a_label), parse_graph_text(b_text, b_label)
    d = diff_graphs(a, b)
    return d.equal, "\n".join([f"A: {a_label}", f"B: {b_label}", *graph_report(a, b, d, limit)]) + "\n"


def _summary_fields(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a summary to dotted keys, leaving out the collectives (shown as a table) and file names."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        dotted = f"{prefix}{key}"
        if key in ("collectives_per_step", "collectives", "file"):
            continue
        if isinstance(value, dict):
            flat.update(_summary_fields(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _table_of(summary: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {k: (v["count"], v["bytes"]) for k, v in summary["collectives_per_step"].items()}


def _summary_report(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
    fa, fb = _summary_fields(a), _summary_fields(b)
    changes = [f"summary {k}: {fa.get(k, '-')} -> {fb.get(k, '-')}" for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]
    stage_tables = [
        f"summary stages.{s}.collectives differ"
        for s in dict.fromkeys([*a.get("stages", {}), *b.get("stages", {})])
        if a.get("stages", {}).get(s, {}).get("collectives") != b.get("stages", {}).get(s, {}).get("collectives")
    ]
    equal = not changes and not stage_tables and _table_of(a) == _table_of(b)
    return equal, changes + stage_tables


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DumpFormatError(f"{path}: cannot read: {e}") from None


def _file_kind(path: Path, text: str) -> str:
    if text.startswith(MAGIC):
        return "graph"
    if path.suffix == ".json":
        return "summary"
    raise DumpFormatError(f"{path}: neither an spmd-expand graph dump (first line {MAGIC!r}) nor a summary .json file")


def _diff_files(a: Path, b: Path, limit: int, table: bool) -> tuple[bool, list[str]]:
    a_text, b_text = _read(a), _read(b)
    kind_a, kind_b = _file_kind(a, a_text), _file_kind(b, b_text)
    if kind_a != kind_b:
        raise DumpFormatError(f"cannot compare {a} (a {kind_a}) with {b} (a {kind_b})")
    if kind_a == "summary":
        sa, sb = parse_summary(a_text, str(a)), parse_summary(b_text, str(b))
        equal, lines = _summary_report(sa, sb)
        return equal, (collectives_table(_table_of(sa), _table_of(sb)) if table else []) + lines
    ga, gb = parse_graph_text(a_text, str(a)), parse_graph_text(b_text, str(b))
    d = diff_graphs(ga, gb)
    return d.equal, graph_report(ga, gb, d, limit, table=table or d.collectives_differ)


def _dump_files(folder: Path) -> list[str]:
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".txt", ".json"))
    if not names:
        raise DumpFormatError(f"{folder}: no dump files (*.txt graph dumps or summary.json) in this folder")
    return names


def _is_pass_file(name: str) -> bool:
    """``4-<pass>.txt``: one per pass that ran, so two dumps with other pass lists differ in them."""
    return name.startswith("4-") and name.endswith(".txt") and name != "4-passes.txt"


def diff_paths(a: Path, b: Path, limit: int = DEFAULT_LIMIT) -> tuple[bool, str]:
    """Diff two dump files, or two folders file by file (same names). Returns ``(equal, report)``.

    Raises:
        DumpFormatError: a path is missing, unreadable, not a dump, or a file is compared with a folder.
    """
    for p in (a, b):
        if not p.exists():
            raise DumpFormatError(f"{p}: no such file or folder")
    if a.is_dir() != b.is_dir():
        raise DumpFormatError(f"cannot compare {a} with {b}: compare two files or two dump folders")
    lines = [f"A: {a}", f"B: {b}"]
    if not a.is_dir():
        equal, body = _diff_files(a, b, limit, table=True)
        return equal, "\n".join(lines + body) + "\n"
    a_files, b_files = _dump_files(a), _dump_files(b)
    equal = a_files == b_files
    summary = "summary.json"
    if summary in a_files and summary in b_files:
        sa, sb = parse_summary(_read(a / summary), str(a / summary)), parse_summary(_read(b / summary), str(b / summary))
        lines += collectives_table(_table_of(sa), _table_of(sb))
    for name in sorted(set(a_files) | set(b_files)):
        if name not in a_files or name not in b_files:
            if not _is_pass_file(name):
                # Every dump has its stage files and summary: one missing is a truncated dump.
                lacking = b if name in a_files else a
                raise DumpFormatError(f"{lacking}: lacks {name}, which the other dump has (a truncated dump? dump it again)")
            lines.append(f"== {name}: only in {'A' if name in a_files else 'B'}")
            continue
        same, body = _diff_files(a / name, b / name, limit, table=False)
        equal = equal and same
        lines.append(f"== {name}: {'equal' if same else 'different'}")
        if not same:
            lines += [f"   {line}" for line in body]
    return equal, "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``spmd-expand diff``."""
    p.add_argument("a", type=Path, metavar="A", help="a dump folder, graph text file or summary.json")
    p.add_argument("b", type=Path, metavar="B", help="the same kind of path to compare with")
    p.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"list at most N nodes per kind of change (0: all; default {DEFAULT_LIMIT})",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``spmd-expand diff``: print the report; 0 equal, 1 different, 2 bad input."""
    try:
        equal, report = diff_paths(args.a, args.b, args.limit)
    except DumpFormatError as e:
        print(f"spmd-expand diff: cannot compare: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(report)
    return 0 if equal else 1
