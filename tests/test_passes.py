"""Unit tests of the graph passes (spmd_expand.passes) on expanded graphs of small models.

Graphs come from compiling on torch's fake process group (no real ranks; collectives are recorded,
not run) with ``passes=[]``; each test then runs one pass and checks what it requires, does and
ensures. That the passes keep results equal to one device is tested on real gloo ranks by the parity
suites (test_parity, test_training_loops, ...), which compile with the default passes.
"""

from __future__ import annotations

import operator
import types

import pytest
import torch
import torch.fx as fx

import spmd_expand as spmd
from spmd_expand.app.models import classification_step
from spmd_expand.graph_stats import collective_stats
from spmd_expand.ops import UNSHARD
from spmd_expand.passes import (
    DEFAULT_PASSES,
    BucketCollectives,
    OverlapCollectives,
    PassContext,
    RegatherForBackward,
    SpmdPass,
    SyncBatchNorm,
    default_passes,
    resolve_passes,
    run_passes,
)
from spmd_expand.passes.bucketing import block_of, collective_kind
from spmd_expand.passes.horizontal_fusion import HorizontalFusion, horizontal_fusion
from spmd_expand.passes.manager import copy_graph_module
from spmd_expand.passes.feeders import feeders as _feeders
from spmd_expand.tools.dump import gpt_job

WAIT = torch.ops._c10d_functional.wait_tensor.default


@pytest.fixture(scope="module")
def world(fake_mesh):
    """The session's fake process group (4 ranks; bucketing resolves the group's rank)."""
    return fake_mesh


def _compile(plan_name: str, passes, mesh, layers: int = 2):
    job = gpt_job(layers)
    plan = spmd.DDP() if plan_name == "ddp" else spmd.FSDP()
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager", passes=passes)(job.step)
    step(job.model, job.optimizer, *job.batch)
    return step, mesh


@pytest.fixture(scope="module")
def ddp_graph(world):
    step, mesh = _compile("ddp", [], world)
    return step.last.local_graph, PassContext(mesh, step._resolved, step.last.traced)


@pytest.fixture(scope="module")
def fsdp_graph(world):
    step, mesh = _compile("fsdp", ["regather_for_backward"], world)
    return step.last.local_graph, PassContext(mesh, step._resolved, step.last.traced)


def _run(p: SpmdPass, graph_and_context):
    gm, context = graph_and_context
    return run_passes(copy_graph_module(gm), [p], context)


def _position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_block_of():
    assert block_of("layers.3.attn.q_proj.weight") == "layers.3"
    assert block_of("encoder.layer.0.output.dense.bias") == "encoder.layer.0"
    assert block_of("tok_emb.weight") == ""
    assert block_of("head.0") == ""  # a parameter named by an index is not a block of its own


def test_bucketing_ddp_one_bucket_for_small_gradients(ddp_graph):
    before = collective_stats(ddp_graph[0]).as_dict()["all_reduce"]
    gm, records = _run(BucketCollectives(), ddp_graph)
    after = collective_stats(gm).as_dict()["all_reduce"]
    # 2-layer GPT: 34 gradient all-reduces (28 KB, under the 1 MiB first bucket) and the returned
    # loss's all-reduce become one; the loss denominator's all-reduce (forward needs it) stays.
    assert before["count"] == 36 and after["count"] == 2
    assert after["bytes"] == before["bytes"]
    assert records[0].name == "bucketing" and records[0].modified
    # Idempotent: the bucket is not merged again.
    again, records = run_passes(gm, [BucketCollectives()], ddp_graph[1])
    assert not records[0].modified and collective_stats(again).as_dict()["all_reduce"]["count"] == 2


def test_bucketing_writes_torchs_node_metadata(ddp_graph):
    """The merge's metadata (stack trace, module stack, provenance) is computed once per bucket, not
    once per new node, and is what torch's own ``_populate_node_meta`` writes on every new node."""
    from torch._inductor.fx_passes import bucketing as inductor_bucketing

    ours, _ = _run(BucketCollectives(), ddp_graph)
    theirs = copy_graph_module(ddp_graph[0])
    p = BucketCollectives()
    for kind, nodes in p.buckets(theirs):
        inductor_bucketing.merge_all_reduce_bucket(theirs.graph, nodes)

    def provenance(gm):
        merged = [n for n in gm.graph.nodes if "bucketing_stack_trace_sources" in n.meta]
        return len(merged), [
            (n.meta["stack_trace"], n.meta["nn_module_stack"], n.meta["bucketing_stack_trace_sources"],
             [(s.node_info.name, s.node_info.target, s.pass_name) for s in n.meta["from_node"]])
            for n in merged
        ]

    count, entries = provenance(ours)
    assert count > 10 and (count, entries) == provenance(theirs)
    # Sources: one per member of the bucket (34 gradients and the loss).
    assert len(entries[0][3]) == 35
    # Each node its own lists (a later pass appending to one node's provenance changes no other).
    merged = [n for n in ours.graph.nodes if "from_node" in n.meta and len(n.meta["from_node"]) == 35]
    assert len({id(n.meta["from_node"]) for n in merged}) == len(merged)


def test_bucketing_returned_loss_joins_the_last_gradient_bucket(ddp_graph):
    gm, _ = ddp_graph
    starts = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    returned = [n for n in starts if all(u.op == "output" for u in next(iter(n.users)).users)]
    assert len(returned) == 1 and returned[0].meta["val"].dim() == 0  # the loss, after the update
    buckets = BucketCollectives(bucket_cap_mb=0.004, first_bucket_cap_mb=0.001).buckets(copy_graph_module(gm))
    names = [[n.name for n in nodes] for _, nodes in buckets]
    assert returned[0].name in names[-1] and all(returned[0].name not in b for b in names[:-1])
    # Merged, the loss comes out of the bucket before the optimizer update, not after it.
    merged, _ = _run(BucketCollectives(), ddp_graph)
    position = _position(merged)
    bucket = next(n for n in merged.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default and n.meta["val"].numel() > 1)
    first_write = min(position[n] for n in merged.graph.nodes if n.target is torch.ops.aten.copy_.default)
    assert position[bucket] < first_write


def test_bucketing_ddp_caps_follow_production_order(ddp_graph):
    gm, _ = ddp_graph
    p = BucketCollectives(bucket_cap_mb=0.004, first_bucket_cap_mb=0.001)
    buckets = p.buckets(copy_graph_module(gm))
    sizes = []
    for kind, nodes in buckets:
        assert kind == "all_reduce"
        sizes.append(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes))
    assert len(buckets) > 2
    # The first bucket is capped at first_bucket_cap_mb, the others at bucket_cap_mb (a bucket of one
    # collective may be larger: it is not merged at all).
    assert sizes[0] <= 0.001 * 2**20 < max(sizes) <= 0.004 * 2**20
    # The first bucket holds the gradients backward produces first: the last layers'.
    first_fqns = {n.meta["fqn"] for n in buckets[0][1]}
    assert all(not f.startswith("layers.0.") for f in first_fqns), first_fqns


def test_bucketing_fsdp_one_gather_and_one_reduce_scatter_per_block(fsdp_graph):
    before = collective_stats(fsdp_graph[0]).as_dict()
    gm, _ = _run(BucketCollectives(), fsdp_graph)
    after = collective_stats(gm).as_dict()
    assert before["all_gather"]["count"] > 40 and before["reduce_scatter"]["count"] > 30
    # Blocks: layers.0, layers.1 and the root (embeddings, final norm). Reduce-scatters: one per
    # block (the root's gradients, produced in two places, the final norm's first and the embeddings'
    # last, form one bucket, as FSDP2 reduces a module's gradients together). All-gathers: per block
    # in forward (the root's final norm with its embeddings) and again in backward, except the root's
    # (FSDP2 keeps its root module's parameters for backward).
    assert after["reduce_scatter"]["count"] == 3
    assert after["all_gather"]["count"] == 5
    assert after["all_gather"]["bytes"] == before["all_gather"]["bytes"]
    assert after["reduce_scatter"]["bytes"] == before["reduce_scatter"]["bytes"]


def test_overlap_waits_late_and_issues_early(fsdp_graph):
    bucketed, context = _run(BucketCollectives(), fsdp_graph)
    gm, records = run_passes(copy_graph_module(bucketed), [OverlapCollectives()], context)
    assert records[0].modified
    pos = _position(gm)
    nodes = list(gm.graph.nodes)
    issuing = {m for n in nodes if collective_kind(n) for m in _feeders(n)}
    gathers = []
    for node in gm.graph.nodes:
        if node.target is WAIT:
            # Wait late: nothing but the issue of other collectives between a wait and its first user.
            first = min(node.users, key=pos.__getitem__)
            between = nodes[pos[node] + 1 : pos[first]]
            assert all(n in issuing or n.target is WAIT for n in between), (node.name, between)
        kind = collective_kind(node)
        if kind == "all_gather":
            gathers.append(node)
    # All-gathers prefetch one block ahead: each is issued after the previous one's wait, and
    # before that wait's first user has finished its block (it is issued ahead of its own wait).
    for previous, current in zip(gathers, gathers[1:]):
        previous_wait = next(iter(previous.users))
        assert pos[previous_wait] < pos[current] < pos[next(iter(current.users))]
    # Reduce-scatters start before the end of backward: under the overlap pass the first one is
    # issued before the last matmul of the step.
    last_mm = max(pos[n] for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    first_rs = min(pos[n] for n in gm.graph.nodes if collective_kind(n) == "reduce_scatter")
    assert first_rs < last_mm
    before_rs = min(pos_b for n, pos_b in _position(bucketed).items() if collective_kind(n) == "reduce_scatter")
    assert before_rs > max(i for n, i in _position(bucketed).items() if n.target is torch.ops.aten.mm.default)
    # A second run finds nothing to move.
    _, records = run_passes(gm, [OverlapCollectives()], context)
    assert not records[0].modified


def test_overlap_never_moves_a_collective_above_an_in_place_write(ddp_graph):
    gm, context = ddp_graph
    bucketed, _ = run_passes(copy_graph_module(gm), [BucketCollectives()], context)
    out, _ = run_passes(copy_graph_module(bucketed), [OverlapCollectives()], context)

    def writes_before_each_start(graph_module):
        result, writes = {}, []
        for n in graph_module.graph.nodes:
            if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
                writes.append(n.name)
            if collective_kind(n):
                result[n.name] = set(writes)
        return result

    before, after = writes_before_each_start(bucketed), writes_before_each_start(out)
    assert before.keys() == after.keys()
    assert all(before[name] <= after[name] for name in before)


def test_overlap_issues_the_loss_denominator_when_the_step_starts(ddp_graph):
    gm, context = ddp_graph
    bucketed, _ = run_passes(copy_graph_module(gm), [BucketCollectives()], context)
    out, _ = run_passes(copy_graph_module(bucketed), [OverlapCollectives()], context)

    def denominator(graph_module):
        # The all-reduce of nll_loss's total weight: the count of targets not equal to ignore_index.
        return next(
            n
            for n in graph_module.graph.nodes
            if collective_kind(n) == "all_reduce" and n.args[0].args[0].args[0].target is torch.ops.aten.ne.Scalar
        )

    compute = (torch.ops.aten.embedding.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    pos = _position(bucketed)
    first_compute = min(pos[n] for n in bucketed.graph.nodes if n.target in compute)
    assert pos[denominator(bucketed)] > first_compute  # expansion placed it after the forward
    pos = _position(out)
    first_compute = min(pos[n] for n in out.graph.nodes if n.target in compute)
    start = denominator(out)
    assert pos[start] < first_compute  # issued before any compute: it reads only the batch
    wait = next(iter(start.users))
    between = list(out.graph.nodes)[pos[wait] + 1 : pos[min(wait.users, key=pos.__getitem__)]]
    assert all(n.target is WAIT or collective_kind(n) for n in between)  # waited where it is used


def _denominator_graph(extra: str) -> fx.GraphModule:
    """x @ x / all_reduce(count(target != -100)); ``extra`` changes the count's computation."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = fx.Graph()
    x, target = graph.placeholder("x"), graph.placeholder("target")
    h = graph.call_function(aten.mm.default, (x, x))
    mask = graph.call_function(aten.ne.Scalar, (h if extra == "reads activation" else target, -100))
    if extra == "random":
        mask = graph.call_function(aten.bernoulli.p, (graph.call_function(aten._to_copy.default, (mask,), {"dtype": torch.float32}), 0.5))
    count = graph.call_function(aten.sum.default, (mask,))
    if extra == "count used twice":
        h = graph.call_function(aten.mul.Tensor, (h, count))
    reduced = graph.call_function(c10d.all_reduce.default, (count, "sum", "0"))
    waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
    graph.output(graph.call_function(aten.div.Tensor, (h, waited)))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("extra", ["", "reads activation", "random", "count used twice"])
def test_overlap_hoists_only_deterministic_compute_that_reads_graph_inputs(extra):
    gm = _denominator_graph(extra)
    result = OverlapCollectives().call(gm)
    nodes = [n for n in result.graph_module.graph.nodes if n.op == "call_function"]
    names = [getattr(n.target, "__name__", str(n.target)) for n in nodes]
    start = names.index("all_reduce.default")
    if extra == "":
        # The count and its all-reduce go first; the matmul runs while the bytes move.
        assert names[: start + 1] == ["ne.Scalar", "sum.default", "all_reduce.default"]
        assert names[start + 1] == "mm.default"
    else:
        # Reading an activation, drawing random numbers, or sharing a non-view value with other
        # compute: the count stays where it was and the collective issues right after it.
        assert names.index("mm.default") < start
        assert names[start - 1] == "sum.default"


def test_regather_adds_markers_once(world):
    step, mesh = _compile("fsdp", [], world)
    traced = step.last.traced
    gm = copy_graph_module(traced.graph_module)
    markers = sum(n.target is UNSHARD for n in gm.graph.nodes)
    out, records = run_passes(gm, [RegatherForBackward()], PassContext(mesh, step._resolved, traced))
    assert records[0].modified and sum(n.target is UNSHARD for n in out.graph.nodes) > markers
    again, records = run_passes(out, [RegatherForBackward()], PassContext(mesh, step._resolved, traced))
    assert not records[0].modified


def test_regather_is_a_no_op_without_reshard_after_forward(world):
    step, mesh = _compile("ddp", [], world)
    traced = step.last.traced
    out, records = run_passes(copy_graph_module(traced.graph_module), [RegatherForBackward()], PassContext(mesh, step._resolved, traced))
    assert not records[0].modified


def test_default_pipeline_records_each_pass(world):
    step, _ = _compile("fsdp", "default", world)
    assert [r.name for r in step.last.passes] == list(DEFAULT_PASSES)
    assert all(r.seconds >= 0 for r in step.last.passes)
    assert collective_stats(step.last.expanded).total_count > collective_stats(step.last.local_graph).total_count
    assert {"trace", "global_passes", "propagate", "expand", "local_passes", "lower"} <= set(step.last.seconds)


@pytest.mark.parametrize("plan_name", ["ddp", "fsdp"])
def test_a_compilation_generates_python_code_only_for_the_graph_it_runs(world, monkeypatch, plan_name):
    # The stages build graph modules lazily (pipeline.expand_step): Python code is generated when a
    # graph module is first called or printed, not at each construction and recompile(): 25 times
    # for this step under DDP and 47 under FSDP before. With eager lowering, the one call is the local
    # graph's.
    generated = []
    python_code = fx.Graph.python_code

    def counting(self, *args, **kwargs):
        generated.append(self)
        return python_code(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counting)
    step, _ = _compile(plan_name, "default", world)
    assert generated == [step.last.local_graph.graph]


def test_pass_selection_errors():
    with pytest.raises(spmd.PassError, match="unknown pass 'bucketting'"):
        resolve_passes(["bucketting"])
    with pytest.raises(spmd.PassError, match="more than once"):
        resolve_passes(["overlap", "overlap"])
    with pytest.raises(spmd.PassError, match="cannot disable"):
        default_passes(disable=["nope"])
    assert default_passes(disable=["overlap"]) == ["sync_batch_norm", "regather_for_backward", "horizontal_fusion", "bucketing"]
    global_passes, local_passes = resolve_passes("default")
    assert [p.name for p in global_passes] == ["sync_batch_norm", "regather_for_backward", "horizontal_fusion"]
    assert [p.name for p in local_passes] == ["bucketing", "overlap"]


def test_a_failing_pass_is_named(ddp_graph):
    def broken(gm):
        raise ValueError("boom")

    with pytest.raises(spmd.PassError, match=r"pass 'broken' failed: ValueError: boom"):
        _run(resolve_passes([broken])[1][0], ddp_graph)


def test_bucketing_requires_fake_values(ddp_graph):
    gm = copy_graph_module(ddp_graph[0])
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    with pytest.raises(spmd.PassError, match="bucketing.*meta\\['val'\\]"):
        run_passes(gm, [BucketCollectives()], ddp_graph[1])


def test_a_pass_that_breaks_the_graph_is_caught(ddp_graph):
    class Unsort(SpmdPass):
        name = "unsort"

        def call(self, gm):
            from torch.fx.passes.infra.pass_base import PassResult

            nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
            nodes[0].prepend(nodes[-1])  # a node before its inputs
            return PassResult(gm, True)

    with pytest.raises(spmd.PassError, match="unsort"):
        _run(Unsort(), ddp_graph)


# ---------------------------------------------------------------------------------- horizontal_fusion


def _bias_corrections(steps, params, lr):
    """Adam's foreach arithmetic on the lanes of a foreach result (torch 2.13, _multi_tensor_adam)."""
    steps = torch._foreach_add(steps, 1)
    bc1 = [1 - 0.9**s for s in steps]  # pow then rsub per lane: the lanes interleave
    bc2 = [1 - 0.999**s for s in steps]
    step_size = torch.stack([(lr / b) * -1 for b in bc1])
    bc2_sqrt = [b**0.5 for b in bc2]
    return [step_size, *torch._foreach_div(params, bc2_sqrt)]


def _lanes(n):
    torch.manual_seed(0)
    steps = [torch.tensor(float(i), dtype=torch.float64) for i in range(1, n + 1)]
    return steps, [torch.randn(3) for _ in range(n)], torch.tensor(0.01, dtype=torch.float64)


def _scalar_ops(gm):
    return sum(
        1 for n in gm.graph.nodes
        if n.op == "call_function" and n.target in (torch.ops.aten.pow.Scalar, torch.ops.aten.rsub.Scalar, torch.ops.aten.div.Tensor)
    )


def test_horizontal_fusion_makes_one_op_per_chain_step_with_equal_values():
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _lanes(5)
    gm = make_fx(_bias_corrections, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    assert _scalar_ops(gm) == 25  # 5 lanes x (pow, rsub) x 2 and div
    assert horizontal_fusion(gm) == 7  # (pow, rsub) x 2, div, mul, pow 0.5
    assert _scalar_ops(gm) == 5
    # The step sizes' stack is the fused vector itself: the only stack left gathers the foreach lanes.
    stacks = [n for n in gm.graph.nodes if n.target is torch.ops.aten.stack.default]
    assert len(stacks) == 1 and all(a.target is operator.getitem for a in stacks[0].args[0])
    for a, b in zip(expected, gm(*inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert horizontal_fusion(gm) == 0  # idempotent


def test_horizontal_fusion_leaves_mixed_dtypes_and_non_lockstep_lanes_alone():
    from torch.fx.experimental.proxy_tensor import make_fx

    def mixed(steps, scale):
        steps = torch._foreach_add(steps, 1)
        # A float32 0-d scale promotes a float64 0-d lane, but would not promote a float64 vector the
        # same way: not fused.
        return [s * scale for s in steps]

    def per_lane_loop(steps, params):
        steps = torch._foreach_add(steps, 1)
        out = []
        for s, p in zip(steps, params):  # the whole chain of one lane, then the next lane's
            out.append(p * (1 - 0.9**s))
        return out

    steps, params, _ = _lanes(4)
    gm = make_fx(mixed, tracing_mode="fake")([s.float() for s in steps], torch.tensor(2.0, dtype=torch.float64))
    assert horizontal_fusion(gm) == 0
    gm = make_fx(per_lane_loop, tracing_mode="fake")(steps, params)
    expected = gm(steps, params)
    horizontal_fusion(gm)
    for a, b in zip(expected, gm(steps, params)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_horizontal_fusion_on_the_adamw_step(world):
    """Default pipeline, AdamW foreach on the 2-layer GPT: the per-parameter pow/rsub/reciprocal
    chains (10 nodes per parameter) become a handful of vector ops."""

    def adamw_step(passes):
        job = gpt_job(2)
        optimizer = torch.optim.AdamW(job.model.parameters(), lr=1e-3, foreach=True)
        step = spmd.compile(mesh=world, plan=spmd.DDP(), lower="eager", passes=passes)(job.step)
        step(job.model, optimizer, *job.batch)
        return step

    with_pass, without = adamw_step(["horizontal_fusion"]), adamw_step([])
    fused, plain = with_pass.last.traced.graph_module.graph, without.last.traced.graph_module.graph

    def count(graph, target):
        return sum(1 for n in graph.nodes if n.target is target)

    assert count(plain, torch.ops.aten.pow.Scalar) == 68 and count(fused, torch.ops.aten.pow.Scalar) == 2
    assert len(fused.nodes) < len(plain.nodes) - 200
    assert with_pass.last.passes[0].name == "horizontal_fusion" and with_pass.last.passes[0].modified


class _UnevenRoot(torch.nn.Module):
    """Blocks around a root block whose parameters do not split evenly over 2 ranks: a ``(1, 8)``
    token (rank 1's piece is empty) and a 5-class head. Expansion pads those on rank 1 only."""

    def __init__(self):
        super().__init__()
        self.token = torch.nn.Parameter(torch.randn(1, 8))
        self.embed = torch.nn.Linear(6, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = self.embed(x) + self.token
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _uneven_root_worker(rank: int, world: int) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from spmd_expand.rank_check import collective_entries

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _UnevenRoot()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = spmd.compile(mesh=mesh, plan=spmd.FSDP(), lower="eager")(classification_step)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
        local = slice(rank * 8 // world, (rank + 1) * 8 // world)
        step(model, optimizer, x[local], y[local])
        classification_step(reference, ref_optimizer, x, y)
    return {
        "collectives": collective_entries(step.last.local_graph, mesh)[0],
        "params": {k: v.full_tensor() for k, v in model.named_parameters()},
        "ref_params": dict(reference.named_parameters()),
    }


def test_bucketing_places_buckets_alike_on_every_rank():
    """The root block's all-gather bucket (embeddings with the head, used far apart) goes where its
    first member was, with the padding of the short pieces moved along: on every rank, although only
    rank 1 pads. A placement that read the padding's position issued the ranks' collectives in
    different orders (HF ViT and wav2vec2 under FSDP aborted inside gloo: "Received data size doesn't
    match expected size")."""
    from spmd_expand.app.launch import run_local

    per_rank = run_local(_uneven_root_worker, 2, timeout_s=300)
    assert per_rank[0]["collectives"] == per_rank[1]["collectives"]
    assert sum("all_gather" in c for c in per_rank[0]["collectives"]) == 3 + 2  # root, 2 blocks; blocks again
    for r in per_rank:
        for k, v in r["ref_params"].items():
            torch.testing.assert_close(r["params"][k], v.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _conv_bn_step(mesh, plan, passes, batch=2, size=8, dtype=torch.float32):
    """A conv net with two BatchNorm2d (affine, running statistics) and one BatchNorm1d without affine
    or running statistics, in train mode, compiled on the fake process group for a local batch of
    ``batch`` images of ``size`` x ``size`` in ``dtype``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.BatchNorm1d(6, affine=False, track_running_stats=False), torch.nn.Linear(6, 5),
    ).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd.compile(mesh=mesh, plan=plan, lower="eager", passes=passes)(classification_step)
    compiled(model, optimizer, torch.randn(batch, 3, size, size, dtype=dtype), torch.randint(0, 5, (batch,)))
    return compiled


_BATCH_NORM_OPS = (
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten.native_batch_norm_backward.default,
)


def test_sync_batch_norm_keeps_activations_on_their_ranks(world):
    """Under DDP the BatchNorms' inputs were all-gathered (DTensor has no batch-sharded batch-norm
    strategy); with the pass each BatchNorm all-reduces its two per-channel sums forward and the two sums of
    its backward in one collective each, and nothing is gathered."""
    before = _conv_bn_step(world, spmd.DDP(), [])
    after = _conv_bn_step(world, spmd.DDP(), [SyncBatchNorm(by_cost=False)])
    assert collective_stats(before.last.local_graph).as_dict()["all_gather"]["count"] > 0
    stats = collective_stats(after.last.local_graph).as_dict()
    assert set(stats) == {"all_reduce"}, stats
    all_reduces = [
        n for n in after.last.local_graph.graph.nodes
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.all_reduce.default
    ]
    # One per BatchNorm each way: forward the float64 sums of x and x^2, backward the two float32 sums.
    forward = [n for n in all_reduces if n.meta["val"].dtype == torch.float64]
    backward = [n for n in all_reduces if n.args[0].target is torch.ops.aten.stack.default and n not in forward]
    assert sorted(tuple(n.meta["val"].shape) for n in forward) == [(2, 1, 6), (2, 1, 6, 1, 1), (2, 1, 8, 1, 1)], forward
    assert sorted(tuple(n.meta["val"].shape) for n in backward) == [(2, 6), (2, 6), (2, 8)], backward
    traced = after.last.traced.graph_module.graph
    assert not [n for n in traced.nodes if n.target in _BATCH_NORM_OPS]
    record = after.last.passes[0]
    assert record.name == "sync_batch_norm" and record.modified


def test_sync_batch_norm_of_a_float64_model_takes_two_passes(world):
    """float64 has no wider type to accumulate the one-pass sums in: the sum, then the sum of squared
    deviations, one all-reduce each (``C`` float64 elements), as torch's two-pass CPU kernel."""
    step = _conv_bn_step(world, spmd.DDP(), [SyncBatchNorm(by_cost=False)], dtype=torch.float64)
    all_reduces = [n for n in step.last.local_graph.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    forward = [n for n in all_reduces if n.args[0].target is torch.ops.aten.sum.dim_IntList]
    assert sorted(n.meta["val"].numel() for n in forward) == [6, 6, 6, 6, 8, 8], forward


def test_sync_batch_norm_chooses_by_cost(world):
    """By default a BatchNorm is rewritten only where DTensor's cost model says its statistics'
    all-reduces cost less than gathering its activations: none at 2 images of 8x8 (activations of
    1 KB), the two BatchNorm2d at 32 images of 48x48 (2.4 MB), never the BatchNorm1d (768 bytes)."""
    small = _conv_bn_step(world, spmd.DDP(), ["sync_batch_norm"])
    assert not small.last.passes[0].modified
    assert collective_stats(small.last.local_graph).as_dict()["all_gather"]["count"] > 0
    large = _conv_bn_step(world, spmd.DDP(), ["sync_batch_norm"], batch=16, size=48)
    left = [n.target for n in large.last.traced.graph_module.graph.nodes if n.target in _BATCH_NORM_OPS]
    assert sorted(map(str, left)) == ["aten._native_batch_norm_legit.no_stats", "aten.native_batch_norm_backward.default"]
    sums = [n for n in large.last.local_graph.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert sorted(n.meta["val"].numel() for n in sums if n.meta["val"].dtype == torch.float64) == [12, 16]


def test_sync_batch_norm_runs_once_and_only_where_the_batch_is_split(world):
    from spmd_expand.passes.sync_batch_norm import sync_batch_norm

    step = _conv_bn_step(world, spmd.DDP(), [])
    gm = copy_graph_module(step.last.traced.graph_module)
    assert sync_batch_norm(gm, (0,)) == 6  # three forward ops, three backward ops
    assert sync_batch_norm(gm, (0,)) == 0
    # A plan that shards no batch (tensor parallel): the fused ops stay.
    tp = PassContext(world, types.SimpleNamespace(data_parallel_dims=[]), step.last.traced)
    fresh = copy_graph_module(step.last.traced.graph_module)
    _, records = run_passes(fresh, [SyncBatchNorm()], tp)
    assert not records[0].modified
    assert [n for n in fresh.graph.nodes if n.target in _BATCH_NORM_OPS]
