"""The text and JSON formats of ``spmd-expand dump``, and their readers.

A graph dump is one UTF-8 text file per stage: a header of ``# key: value`` lines, then one line per
graph node, in graph order::

    # spmd-expand graph, format 1
    # stage: expanded
    # ...
    # collective: all_reduce count=5 bytes=1220
    %param:fc1.weight = placeholder()  # R f32[32,16]
    %addmm = aten.addmm.default(%param:fc1.bias, %batch:0, %t)  # S(0) f32[2,32]
    %all_reduce = _c10d_functional.all_reduce.default(%view, 'sum', group(dp))  # P(sum)->R f32[4]

A node line is ``%NAME = OP(ARGS)  # PLACEMENTS VALUE``:

* ``NAME`` is normalized so two dumps of the same step are identical: placeholders by role
  (``param:<fqn>``, ``buffer:<fqn>``, ``grad:<fqn>``, ``state:<fqn>:<key>``, ``batch:<index>``), other
  nodes by op, numbered in graph order (``addmm``, ``addmm_1``, ...), and ``output``;
* ``OP`` is ``placeholder``, ``get_attr``, ``output`` or the call target (``aten.addmm.default``);
* ``ARGS`` are Python-like literals in which ``%name`` reads another node; ``%name{S(0)->R}`` (annotated
  stage) means the value is redistributed from ``S(0)`` to ``R`` on that edge; ``group(dp)`` names the
  process group of a mesh dim;
* ``PLACEMENTS`` has one placement per mesh dim, comma-separated (``S(0)``, ``R``, ``P(sum)``,
  ``S(0),R``); ``SRC->DST`` on nodes a redistribution created; ``(..)`` for multi-output nodes; ``-``
  where none applies;
* ``VALUE`` is dtype and shape (``f32[2,32]``, ``(f32[],f32[])``, ``int(4)``) or ``-``.

Neither field after ``#`` contains spaces, so a line splits unambiguously. The JSON summary
(``summary.json``, ``"format": SUMMARY_FORMAT``) is written by :func:`spmd_expand.tools.dump.dump_step`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import SpmdError
from ..graph_stats import COLLECTIVES

__all__ = [
    "MAGIC",
    "SUMMARY_FORMAT",
    "DumpFormatError",
    "DumpNode",
    "GraphDump",
    "collective_kind",
    "format_graph_text",
    "parse_graph_text",
    "parse_summary",
    "scan_args",
]

MAGIC = "# spmd-expand graph, format 1"
SUMMARY_FORMAT = "spmd-expand-dump/1"

# A normalized node name: no spaces, no characters that end a reference inside ARGS.
NAME_CHARS = "A-Za-z0-9_.:"
_LINE = re.compile(
    rf"%(?P<name>[{NAME_CHARS}]+) = (?P<op>[A-Za-z0-9_.]+)\((?P<args>.*)\)  # (?P<placements>\S+) (?P<value>\S+)"
)
_HEADER = re.compile(r"# (?P<key>[a-z_ ]+): (?P<value>.*)")
_COLLECTIVE = re.compile(r"(?P<kind>[a-z_]+) count=(?P<count>\d+) bytes=(?P<bytes>\d+)")
_REF = re.compile(rf"[{NAME_CHARS}]+")

# Op strings of the functional collectives, as they appear in OP, to their kind (all_gather, ...).
_COLLECTIVE_OPS = {str(op): kind for op, kind in COLLECTIVES.items()}


class DumpFormatError(SpmdError):
    """A file is not (or no longer) a well-formed ``spmd-expand dump`` text or JSON file."""


def collective_kind(op: str) -> Optional[str]:
    """``"all_gather"``, ``"reduce_scatter"``, ... for a collective's OP string; None otherwise."""
    return _COLLECTIVE_OPS.get(op)


def scan_args(args: str) -> tuple[str, tuple[str, ...]]:
    """Split ARGS into a template (each reference replaced by ``%``) and the names it references.

    Quoted strings are skipped, so a ``%`` inside a string literal is not a reference.
    """
    template: list[str] = []
    refs: list[str] = []
    i = 0
    while i < len(args):
        ch = args[i]
        if ch in "'\"":
            end = i + 1
            while end < len(args) and args[end] != ch:
                end += 2 if args[end] == "\\" else 1
            template.append(args[i : end + 1])
            i = end + 1
        elif ch == "%":
            m = _REF.match(args, i + 1)
            if m is None:
                template.append(ch)
                i += 1
                continue
            refs.append(m.group())
            template.append("%")
            i = m.end()
        else:
            template.append(ch)
            i += 1
    return "".join(template), tuple(refs)


@dataclass(frozen=True)
class DumpNode:
    """One node line. ``refs`` are the names ARGS reads, in order; ``template`` is ARGS with each
    reference replaced by ``%`` (redistribution annotations ``{..}`` kept); ``line`` is the 1-based
    line number in its file (0 for nodes built in memory)."""

    name: str
    op: str
    args: str
    placements: str
    value: str
    template: str = field(compare=False)
    refs: tuple[str, ...] = field(compare=False)
    line: int = field(default=0, compare=False)

    @staticmethod
    def make(name: str, op: str, args: str, placements: str, value: str, line: int = 0) -> "DumpNode":
        template, refs = scan_args(args)
        return DumpNode(name, op, args, placements or "-", value or "-", template, refs, line)

    @property
    def text(self) -> str:
        """The node's line in the text form."""
        return f"%{self.name} = {self.op}({self.args})  # {self.placements} {self.value}"


@dataclass
class GraphDump:
    """A parsed graph dump: header fields, collectives per kind, and nodes in graph order.

    ``header`` holds the single-valued ``# key: value`` fields (``stage``, ``job``, ``step``, ...);
    ``collectives`` maps a kind to ``(count, bytes)`` per step on this rank (empty for graphs without
    collectives); ``source`` names the file for messages.
    """

    header: dict[str, str]
    collectives: dict[str, tuple[int, int]]
    nodes: list[DumpNode]
    source: str = "<memory>"

    def by_name(self) -> dict[str, DumpNode]:
        return {n.name: n for n in self.nodes}


def format_graph_text(header: dict[str, str], collectives: dict[str, tuple[int, int]], nodes: list[DumpNode]) -> str:
    """The text form: the magic line, ``header`` fields in order, collectives, then one line per node."""
    lines = [MAGIC]
    lines += [f"# {key}: {value}" for key, value in header.items()]
    lines.append(f"# nodes: {len(nodes)}")
    if collectives:
        lines += [f"# collective: {kind} count={c} bytes={b}" for kind, (c, b) in sorted(collectives.items())]
    else:
        lines.append("# collectives: none")
    lines += [n.text for n in nodes]
    return "\n".join(lines) + "\n"


def parse_graph_text(text: str, source: str = "<text>") -> GraphDump:
    """Read a graph dump written by :func:`format_graph_text`.

    Raises:
        DumpFormatError: the first line is not :data:`MAGIC`, a line is neither a header field nor a
            node line, a name is defined twice or read before it is defined, or the ``nodes`` count
            does not match (a truncated file). The message names ``source`` and the line.
    """
    lines = text.splitlines()
    if not lines or lines[0] != MAGIC:
        first = lines[0][:80] if lines else "<empty file>"
        raise DumpFormatError(f"{source}: not an spmd-expand graph dump (first line {first!r}, expected {MAGIC!r})")
    header: dict[str, str] = {}
    collectives: dict[str, tuple[int, int]] = {}
    nodes: list[DumpNode] = []
    defined: set[str] = set()
    for number, line in enumerate(lines[1:], start=2):
        where = f"{source}:{number}"
        if line.startswith("#"):
            m = _HEADER.fullmatch(line)
            if m is None:
                raise DumpFormatError(f"{where}: cannot parse header line {line[:120]!r} (expected '# key: value')")
            key, value = m.group("key"), m.group("value")
            if key == "collective":
                c = _COLLECTIVE.fullmatch(value)
                if c is None:
                    raise DumpFormatError(f"{where}: cannot parse collective {value!r} (expected 'KIND count=N bytes=N')")
                collectives[c.group("kind")] = (int(c.group("count")), int(c.group("bytes")))
            elif key != "collectives":
                header[key] = value
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise DumpFormatError(
                f"{where}: cannot parse node line {line[:120]!r} (expected '%NAME = OP(ARGS)  # PLACEMENTS VALUE')"
            )
        node = DumpNode.make(m.group("name"), m.group("op"), m.group("args"), m.group("placements"), m.group("value"), number)
        if node.name in defined:
            raise DumpFormatError(f"{where}: node %{node.name} is defined twice")
        missing = [r for r in node.refs if r not in defined]
        if missing:
            raise DumpFormatError(f"{where}: node %{node.name} reads %{missing[0]}, which no earlier line defines")
        defined.add(node.name)
        nodes.append(node)
    if "nodes" not in header:
        raise DumpFormatError(f"{source}: header has no 'nodes' field")
    if header["nodes"] != str(len(nodes)):
        raise DumpFormatError(f"{source}: header says {header['nodes']} nodes but the file has {len(nodes)} (truncated?)")
    del header["nodes"]
    return GraphDump(header, collectives, nodes, source)


def parse_summary(text: str, source: str = "<json>") -> dict[str, Any]:
    """Read a ``summary.json`` written by ``spmd-expand dump``; checks the fields the diff reads.

    Raises:
        DumpFormatError: invalid JSON, another format, or a malformed ``collectives_per_step``.
    """
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as e:
        raise DumpFormatError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(summary, dict) or summary.get("format") != SUMMARY_FORMAT:
        found = summary.get("format") if isinstance(summary, dict) else type(summary).__name__
        raise DumpFormatError(f"{source}: not an spmd-expand dump summary (format {found!r}, expected {SUMMARY_FORMAT!r})")
    table = summary.get("collectives_per_step")
    if not isinstance(table, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("count"), int) and isinstance(v.get("bytes"), int) for v in table.values()
    ):
        raise DumpFormatError(f"{source}: 'collectives_per_step' must map each kind to {{'count': int, 'bytes': int}}")
    stages = summary.get("stages", {})
    if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
        raise DumpFormatError(f"{source}: 'stages' must map each stage name to an object")
    return summary
