"""`spmd-expand dump` and `spmd-expand diff`: deterministic dumps at any world size, summaries that
agree with the graph, and a diff that aligns nodes by role and reports bad input with exit status 2.

Dumps at world sizes other than the session's fake process group (4) run in subprocesses through the
real command line (the fake group can exist once per process).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dump_jobs
import pytest
from spmd_expand.tools.diff import diff_graphs
from spmd_expand.tools.dump import STAGES, dump_step, mlp_job
from spmd_expand.tools.graph_text import collective_kind, parse_graph_text

import spmd_expand as spmd
from spmd_expand.app.cli import main
from spmd_expand.graph_stats import collective_stats

TESTS = Path(__file__).resolve().parent
# The default pipeline's local passes each write their graph too.
DUMP_FILES = sorted([s.file for s in STAGES] + ["4-bucketing.txt", "4-overlap.txt", "summary.json", "graph.html"])


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Three CLI dumps, run concurrently: the MLP under DDP at W=2 twice, and a --job at W=1024."""
    root = tmp_path_factory.mktemp("dumps")
    commands = {
        "first": ["--model", "mlp", "--plan", "ddp", "--world-size", "2"],
        "second": ["--model", "mlp", "--plan", "ddp", "--world-size", "2"],
        "w1024": ["--job", f"{TESTS / 'dump_jobs.py'}:scaled_input_mlp_job", "--plan", "ddp", "--mesh", "1024"],
    }
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "spmd_expand.app.cli", "dump", *args, "--out", str(root / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in commands.items()
    }
    for name, process in running.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"dump {name} failed:\n{output}"
    return {name: root / name for name in commands}


def test_dump_twice_gives_identical_files(dumps):
    first, second = dumps["first"], dumps["second"]
    assert sorted(p.name for p in first.iterdir()) == DUMP_FILES
    for name in DUMP_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between two dumps"
    # Stable names: placeholders by role, no addresses or tracing-history names.
    expanded = (first / "3-expanded.txt").read_text()
    assert "%param:fc1.weight = placeholder()  # R f32[32,16]" in expanded
    assert "%batch:0 = placeholder()  # S(0) f32[2,16]" in expanded
    assert " at 0x" not in expanded and "arg0_1" not in expanded


def test_dump_at_world_size_1024(dumps):
    out = dumps["w1024"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["job"]["world_size"] == 1024 and summary["job"]["mesh_shape"] == [1024]
    traced = parse_graph_text((out / "1-traced.txt").read_text()).by_name()
    expanded = parse_graph_text((out / "3-expanded.txt").read_text()).by_name()
    # The global batch is 1024 local batches of 2 rows; each rank's graph sees its 2 rows.
    assert traced["batch:0"].value == "f32[2048,16]"
    assert expanded["batch:0"].value == "f32[2,16]"
    # DDP: gradients (and the loss's two sums) are all-reduced over the 1024-rank dp group; the four
    # gradients and the returned loss in one bucket after the passes.
    reduces = [n for n in expanded.values() if collective_kind(n.op) == "all_reduce"]
    assert len(reduces) == summary["stages"]["expanded"]["collectives"]["all_reduce"]["count"] == 6
    assert summary["collectives_per_step"]["all_reduce"]["count"] == 2
    assert all(n.args.endswith("group(dp)") for n in reduces)


def test_summary_collectives_match_collective_stats(fake_mesh):
    dump = dump_step(mlp_job(), "fsdp", fake_mesh, "model=mlp")
    # The same job compiled independently: what the step really runs.
    job = mlp_job()
    step = spmd.compile(mesh=fake_mesh, plan=spmd.FSDP(), lower="eager")(job.step)
    for _ in range(2):
        step(job.model, job.optimizer, *job.batch)
    expected = collective_stats(step.last.local_graph).as_dict()
    assert set(expected) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert dump.summary["collectives_per_step"] == expected
    # The text form says the same, in its header and in its lines.
    graph = parse_graph_text(dump.texts["passes"])
    assert {k: {"count": c, "bytes": b} for k, (c, b) in graph.collectives.items()} == expected
    lines = [collective_kind(n.op) for n in graph.nodes if collective_kind(n.op)]
    assert {k: lines.count(k) for k in expected} == {k: v["count"] for k, v in expected.items()}
    # Persistent bytes: parameters and AdamW states, each a quarter of the full tensors (W=4, even).
    full = sum(p.numel() * 4 for p in mlp_job().model.parameters())
    persistent = dump.summary["persistent_bytes_per_rank"]
    assert persistent["params"] == full // 4
    assert persistent["optimizer_states"] == 2 * full // 4 + 4 * 4  # exp_avg, exp_avg_sq; one step scalar a param


def test_diff_exit_codes(dumps, tmp_path, capsys):
    first, second, w1024 = dumps["first"], dumps["second"], dumps["w1024"]
    assert main(["diff", str(first), str(second)]) == 0
    assert main(["diff", str(first / "3-expanded.txt"), str(second / "3-expanded.txt")]) == 0
    capsys.readouterr()

    assert main(["diff", str(first), str(w1024)]) == 1
    report = capsys.readouterr().out
    assert "all_reduce" in report and "summary job.world_size: 2 -> 1024" in report
    assert "+ %mul = aten.mul.Tensor(%batch:0, 2.0)" in report

    # A truncated graph file (as if a write had been interrupted) is bad input, named with its reason.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(first, corrupt)
    lines = (corrupt / "3-expanded.txt").read_text().splitlines(keepends=True)
    (corrupt / "3-expanded.txt").write_text("".join(lines[:-20]))
    assert main(["diff", str(first), str(corrupt)]) == 2
    err = capsys.readouterr().err
    assert "3-expanded.txt" in err and "truncated" in err

    garbled = tmp_path / "garbled.txt"
    lines[12] = "%relu = aten.relu.default(%addmm  # S(0)\n"
    garbled.write_text("".join(lines))
    assert main(["diff", str(first / "3-expanded.txt"), str(garbled)]) == 2
    err = capsys.readouterr().err
    assert f"{garbled}:13: cannot parse node line" in err

    bad_json = tmp_path / "summary.json"
    bad_json.write_text('{"format": "spmd-expand-dump/1", "collectives_per_step": ')
    assert main(["diff", str(first / "summary.json"), str(bad_json)]) == 2
    assert "invalid JSON" in capsys.readouterr().err

    assert main(["diff", str(first), str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["diff", str(first), str(first / "summary.json")]) == 2
    assert "two files or two dump folders" in capsys.readouterr().err


def test_diff_aligns_nodes_by_role(fake_mesh):
    plain = dump_step(mlp_job(), "ddp", fake_mesh, "model=mlp")
    scaled = dump_step(dump_jobs.scaled_input_mlp_job(), "ddp", fake_mesh, "model=mlp")
    for stage in ("traced", "expanded"):
        a, b = parse_graph_text(plain.texts[stage]), parse_graph_text(scaled.texts[stage])
        # The extra `mul` comes first, so every later `mul` is renumbered: by position or by name,
        # dozens of lines differ.
        renamed = sum(x.text != y.text for x, y in zip(a.nodes, b.nodes))
        assert renamed > 20
        d = diff_graphs(a, b)
        assert [(n.name, n.op, n.args) for n in d.added] == [("mul", "aten.mul.Tensor", "%batch:0, 2.0")]
        assert d.removed == [] and d.changed == [] and d.header == []

    # One changed placement is one changed node.
    a = parse_graph_text(plain.texts["expanded"])
    lines = plain.texts["expanded"].splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith("%relu = "))
    lines[index] = lines[index].replace("# S(0) ", "# R ")
    d = diff_graphs(a, parse_graph_text("".join(lines)))
    assert d.added == [] and d.removed == []
    assert [(c.b.name, c.fields) for c in d.changed] == [("relu", [("placements", "S(0)", "R")])]


def test_dump_rejects_bad_command_lines(tmp_path, capsys):
    assert main(["dump", "--model", "mlp", "--plan", "fsdp", "--mesh", "2x2", "--out", str(tmp_path)]) == 2
    assert "needs a 1-D mesh" in capsys.readouterr().err
    assert main(["dump", "--model", "mlp", "--mesh", "4", "--world-size", "8", "--out", str(tmp_path)]) == 2
    assert "does not match" in capsys.readouterr().err
    assert main(["dump", "--job", "no_such_module:job", "--out", str(tmp_path)]) == 2
    assert "cannot import no_such_module" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["dump", "--model", "mlp", "--mesh", "2x", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert not any(tmp_path.iterdir())  # nothing written
