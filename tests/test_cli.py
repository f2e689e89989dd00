"""`spmd-expand train` end to end on 2 local gloo ranks (small model, eager lowering)."""

from __future__ import annotations

import json

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
    # DDP of a 1-layer GPT: one all-reduce per gradient (+ the loss and nll total weight), nothing else.
    kinds = summary["collectives_per_step"]
    assert set(kinds) == {"all_reduce"}, kinds
    assert kinds["all_reduce"]["bytes"] > 0


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
