"""Which graphs Inductor compiles: a graph that runs once (it creates optimizer state the next call
passes in) is lowered eagerly; the steady-state graph goes to Inductor."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import lowering_cases
import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import classification_step
from spmd_expand.lower import collective_hazard


def test_graph_that_creates_momentum_buffers_is_not_sent_to_inductor(fake_mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="inductor")(classification_step)
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    step(model, optimizer, x, y)  # SGD creates momentum_buffer in its first step
    assert step.last.lowering == "eager"
    assert any(o.kind == "state" for o in step.last.traced.outputs)
    first = step.last
    step(model, optimizer, x, y)  # momentum buffers are inputs now: the steady-state graph
    assert step.last is not first and step.last.lowering == "inductor"
    step(model, optimizer, x, y)
    assert sum(len(v) for v in step.cache.values()) == 2


def _sgd_update(p, g, buf, lr, momentum, weight_decay):
    """The shape of an optimizer's traced update: float arithmetic, then Scalar operands of ATen ops."""
    decay = 1 - lr * weight_decay
    p = torch.ops.aten.mul.Tensor(p, decay)
    buf = torch.ops.aten._foreach_mul.Scalar([buf], momentum)[0]
    buf = torch.ops.aten.add.Tensor(buf, g)
    p = torch.ops.aten.add.Tensor(p, buf, alpha=-lr)
    corrected = torch.ops.aten.pow.Scalar(momentum, torch.ops.aten.sum.default(g))
    p = torch.ops.aten.lerp.Scalar(p, g, momentum * 0.5)
    p = torch.ops.aten.addcdiv.default(p, g, buf, value=lr)
    return p, buf, corrected


def _traced(fn, *args):
    """``fn`` as an fx graph whose float arguments stay inputs (as the step's hyperparameters are),
    with ``meta["val"]`` on every node."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*args)
    return gm


def test_float_inputs_become_tensors_and_keep_their_values():
    from spmd_expand.passes.manager import copy_graph_module
    from spmd_expand.tensorify import tensorify_float_inputs

    p, g, buf = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    gm = _traced(_sgd_update, p, g, buf, 0.1, 0.9, 0.01)
    rewritten = copy_graph_module(gm)
    assert tensorify_float_inputs(rewritten, [3, 4, 5]) is None
    # No float reaches an op any more: every placeholder-derived value is a tensor.
    assert not [n for n in rewritten.graph.nodes if n.target in (operator.mul, operator.sub, operator.neg)]
    for hyper in [(0.1, 0.9, 0.01), (0.37, 0.5, 0.2)]:  # values other than the traced ones
        expected = _sgd_update(p, g, buf, *hyper)
        got = rewritten(p, g, buf, *(torch.tensor(h, dtype=torch.float64) for h in hyper))
        for e, o in zip(expected, got):
            torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-7)


def test_a_float_input_used_by_an_unknown_op_is_left_alone():
    from spmd_expand.tensorify import tensorify_float_inputs

    gm = _traced(lambda x, lr: torch.ops.aten.clamp.default(x, lr, None), torch.randn(3), 0.5)
    code = gm.code
    refused = tensorify_float_inputs(gm, [1])
    assert refused is not None and refused.target is torch.ops.aten.clamp.default
    assert gm.code == code


def test_inductor_step_recompiles_for_a_float_it_holds_as_a_constant():
    # Where the rewrite refuses, the value is a constant of the compiled code: a new value compiles
    # again (with a warning) instead of running with the old one.
    import pytest

    from spmd_expand.lower import InductorStep

    gm = _traced(lambda x, lr: [torch.ops.aten.clamp.default(x, lr, None)], torch.randn(3), 0.5)
    x = torch.tensor([0.0, 1.0, 2.0])
    step = InductorStep(gm, [x, 0.5], {})
    assert step.constants == [1]
    torch.testing.assert_close(step(x, 0.5)[0], torch.tensor([0.5, 1.0, 2.0]))
    with pytest.warns(UserWarning, match="compiling the step again"):
        out = step(x, 1.5)[0]
    torch.testing.assert_close(out, torch.tensor([1.5, 1.5, 2.0]))


def test_alpha_of_an_add_survives_inductor():
    # torch 2.13's post-grad addmm pattern drops it: x + alpha * (a @ b) became x + a @ b.
    from spmd_expand.lower import lower

    def update(p, a, b):
        return [torch.ops.aten.add.Tensor(p, torch.ops.aten.mm.default(a, b), alpha=-0.1)]

    p, a, b = torch.randn(4, 4), torch.randn(4, 3), torch.randn(3, 4)
    gm = _traced(update, p, a, b)
    torch.testing.assert_close(lower(gm, [p, a, b], "inductor")(p, a, b)[0], update(p, a, b)[0])


aten = torch.ops.aten
# Every op form the rewrite knows, with a float input ``h``; x, y, z are 16-bit tensors.
_HALF_FORMS = {
    "mul": lambda x, y, z, h: aten.mul.Tensor(x, h),
    "div.Scalar": lambda x, y, z, h: aten.div.Scalar(x, h),
    "add": lambda x, y, z, h: aten.add.Tensor(x, h),
    "sub.Scalar": lambda x, y, z, h: aten.sub.Scalar(x, h),
    "add alpha": lambda x, y, z, h: aten.add.Tensor(x, y, alpha=-h),
    "pow.Scalar": lambda x, y, z, h: aten.pow.Scalar(h, aten.abs.default(y)),
    "pow.Tensor_Scalar": lambda x, y, z, h: aten.pow.Tensor_Scalar(aten.abs.default(x), h * 3),
    "lerp": lambda x, y, z, h: aten.lerp.Scalar(x, y, h),
    "addcdiv": lambda x, y, z, h: aten.addcdiv.default(x, y, z, value=h),
    "addcmul": lambda x, y, z, h: aten.addcmul.default(x, y, z, value=h),
    "_foreach_mul": lambda x, y, z, h: aten._foreach_mul.Scalar([x, y], h)[1],
    "_foreach_div": lambda x, y, z, h: aten._foreach_div.Scalar([x, y], h)[0],
    "_foreach_add": lambda x, y, z, h: aten._foreach_add.Scalar([x], h)[0],
    "_foreach_sub": lambda x, y, z, h: aten._foreach_sub.Scalar([x], h)[0],
    "_foreach_lerp": lambda x, y, z, h: aten._foreach_lerp.Scalar([x], [y], h)[0],
    "_foreach_addcdiv": lambda x, y, z, h: aten._foreach_addcdiv.Scalar([x], [y], [z], h)[0],
    "_foreach_add.List": lambda x, y, z, h: aten._foreach_add.List([x], [y], alpha=h)[0],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", sorted(_HALF_FORMS))
def test_16_bit_operands_compute_as_eager_does(form, dtype):
    # A 16-bit op computes in float32. mul/div/lerp/addcmul take a Scalar unrounded (a 0-d bf16 tensor
    # would round AdamW's beta1 0.9 to 0.8984); add/sub/pow and every alpha round it to 16 bits first.
    # Before, such uses kept the value a constant and Inductor compiled again for every new LR.
    from spmd_expand.tensorify import tensorify_float_inputs

    fn = _HALF_FORMS[form]
    torch.manual_seed(0)
    x, y, z = (torch.rand(256).add(0.05).to(dtype) for _ in range(3))
    gm = _traced(lambda x, y, z, h: [fn(x, y, z, h)], x, y, z, 0.9)
    assert tensorify_float_inputs(gm, [3]) is None
    for h in (0.9, 0.37):
        expected = fn(x, y, z, h)
        got = gm(x, y, z, torch.tensor(h, dtype=torch.float64))[0]
        assert got.dtype == dtype
        assert torch.equal(got, expected), (got - expected).abs().max()


def _denominator_step(group: str):
    """The loss denominator as ``overlap`` orders it: the count of targets and its all-reduce first,
    then the forward (a matmul) and a loss that reads the same targets, then the wait."""
    c10d = torch.ops._c10d_functional

    def step(x, target):
        count = aten._to_copy.default(aten.sum.default(aten.ne.Scalar(target, -100)), dtype=torch.float32)
        reduced = c10d.all_reduce.default(count, "sum", group)
        rows = aten.sum.dim_IntList(aten.mm.default(x, x), [1])
        total = aten.sum.default(aten.mul.Tensor(rows, aten._to_copy.default(target, dtype=torch.float32)))
        return [aten.div.Tensor(total, c10d.wait_tensor.default(reduced))]

    return step


@pytest.mark.parametrize("keep_order", [True, False])
def test_inductor_issues_a_collective_where_overlap_put_it(fake_mesh, keep_order):
    # Inductor fuses the count into the loss kernel (both read the targets) and places the fused
    # kernel after the matmul: the all-reduce overlap issued first goes out after the forward. The
    # post-grad pass lowering installs on accelerators keeps the issue order (torch's control_deps);
    # on CPU ranks (gloo needs a core the compute uses) lowering leaves Inductor's order.
    from torch._inductor.utils import run_and_get_code

    from spmd_expand.lower import _keep_issue_order_pass, lower

    step = _denominator_step(fake_mesh.get_group().group_name)
    x, target = torch.randn(8, 8), torch.randint(0, 4, (8,))
    gm = _traced(step, x, target)
    patches = {"fx_graph_cache": False}
    if keep_order:
        patches["post_grad_custom_post_pass"] = _keep_issue_order_pass(None)
    with torch._inductor.config.patch(patches):
        (result,), (code, *_) = run_and_get_code(
            lambda: lower(gm, [x, target], "inductor", ran_passes=frozenset({"bucketing", "overlap"}))(x, target)
        )
    torch.testing.assert_close(result, step(x, target)[0])
    body = code[code.index("def call(") :]
    issued_first = body.index("all_reduce_") < body.index("extern_kernels.mm")
    assert issued_first == keep_order


_READ_BEFORE_WAIT = """
def call(self, args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 2, '0')
    assert_size_stride(buf0, (8, 4), (4, 1), 'all_gather')
    buf1 = reinterpret_tensor(buf0, (4, 4), (4, 1), 16)  # alias
    buf2 = empty_strided_cpu((8, 4), (4, 1), torch.float32)
    cpp_fused_mul_0(arg1_1, buf2)
    torch.ops._c10d_functional.all_reduce_.default(buf2, 'sum', '0')
    cpp_fused_add_1(buf1, buf3)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    torch.ops._c10d_functional.wait_tensor.default(buf2)
    cpp_fused_add_2(buf0, buf2, buf4)
"""


def test_a_read_of_a_collective_output_before_its_wait_is_found():
    """The check of Inductor's wrapper code: a read through a view of an all-gather's output before its
    wait is found; reads after the waits, shape asserts and the views themselves are not reads."""
    found = collective_hazard(_READ_BEFORE_WAIT)
    assert found is not None and found.kind == "read", found
    assert str(found).startswith("reads buf1 (the output of all_gather_into_tensor) before its wait, in `cpp_fused_add_1"), found
    waited_first = _READ_BEFORE_WAIT.replace("    cpp_fused_add_1(buf1, buf3)\n", "")
    assert collective_hazard(waited_first) is None
    in_place = waited_first.replace("    torch.ops._c10d_functional.wait_tensor.default(buf2)\n", "").replace(
        "cpp_fused_add_2(buf0, buf2, buf4)", "cpp_fused_add_2(buf0, buf2, buf4)\n    torch.ops._c10d_functional.wait_tensor.default(buf2)"
    )
    assert "buf2 (the output of all_reduce_)" in str(collective_hazard(in_place))


def test_inductor_code_that_reads_a_collective_before_its_wait_runs_eager():
    """2 gloo ranks, DDP, Inductor: for this step's graph after the prologue, Inductor (torch 2.13, CPU)
    emitted a fused kernel reading an all-gather's output before its wait_tensor: from the second call
    on the loss was nan or 1e17 and the parameters nan, silently (it depended on what the buffer held).
    The generated code is checked: such a graph runs eager, with a warning, and matches one device."""
    per_rank = run_local(lowering_cases.run_batch_weighted_inductor, 2, timeout_s=600)
    for rank, r in enumerate(per_rank):
        for i, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
            torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} call {i}: {m}")
        for got, ref in zip(r["params"], r["ref_params"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


_OVERWRITE_BEFORE_WAIT = """
def call(self, args):
    buf0 = empty_strided_cpu((16, ), (1, ), torch.float32)
    buf1 = empty_strided_cpu((8, ), (1, ), torch.float32)
    cpp_fused_cat_0(arg0_1, buf1)
    torch.ops._c10d_functional.all_gather_into_tensor_out.default(buf1, 2, '0', out=buf0)
    buf2 = buf1; del buf1  # reuse
    buf3 = reinterpret_tensor(buf2, (4, ), (1, ), 0)  # alias
    cpp_fused_cat_1(arg1_1, buf2, buf3)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    cpp_fused_add_2(buf0, buf4)
"""


def test_a_collective_input_reused_before_its_wait_is_found():
    """The check of Inductor's wrapper code: an `_out` all-gather's input handed to another buffer
    (`# reuse`) while the all-gather is in flight is found, as is a read of its `out=` buffer before the
    wait; the same reuse after the wait is not, nor is a reuse of an all-reduce's input after its wait."""
    found = collective_hazard(_OVERWRITE_BEFORE_WAIT)
    assert found is not None and (found.kind, found.buffer, found.collective) == ("overwrite", "buf1", "all_gather_into_tensor_out"), found
    assert "reuses the memory of buf1" in str(found)
    wait = "    torch.ops._c10d_functional.wait_tensor.default(buf0)\n"
    waited_first = _OVERWRITE_BEFORE_WAIT.replace(wait, "").replace("    buf2 = buf1;", wait + "    buf2 = buf1;")
    assert collective_hazard(waited_first) is None
    read_out = waited_first.replace(wait, "    cpp_fused_mul_3(buf0, buf5)\n" + wait)
    read = collective_hazard(read_out)
    assert read is not None and (read.kind, read.buffer) == ("read", "buf0"), read
    # A collective in place on a view of a buffer, waited through a view of it (a row-parallel matmul's
    # all-reduce): the wait covers the buffer, so a read after it is no hazard.
    view_waited = """
def call(self, args):
    buf0 = empty_strided_cpu((32, 32), (32, 1), torch.float32)
    extern_kernels.mm(arg0_1, arg1_1, out=buf0)
    torch.ops._c10d_functional.all_reduce_.default(reinterpret_tensor(buf0, (4, 8, 32), (256, 32, 1), 0), 'sum', '0')
    torch.ops._c10d_functional.wait_tensor.default(reinterpret_tensor(buf0, (4, 8, 32), (256, 32, 1), 0))
    cpp_fused_add_0(buf0, buf1)
"""
    assert collective_hazard(view_waited) is None
    assert collective_hazard(view_waited.replace("    torch.ops._c10d_functional.wait_tensor", "    cpp_fused_mul_1(buf0, buf2)\n    torch.ops._c10d_functional.wait_tensor")).buffer == "buf0"
    # An input that is a view: the buffer it views is in flight too.
    viewed = _OVERWRITE_BEFORE_WAIT.replace(
        "all_gather_into_tensor_out.default(buf1,", "all_gather_into_tensor_out.default(buf9,"
    ).replace("    cpp_fused_cat_0(arg0_1, buf1)\n", "    cpp_fused_cat_0(arg0_1, buf1)\n    buf9 = reinterpret_tensor(buf1, (8, ), (1, ), 0)  # alias\n")
    assert collective_hazard(viewed).buffer == "buf1"


def test_inductor_code_that_overwrites_an_all_gather_input_in_flight_is_compiled_again():
    """2 gloo ranks, FSDP, Inductor, HF Llama with a padded batch (hunt on HF training loops): torch
    2.13's Inductor handed a bucketed all-gather's input buffer to the next bucket's copy kernel before
    the all-gather's wait, while gloo still sent it: losses and gradients differed from one device and
    from run to run (4.1476 / 4.1346 vs 4.1472; parameters 3.7e-2 off after 3 steps), silently, under
    both spmd.compile and the torch.compile backend. Such code is compiled again without buffer reuse:
    still Inductor, and one device's values."""
    per_rank = run_local(lowering_cases.run_padded_llama_fsdp_inductor, 2, timeout_s=900)
    for rank, r in enumerate(per_rank):
        assert r["lowering"] == "inductor"
        assert any("compiled again without buffer reuse" in line for line in r["log"]), r["log"]
        for i, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
            torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} call {i}: {m}")
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
