"""``spmd-expand`` command line: ``train`` (the main job), ``dump`` and ``diff`` (offline graph tools)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from typing import Optional, Sequence

from ..tools import diff as diff_tool
from ..tools import dump as dump_tool
from .data import load_text
from .presets import mesh_shape, non_negative_int, positive_int, preset
from .train import PARITY_ATOL, PARITY_RTOL, PLANS, TrainConfig, train_worker

__all__ = ["build_parser", "main"]


def _train_parser(sub: argparse._SubParsersAction) -> None:
    defaults = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a character-level GPT under a parallel plan and check parity with one device",
        description="Train a character-level GPT on real text (default: the installed torch package's "
        "Python sources) under a parallel plan on W ranks: W local gloo processes on CPU, or the ranks "
        "of a torchrun launch (NCCL when CUDA is present). Ends with a parity line: the largest "
        "parameter difference from the same steps run on one process over the global batch.",
    )
    p.add_argument("--plan", choices=PLANS, default=defaults.plan)
    p.add_argument("--world-size", type=positive_int, default=None, help="local ranks to spawn (default: the mesh's size, or 2; ignored under torchrun)")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="SHAPE", help="mesh shape, e.g. 2x2 for 2-D plans (default: 1-D over all ranks)")
    p.add_argument("--steps", type=positive_int, default=defaults.steps)
    p.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="global batch (sequences per step)")
    p.add_argument("--block-size", type=positive_int, default=defaults.block_size, help="sequence length in characters")
    p.add_argument("--layers", dest="n_layer", type=positive_int, default=defaults.n_layer)
    p.add_argument("--heads", dest="n_head", type=positive_int, default=defaults.n_head)
    p.add_argument("--embd", dest="n_embd", type=positive_int, default=defaults.n_embd)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--data", default=None, help="text file or folder (default: torch's own .py sources)")
    p.add_argument("--max-chars", type=positive_int, default=defaults.max_chars)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--lower", choices=("inductor", "eager"), default=defaults.lower)
    p.add_argument(
        "--passes",
        default=defaults.passes,
        help='graph passes: "default", "none", or names separated by commas (regather_for_backward,bucketing,overlap)',
    )
    p.add_argument("--parity-steps", type=non_negative_int, default=defaults.parity_steps, help="steps replayed on one process (0: skip)")
    p.add_argument("--json", metavar="PATH", help="also write the run summary as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _run_train(args: argparse.Namespace) -> int:
    from .launch import RankFailedError, init_from_env, is_distributed_launch, run_local

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    needed = len(preset(cfg.plan).mesh_dim_names)
    if cfg.mesh is None and needed > 1:
        cfg.mesh = (2, 2)  # the smallest 2-D mesh
    if args.world_size is None:
        args.world_size = math.prod(cfg.mesh) if cfg.mesh else 2
    elif cfg.mesh and math.prod(cfg.mesh) != args.world_size:
        return _usage_error(f"--world-size {args.world_size} does not match --mesh {'x'.join(map(str, cfg.mesh))}")
    if cfg.n_embd % cfg.n_head:
        return _usage_error(f"--embd {cfg.n_embd} is not divisible by --heads {cfg.n_head}")
    if cfg.data is not None:
        # Checked here, once: a bad corpus would otherwise fail inside every rank.
        try:
            text = load_text(cfg.data, cfg.max_chars)
        except (OSError, ValueError) as e:
            return _usage_error(f"--data {cfg.data}: {e}")
        if len(text) <= cfg.block_size + 1:
            return _usage_error(f"--data {cfg.data}: {len(text)} characters, need more than --block-size {cfg.block_size} + 1")
    if cfg.parity_steps > cfg.steps:
        cfg.parity_steps = cfg.steps
    if is_distributed_launch():
        rank, world = init_from_env()
        summary = train_worker(rank, world, cfg)
        if rank != 0:
            return 0
    else:
        try:
            summary = run_local(train_worker, args.world_size, cfg, timeout_s=3600)[0]
        except RankFailedError as e:
            # The rank that failed (the dead one, not the peer its death broke) and its exception,
            # without the traceback (run_local's RankFailedError.details holds it).
            print(f"spmd-expand train: rank {e.rank} failed: {_exception_text(e.details)}", file=sys.stderr)
            return 1
    _report(summary, cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _usage_error(message: str) -> int:
    print(f"spmd-expand train: error: {message}", file=sys.stderr)
    return 2


def _exception_text(details: str) -> str:
    """The exception at the end of a formatted traceback (its whole message), or ``details``."""
    lines = details.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return details.strip()
    start = frames[-1] + 1
    while start < len(lines) and lines[start].startswith("    "):
        start += 1  # the frame's source line and its ^^^ markers
    return "\n".join(lines[start:]).strip() or details.strip()


def _report(summary: dict, cfg: TrainConfig) -> None:
    losses = summary["losses"]
    per_kind = ", ".join(f"{v['count']} {k} ({v['bytes'] / 2**20:.2f} MiB)" for k, v in summary["collectives_per_step"].items())
    print(f"plan {cfg.plan}, {summary['world_size']} ranks, lower={cfg.lower}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    print(f"compile {summary['compile_seconds']:.1f} s; {summary['tokens_per_second']:,.0f} tokens/s after compile")
    print(f"collectives per step: {per_kind or 'none'}")
    if "parity_max_abs_diff" in summary:
        verdict = "OK" if summary["parity_ok"] else "MISMATCH"
        print(
            f"parity: first {cfg.parity_steps} steps on one process over the global batch, "
            f"max |param diff| = {summary['parity_max_abs_diff']:.2e}, "
            f"{summary['parity_outliers']} of {summary['parity_elements']:,} elements outside "
            f"rtol={PARITY_RTOL:g}/atol={PARITY_ATOL:g} ({verdict})"
        )


def _dump_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dump",
        help="expand a train step on fake ranks and write each stage's graph, a summary and a picture",
        description="Compile a train step on torch's fake process group (any world size, no real ranks) and "
        "write each stage's graph as text, a JSON summary and an HTML picture.",
    )
    dump_tool.add_arguments(p)


def _diff_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two dumps (files or folders); exit 0 equal, 1 different, 2 bad input",
        description="Structural diff of two spmd-expand dumps (folders or files), nodes aligned by role; "
        "collectives side by side on top.",
    )
    diff_tool.add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    """The ``spmd-expand`` command line: the ``train``, ``dump`` and ``diff`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="spmd-expand",
        description="Compile single-device PyTorch train steps into SPMD programs: train a model under a "
        "parallel plan, or dump and diff the graphs each stage produces.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _dump_parser(sub)
    _diff_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        return _run_train(args)
    if args.command == "dump":
        return dump_tool.run(args)
    if args.command == "diff":
        return diff_tool.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
