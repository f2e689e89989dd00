"""The README's code against the code it documents: a renamed function, keyword, option, plan, flag,
file or make target fails here instead of in a reader's terminal.

Checked without running anything heavy (~3 s with imports, no process group): every Python block parses; every
``spmd.<name>`` the README uses exists, and every keyword it passes to one is in that function's
signature; every ``spmd_expand`` import resolves; ``torch.compile(backend="spmd", options={...})``
names only options the backend takes; every ``spmd-expand`` command line (the usage line's
alternatives one by one) is accepted by the CLI's parser; every repository path and ``make`` target
it names exists. The README's complete programs themselves (30-70 s each on 2 gloo ranks) are run by
hand, not here.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import inspect
import re
import shlex
import textwrap
from pathlib import Path

import pytest

import spmd_expand as spmd
from spmd_expand.app.cli import build_parser
from spmd_expand.backend import _OPTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# Fenced blocks, also those indented inside a list item: (language, dedented text).
_FENCES = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)
BLOCKS = [(m.group(2), textwrap.dedent(m.group(3))) for m in _FENCES.finditer(README)]
PYTHON = [text for language, text in BLOCKS if language == "python"]
INLINE = re.findall(r"`([^`\n]+)`", _FENCES.sub("", README))
BLOCK_LINES = [line for _, text in BLOCKS for line in text.splitlines()]


@functools.cache
def _python_trees() -> tuple[ast.Module, ...]:
    """The Python blocks parsed once (``test_python_block_parses`` names a block that does not parse)."""
    return tuple(ast.parse(text) for text in PYTHON)


def test_the_readme_has_what_these_tests_read():
    # A change of the fence syntax must not leave the tests below checking nothing.
    assert len(PYTHON) >= 10 and len(INLINE) >= 100
    assert _command_lines() and _make_targets()


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_parses(index):
    ast.parse(PYTHON[index])


def _spmd_names() -> set[str]:
    """Every ``<name>`` of ``spmd.<name>`` in the Python blocks and inline code."""
    inline_expressions = []
    for span in INLINE:
        try:
            inline_expressions.append(ast.parse(span))
        except SyntaxError:
            continue
    return {
        node.attr
        for tree in [*_python_trees(), *inline_expressions]
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "spmd"
    }


def test_every_spmd_name_exists():
    missing = sorted(name for name in _spmd_names() if not hasattr(spmd, name))
    assert not missing, f"the README uses spmd.{missing}, which spmd_expand does not define"


def test_keywords_passed_to_spmd_functions_are_in_their_signatures():
    wrong = []
    calls = [node for tree in _python_trees() for node in ast.walk(tree) if isinstance(node, ast.Call)]
    for call in calls:
        func = call.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "spmd"):
            continue
        target = getattr(spmd, func.attr, None)
        if not callable(target):
            continue
        parameters = inspect.signature(target).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        wrong += [f"spmd.{func.attr}({k.arg}=...)" for k in call.keywords if k.arg is not None and k.arg not in parameters]
    assert calls and not wrong, f"keywords the README passes that the functions do not take: {wrong}"


def test_spmd_expand_imports_resolve():
    checked = 0
    for tree in _python_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("spmd_expand"):
                        importlib.import_module(alias.name)
                        checked += 1
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spmd_expand"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"the README imports {alias.name} from {node.module}, which has no such name"
                    )
                    checked += 1
    assert checked


def test_backend_options_are_known():
    used = set()
    for tree in _python_trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            backend = keywords.get("backend")
            if isinstance(backend, ast.Constant) and backend.value == "spmd" and isinstance(keywords.get("options"), ast.Dict):
                used |= {key.value for key in keywords["options"].keys if isinstance(key, ast.Constant)}
    assert used and used <= set(_OPTIONS), f"options the backend does not take: {sorted(used - set(_OPTIONS))}"


def _command_lines(blocks_only: bool = False) -> list[str]:
    """Every ``spmd-expand ...`` command in the README's blocks (and inline code, unless
    ``blocks_only``), without its prompt and comment."""
    lines = BLOCK_LINES + ([] if blocks_only else INLINE)
    commands = []
    for line in lines:
        line = line.strip().removeprefix("$ ").split("  #")[0].strip()
        if line.startswith("spmd-expand "):
            commands.append(line)
    return commands


def _alternatives(command: str) -> list[list[str]]:
    """The argument lists a command line stands for: a usage line's ``[--flag a|b]`` gives one list per
    alternative (each optional part alone, so that every listed choice is parsed once)."""
    optional = re.findall(r"\[([^\]]+)\]", command)
    required = shlex.split(re.sub(r"\[[^\]]+\]", "", command))[1:]
    if not optional:
        return [required]
    variants = []
    for part in optional:
        flag, *value = part.split(None, 1)
        choices = value[0].split("|") if value else [None]
        variants += [required + [flag] + ([choice] if choice is not None else []) for choice in choices]
    return variants


@functools.cache
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _placeholder(value: str) -> bool:
    return value.isupper()  # `--plan P`, `--out DIR`: prose, not a value


@pytest.mark.parametrize("command", sorted(set(_command_lines())))
def test_command_line_flags_and_choices_exist(command):
    """Also the partial commands of the prose (`spmd-expand dump --model M --plan P`): the subcommand,
    each flag, and each value of a flag with choices exist."""
    for argv in _alternatives(command):
        parser = _subcommands().get(argv[0])
        assert parser is not None, f"`{command}`: spmd-expand has no subcommand {argv[0]!r}"
        options = {s: a for a in parser._actions for s in a.option_strings}
        for flag, value in zip(argv[1:], argv[2:] + [None]):
            if not flag.startswith("--"):
                continue
            action = options.get(flag)
            assert action is not None, f"`{command}`: `spmd-expand {argv[0]}` has no option {flag}"
            if action.choices is not None and value is not None and not _placeholder(value):
                assert value in action.choices, f"`{command}`: {flag} takes one of {list(action.choices)}, not {value!r}"


@pytest.mark.parametrize("command", sorted(set(_command_lines(blocks_only=True))))
def test_complete_command_line_parses(command):
    """The blocks' commands are meant to be pasted: each parses as a whole."""
    for argv in _alternatives(command):
        try:
            _subcommands()[argv[0]].parse_args(argv[1:])
        except SystemExit as e:
            pytest.fail(f"the README's `{command}` does not parse as `spmd-expand {' '.join(argv)}` (exit {e.code})")


def test_command_line_alternatives():
    assert _alternatives("spmd-expand train [--plan ddp|fsdp] [--mesh 2x2]") == [
        ["train", "--plan", "ddp"], ["train", "--plan", "fsdp"], ["train", "--mesh", "2x2"],
    ]


_PATH = re.compile(r"\b((?:bench|tests|tools|golden_graphs|spmd_expand|passes)/[A-Za-z0-9_./+-]*[A-Za-z0-9_/])")


def test_named_paths_exist():
    paths = sorted(set(_PATH.findall(README)))
    missing = [p for p in paths if not (ROOT / p).exists() and not (ROOT / "spmd_expand" / p).exists()]
    # spmd_expand.passes lives in passes/ (pyproject's package-dir).
    missing = [p for p in missing if not (p.startswith("spmd_expand/passes/") and (ROOT / p.removeprefix("spmd_expand/")).exists())]
    assert len(paths) >= 10 and not missing, f"the README names files that do not exist: {missing}"


def _make_targets() -> set[str]:
    """The targets of the ``make`` commands (a line of a block or an inline span that runs ``make``,
    after environment assignments such as ``EXPECTTEST_ACCEPT=1``)."""
    command = re.compile(r"^(?:\w+=\S*\s+)*make (\w+)")
    return {m.group(1) for line in BLOCK_LINES + INLINE if (m := command.match(line.strip()))}


def test_make_targets_exist():
    defined = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
    missing = sorted(_make_targets() - defined)
    assert not missing, f"the README names make targets the Makefile does not define: {missing}"


def test_every_fence_is_closed():
    # An unclosed fence swallows the text after it (and hides it from the tests above).
    assert README.count("```") % 2 == 0
    assert all("```" not in text for _, text in BLOCKS)
