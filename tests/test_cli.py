"""`spmd-expand train` end to end on 2 local gloo ranks (small model, eager lowering)."""

from __future__ import annotations

import json
import subprocess
import sys

from spmd_expand.app.cli import main


def test_train_fsdp_reports_parity(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("class A:\n    pass\n" * 400)
    out = tmp_path / "summary.json"
    code = main(
        ["train", "--plan", "fsdp", "--world-size", "2", "--steps", "4", "--layers", "1", "--embd", "32",
         "--block-size", "16", "--batch-size", "8", "--lower", "eager", "--data", str(corpus),
         "--parity-steps", "2", "--no-progress", "--json", str(out)]
    )
    assert code == 0
    assert "(OK)" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["parity_max_abs_diff"] < 1e-4
    kinds = summary["collectives_per_step"]
    assert kinds["reduce_scatter"]["count"] > 0 and kinds["all_gather"]["count"] > kinds["reduce_scatter"]["count"]


def test_train_ddp_reports_parity(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "summary.json"
    code = main(
        ["train", "--plan", "ddp", "--world-size", "2", "--steps", "5", "--layers", "1", "--embd", "32",
         "--block-size", "16", "--batch-size", "8", "--lower", "eager", "--data", str(corpus),
         "--parity-steps", "3", "--no-progress", "--json", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "parity: first 3 steps" in printed and "(OK)" in printed
    summary = json.loads(out.read_text())
    assert len(summary["losses"]) == 5
    assert summary["parity_max_abs_diff"] < 1e-4
    # DDP of a 1-layer GPT: the gradients and the returned loss in one all-reduce bucket; the loss
    # denominator's all-reduce travels in the per-call rank check (prologue.folded_all_reduce), so it
    # is not counted.
    kinds = summary["collectives_per_step"]
    assert set(kinds) == {"all_reduce"}, kinds
    assert kinds["all_reduce"]["count"] == 1 and kinds["all_reduce"]["bytes"] > 0, kinds


def test_train_fsdp_tp_on_2x2_mesh(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i)\n" * 400)
    out = tmp_path / "summary.json"
    code = main(
        ["train", "--plan", "fsdp+tp", "--mesh", "2x2", "--steps", "3", "--layers", "1", "--embd", "32",
         "--block-size", "16", "--batch-size", "8", "--lower", "eager", "--data", str(corpus),
         "--parity-steps", "2", "--no-progress", "--json", str(out)]
    )
    assert code == 0
    assert "(OK)" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 4 and summary["parity_max_abs_diff"] < 1e-4
    kinds = summary["collectives_per_step"]
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(kinds)


def test_train_names_a_killed_rank_in_one_line(monkeypatch, capsys):
    # The ranks run a worker whose rank 1 is SIGKILLed inside a collective (tests/test_launch.py): the
    # CLI names rank 1 and how it died, in one line, not rank 0's gloo traceback.
    import test_launch
    from spmd_expand.app import launch

    real = launch.run_local
    monkeypatch.setattr(launch, "run_local", lambda fn, world, *a, **k: real(test_launch.killed_mid_collective, world, timeout_s=120))
    assert main(["train", "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("spmd-expand train: rank 1 failed: the process was killed by SIGKILL"), err[0]
    assert "then rank 0 failed" in err[0]


# ---------------------------------------------------------------------------------------------- bad input
# Each gets one error line from spmd-expand (argparse adds its usage above it) and exit status 2,
# before any rank starts.

import pytest  # noqa: E402


def _exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code


def _cli_in_fresh_process(argv) -> subprocess.CompletedProcess:
    """``spmd-expand ARGV`` in a new interpreter: a dump makes its own fake default process group,
    and the session's fake group (conftest's ``fake_mesh``) may already exist in this process."""
    return subprocess.run(
        [sys.executable, "-m", "spmd_expand.app.cli", *argv], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps: must be at least 1, got 0"),
        (["--steps", "-1"], "--steps: must be at least 1, got -1"),
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (["--world-size", "-1"], "--world-size: must be at least 1, got -1"),
        (["--parity-steps", "-1"], "--parity-steps: must be at least 0, got -1"),
        (["--heads", "3"], "--embd 64 is not divisible by --heads 3"),
        (["--plan", "fsdp+tp", "--mesh", "2x2", "--world-size", "2"], "--world-size 2 does not match --mesh 2x2"),
        (["--data", "{missing}"], "corpus path does not exist"),
        (["--data", "{empty}"], "no text found"),
        (["--data", "{binary}"], "binary (contains NUL bytes)"),
    ],
)
def test_train_bad_input(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary.txt").write_bytes(b"ab\0cd" * 100)
    paths = {"missing": tmp_path / "nothing", "empty": tmp_path / "empty", "binary": tmp_path / "binary.txt"}
    argv = [a.format(**paths) for a in argv]
    assert _exit_status(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_dump_bad_input(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "syntax.py").write_text("def job(:\n")
    (tmp_path / "raises.py").write_text("def job():\n    raise RuntimeError('job fails')\n")
    (tmp_path / "step_raises.py").write_text(
        "from spmd_expand.tools.dump import Job, mlp_job\n"
        "def step(model, optimizer, *batch):\n    raise RuntimeError('step fails')\n"
        "def job():\n    j = mlp_job()\n    return Job(j.model, j.optimizer, j.batch, step)\n"
    )
    cases = [
        (["--model", "mlp", "--world-size", "-2"], "--world-size: must be at least 1, got -2"),
        (["--model", "mlp", "--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (["--model", "mlp", "--out", str(afile)], "is a file; give a folder"),
        (["--job", f"{tmp_path / 'syntax.py'}:job"], "SyntaxError"),
        (["--job", f"{tmp_path / 'raises.py'}:job"], "job() raised RuntimeError: job fails"),
    ]
    for argv, message in cases:
        out = [] if "--out" in argv else ["--out", str(tmp_path / "dump")]
        assert _exit_status(["dump", *argv, *out]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    # A step that raises is traced, so it needs a process group of its own.
    done = _cli_in_fresh_process(["dump", "--job", f"{tmp_path / 'step_raises.py'}:job", "--out", str(tmp_path / "dump")])
    assert done.returncode == 2, done.stderr
    assert "RuntimeError: step fails" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_diff_truncated_dump_and_malformed_summary(tmp_path, capsys):
    whole, truncated = tmp_path / "whole", tmp_path / "truncated"
    done = _cli_in_fresh_process(["dump", "--model", "mlp", "--out", str(whole), "--no-picture"])
    assert done.returncode == 0, done.stderr
    truncated.mkdir()
    for f in whole.iterdir():
        if f.name != "2-annotated.txt":
            (truncated / f.name).write_text(f.read_text())
    assert main(["diff", str(whole), str(truncated)]) == 2
    assert "lacks 2-annotated.txt" in capsys.readouterr().err
    summary = json.loads((whole / "summary.json").read_text())
    summary["stages"] = 5
    (truncated / "summary.json").write_text(json.dumps(summary))
    assert main(["diff", str(whole / "summary.json"), str(truncated / "summary.json")]) == 2
    assert "'stages' must map" in capsys.readouterr().err
