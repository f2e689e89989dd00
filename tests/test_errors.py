"""User-facing errors: one family (``spmd.SpmdError``), messages that say what, where and how to fix.

Tracing-only, on a fake 4-rank mesh.
"""

from __future__ import annotations

import inspect
import os
import random
import re

import pytest
import torch
import torch.nn as nn
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

import cases
import spmd_expand as spmd
from spmd_expand.app.models import MLP

aten = torch.ops.aten


mse_step = cases.mse_step


class Bucketize(nn.Module):
    """Uses ``torch.searchsorted``, for which DTensor has no sharding rule (torch 2.13)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("edges", torch.tensor([-1.0, 0.0, 1.0]))

    def forward(self, x):
        h = self.fc(x)
        bins = torch.searchsorted(self.edges, h.detach())
        return h * bins


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return self.fc(-x)


def ddp(mesh, fn=mse_step, **kwargs):
    return spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager", **kwargs)(fn)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_error_hierarchy():
    for cls in (spmd.TraceError, spmd.PlanError, spmd.UnsupportedOpError, spmd.PlacementError):
        assert issubclass(cls, spmd.SpmdError)
    assert issubclass(spmd.SpmdError, Exception)


def test_searchsorted_really_has_no_dtensor_rule(fake_mesh):
    """Precondition of the next test: DTensor itself cannot place aten.searchsorted.Tensor."""
    prop = DTensor._op_dispatcher.sharding_propagator

    def s(shape, placements):
        stride = tuple(torch.empty(shape).stride())
        return DTensorSpec(fake_mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))

    schema = OpSchema(aten.searchsorted.Tensor, (s((3,), (Replicate(),)), s((8, 4), (Shard(0),))), {})
    with pytest.raises(NotImplementedError):
        prop.propagate_op_sharding(schema)


def test_unsupported_op_names_op_node_source_and_placements(fake_mesh):
    model = Bucketize()
    step = ddp(fake_mesh)
    with pytest.raises(spmd.UnsupportedOpError) as info:
        step(model, sgd(model), torch.randn(2, 16))
    assert isinstance(info.value, spmd.SpmdError)
    msg = str(info.value)

    assert "searchsorted" in msg
    assert re.search(r"aten\.searchsorted\.Tensor", msg), msg
    # The graph node.
    assert re.search(r"node:\s+searchsorted\w*", msg), msg
    # The user's source line: this file, the line number and the text of the call in forward().
    lines, first = inspect.getsourcelines(Bucketize.forward)
    offset = next(i for i, line in enumerate(lines) if "torch.searchsorted" in line)
    assert os.path.basename(__file__) in msg, msg
    assert f"line {first + offset}" in msg, msg
    assert "bins = torch.searchsorted(self.edges, h.detach())" in msg, msg
    # The input placements: the replicated buffer and the batch-sharded activations.
    assert "Replicate()" in msg and "Shard(dim=0)" in msg, msg
    # And what to do.
    assert "fix" in msg.lower()


def test_two_modules_rejected(fake_mesh):
    def step(model, other, optimizer, x):
        loss = (model(x) + other(x)).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    a, b = MLP(), MLP()
    compiled = ddp(fake_mesh, step)
    with pytest.raises(spmd.SpmdError) as info:
        compiled(a, b, torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), torch.randn(2, 16))
    assert isinstance(info.value, spmd.TraceError)
    assert "exactly one nn.Module" in str(info.value)
    assert "found 2" in str(info.value)
    _assert_suggested_module_dict_builds(str(info.value))


def _assert_suggested_module_dict_builds(msg):
    """The fix's ``nn.ModuleDict(...)`` is code a user pastes: it must run."""
    suggested = re.search(r"nn\.ModuleDict\(\{[^}]*\}\)", msg).group(0)
    built = eval(suggested, {"nn": torch.nn, "G": torch.nn.Linear(1, 1), "D": torch.nn.Linear(1, 1)})
    assert set(built.keys()) == {"G", "D"}


def test_two_optimizers_rejected(fake_mesh):
    def step(model, opt1, opt2, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt1.step()
        opt2.step()
        return loss

    model = MLP()
    compiled = ddp(fake_mesh, step)
    with pytest.raises(spmd.SpmdError) as info:
        compiled(model, torch.optim.SGD(model.fc1.parameters(), lr=0.1), torch.optim.SGD(model.fc2.parameters(), lr=0.1),
                 torch.randn(2, 16))
    assert isinstance(info.value, spmd.TraceError)
    msg = str(info.value)
    assert "at most one torch.optim.Optimizer" in msg
    assert "found 2 optimizers" in msg
    assert "one compiled step per optimizer" in msg and "d_step(gan, opt_d, real, z)" in msg
    _assert_suggested_module_dict_builds(msg)


def test_no_module_rejected(fake_mesh):
    def step(x):
        return x * 2

    with pytest.raises(spmd.TraceError, match="exactly one nn.Module"):
        ddp(fake_mesh, step)(torch.randn(2, 16))


def test_data_dependent_control_flow(fake_mesh):
    model = Branchy()
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh)(model, sgd(model), torch.randn(2, 16))
    msg = str(info.value)
    assert "data-dependent" in msg, msg
    assert "torch.where" in msg, msg


@pytest.mark.parametrize(
    "make, fix",
    [
        # RAdam's and ASGD's default paths branch on their step count / mu; Adafactor has no other path.
        (lambda ps: torch.optim.RAdam(ps, lr=1e-3), "capturable=True"),
        (lambda ps: torch.optim.ASGD(ps, lr=1e-2, foreach=True), "capturable=True"),
        (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "use an optimizer whose default path"),
        # Adamax's foreach path hands _foreach_addcdiv_ a list of tensors (no overload takes one).
        (lambda ps: torch.optim.Adamax(ps, lr=1e-3, foreach=True), "foreach=False"),
        # A differentiable step writes the parameters in place with autograd recording (not foreach's fault).
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, differentiable=True), "with differentiable=False"),
    ],
    ids=["radam", "asgd", "adafactor", "adamax_foreach", "adam_differentiable"],
)
def test_untraceable_optimizer_path_names_the_optimizer_and_the_fix(fake_mesh, make, fix):
    model = MLP()
    optimizer = make(model.parameters())
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh)(model, optimizer, torch.randn(4, 16))
    msg = str(info.value)
    assert f"{type(optimizer).__name__}.step()" in msg and fix in msg, msg
    if fix == "capturable=True":
        assert "Adafactor" not in msg


def test_a_data_dependent_optimizer_path_is_not_offered_as_its_own_fix(fake_mesh):
    """Rprop's single-tensor path writes through a boolean mask, which a 0-d parameter (a learnable
    temperature) turns into a data-dependent op: the fix lists other optimizers, not Rprop itself."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.fc(x) * self.scale

    model = Scaled()
    optimizer = torch.optim.Rprop(model.parameters(), lr=1e-2, foreach=False)
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh)(model, optimizer, torch.randn(4, 16))
    msg = str(info.value)
    assert "Rprop.step()" in msg and "use an optimizer whose default path" in msg, msg
    assert "NAdam, Adamax with foreach=False" in msg and "Rprop," not in msg.split("fix:")[-1], msg


class EmbeddingSum(nn.Module):
    """``nn.Embedding(20, 8, **options)`` whose looked-up vectors are summed (a scalar loss)."""

    def __init__(self, **options):
        super().__init__()
        self.emb = nn.Embedding(20, 8, **options)

    def forward(self, ids):
        return self.emb(ids).sum()


def test_embedding_max_norm_is_refused_not_lost(fake_mesh):
    """F.embedding renormalizes the value it is handed for the weight: the write would miss the parameter."""
    model = EmbeddingSum(max_norm=1.0)
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, _model_loss_step)(model, sgd(model), torch.randint(0, 20, (4, 3)))
    msg = str(info.value)
    assert "embedding_renorm_" in msg and "'emb.weight'" in msg and "torch.embedding_renorm_(emb.weight" in msg, msg


def test_sparse_embedding_gradients_are_refused_naming_the_module(fake_mesh):
    """nn.Embedding(sparse=True) + SparseAdam: the traced gradient is dense, so SparseAdam would fail
    inside the trace with its own error; the refusal names the module and the fix before the model is
    converted (its parameters stay plain tensors)."""
    model = EmbeddingSum(sparse=True)
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=1e-2)
    with pytest.raises(spmd.PlanError) as info:
        ddp(fake_mesh, _model_loss_step)(model, optimizer, torch.randint(0, 20, (4, 3)))
    msg = str(info.value)
    assert "Embedding emb has sparse=True" in msg and "sparse=False" in msg, msg
    assert not optimizer.state and not isinstance(model.emb.weight, DTensor)
    with pytest.raises(spmd.PlanError, match="Embedding emb has sparse=True"):
        spmd.parallelize(model, fake_mesh, spmd.DDP())


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda x: x.to_sparse(), "has layout torch.sparse_coo"),
        (lambda x: x.to_sparse_csr(), "has layout torch.sparse_csr"),
        (lambda x: torch.nested.nested_tensor(list(x), layout=torch.jagged), "is a nested tensor (layout torch.jagged)"),
    ],
    ids=["sparse_coo", "sparse_csr", "nested_jagged"],
)
def test_a_batch_tensor_that_is_not_dense_is_refused(fake_mesh, make, what):
    """A GCN's sparse adjacency or a nested batch: DTensor places dense tensors only. The batch check
    names the argument and the fix (its raw errors came from ``contiguous()`` or ``shape`` before)."""
    model = MLP()
    with pytest.raises(spmd.BatchError) as info:
        ddp(fake_mesh)(model, sgd(model), make(torch.randn(4, 16)), torch.randn(4, 16))
    msg = str(info.value)
    assert msg.startswith(f"not dense: tensor argument 0 {what}"), msg
    assert ("`t.to_padded_tensor(0.0)`" if "nested" in what else "`t.to_dense()`") in msg


def test_a_write_to_a_tensor_argument_another_one_shares_is_refused(fake_mesh):
    """``step(model, opt, x, x)`` where the step writes ``x`` in place: the graph takes the two as
    inputs of their own, so the second did not see the write (one device's does): a 2-rank run gave
    losses 0.1026 / 0.0014 where one device had 0.1281 / 0.0356, on the first call too when it was the
    one that shared. Refused before anything runs, naming both arguments; a copy runs, and so does a
    step that only reads them (an autoencoder's ``x, x``; a language model's overlapping views)."""

    def scale_then_fit(model, optimizer, x, y):
        x.mul_(2.0)
        loss = model(x).pow(2).mean() + model(y).mean()
        loss.backward()
        optimizer.step()
        return loss

    model, x = MLP(), torch.randn(4, 16)
    step = ddp(fake_mesh, scale_then_fit)
    with pytest.raises(spmd.BatchError) as info:  # the first call shares
        step(model, sgd(model), x, x)
    msg = str(info.value)
    assert "tensor arguments 0 (x) and 1 (y) of the step share memory" in msg and "writes argument 0 (x)" in msg, msg
    assert "`x, x.clone()`" in msg, msg
    assert torch.isfinite(step(model, sgd(model), x, x.clone()))
    with pytest.raises(spmd.BatchError, match="share memory"):  # a later call shares: same graph, refused too
        step(model, sgd(model), x, x.view(4, 16))
    data = torch.randn(4, 17)
    with pytest.raises(spmd.BatchError, match=r"arguments 0 \(x\) and 1 \(y\)"):  # overlapping views
        step(model, sgd(model), data[:, :-1], data[:, 1:])
    assert torch.isfinite(ddp(fake_mesh)(model, sgd(model), x, x))  # mse_step only reads them


def test_a_sparse_buffer_is_refused_naming_it(fake_mesh):
    class Propagate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("adj", (torch.eye(4) + 0.5).to_sparse())

        def forward(self, x):
            return torch.sparse.mm(self.adj, self.fc(x))

    model = Propagate()
    with pytest.raises(spmd.PlanError, match=r"buffer 'adj' of Propagate has layout torch.sparse_coo.*`t.to_dense\(\)`"):
        ddp(fake_mesh)(model, sgd(model), torch.randn(4, 4), torch.randn(4, 4))
    assert not isinstance(model.fc.weight, DTensor)  # refused before the model was converted


class SequenceFirstTagger(nn.Module):
    """``body`` (batch_first=False) on ``(seq, batch, 16)`` inputs, every step classified into 4."""

    def __init__(self, body):
        super().__init__()
        self.body, self.out = body, nn.Linear(16, 4)

    def forward(self, x):
        h = self.body(x)
        return self.out(h[0] if isinstance(h, tuple) else h)


@pytest.mark.parametrize(
    "body,module",
    [
        (lambda: nn.LSTM(16, 16), "'body'"),
        (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0), 1, enable_nested_tensor=False), "'body.layers.0.self_attn'"),
    ],
    ids=["lstm", "transformer_encoder"],
)
def test_a_data_parallel_split_of_a_sequence_first_input_is_refused(fake_mesh, body, module):
    """Sequence-first data (``(seq, batch)``, torch's default layout for these modules) with the default
    batch_dim=0 would join the ranks' sequences end to end: a different model input from one device's
    batch. Refused before anything runs, naming the module and the fix. (Before: the LSTM ran so, with
    only a warning about unbinding a split dim, and the Transformer's attention output failed a view in
    the local graph.) The same models with the batch on dim 1: tests/module_zoo_cases.py."""
    model = SequenceFirstTagger(body())
    with pytest.raises(spmd.PlanError) as info:
        ddp(fake_mesh, _tag)(model, sgd(model), torch.randn(6, 4, 16), torch.randint(0, 4, (6, 4)))
    msg = str(info.value)
    assert f"module {module} (batch_first=False)" in msg and "input placements: S(0)" in msg, msg
    assert "batch_dim=1" in msg and "x.transpose(0, 1)" in msg and "batch_first=True" in msg, msg


def test_a_sequence_first_input_sliced_from_the_batch_dim_is_refused(fake_mesh):
    """The word-language-model idiom ``inp, targets = data[:-1], data[1:]`` on sequence-first tokens
    ``(seq + 1, batch)`` with the default batch_dim=0: slicing the split dim gathers the batch, so the
    LSTM's input is no longer split and the check above saw nothing, while its sequences were the
    ranks' batches joined end to end (a 2-rank run trained on them, silently, where the user meant
    more samples). The module's input is computed from the batch and not split where the batch is:
    refused, naming the slice that gathered it."""
    model = SequenceFirstTagger(nn.LSTM(16, 16))

    def next_step(model, optimizer, data):
        inp, targets = data[:-1], data[1:, :, 0].long()
        loss = nn.functional.cross_entropy(model(inp).flatten(0, 1), targets.flatten() % 4)
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(spmd.PlanError) as info:
        ddp(fake_mesh, next_step)(model, sgd(model), torch.randn(6, 4, 16))
    msg = str(info.value)
    assert "module 'body' (batch_first=False)" in msg and "gathered by aten.slice.Tensor" in msg, msg
    assert "inp, targets = data[:-1]" in msg and "batch_dim=1" in msg and "outside the step" in msg, msg
    # The same step with the plan's batch_dim on the samples' dim compiles.
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(batch_dim=1), lower="eager")(next_step)
    assert torch.isfinite(step(model, sgd(model), torch.randn(6, 4, 16)))


def test_sequence_first_inputs_beside_per_sample_targets_name_the_batch_dim(fake_mesh):
    """Sequence-first inputs with one target per sample, batch_dim=0: the targets' split dim is the
    batch, the inputs' the sequence. The batch check or, where the sizes happen to agree,
    cross_entropy's size check while tracing fails; both fixes name batch_dim and the transpose (the
    trace's said "run it eagerly first", and the step runs eagerly)."""
    model = SequenceFirstTagger(nn.LSTM(16, 16))

    def classify(model, optimizer, x, y):
        loss = nn.functional.cross_entropy(model(x)[-1], y)
        loss.backward()
        optimizer.step()
        return loss

    step = ddp(fake_mesh, classify)
    with pytest.raises(spmd.BatchError) as info:  # 6 steps, 4 samples: the row counts differ on dim 0
        step(model, sgd(model), torch.randn(6, 4, 16), torch.randint(0, 4, (4,)))
    assert "sequence-first data" in str(info.value) and "batch_dim=1" in str(info.value), info.value
    with pytest.raises(spmd.TraceError) as info:  # 4 steps, 4 samples: only the trace sees it
        step(model, sgd(model), torch.randn(4, 4, 16), torch.randint(0, 4, (4,)))
    msg = str(info.value)
    assert "batch_size" in msg and "spmd.DDP(batch_dim=1)" in msg and "transpose" in msg, msg


class StepLoopRNN(nn.Module):
    """An RNN written as a Python loop over the steps of sequence-first input, indexing ``x[t]``
    (``select``) or iterating ``x.unbind(0)``."""

    def __init__(self, unbind: bool):
        super().__init__()
        self.unbind, self.w, self.u, self.out = unbind, nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h, outs = torch.zeros(x.size(1), 16), []
        for x_t in x.unbind(0) if self.unbind else (x[t] for t in range(x.size(0))):
            h = torch.tanh(self.w(x_t) + self.u(h))
            outs.append(self.out(h))
        return torch.stack(outs)


@pytest.mark.parametrize("unbind", [False, True], ids=["select", "unbind"])
def test_a_loop_over_a_split_dim_warns_and_names_batch_dim(fake_mesh, unbind):
    """A loop over dim 0 of sequence-first data with batch_dim=0: each step's rows are gathered from
    every rank (one device's values, no data-parallel speed-up, the ranks' sequences joined); the
    warning names the line and, for data whose dim 0 is not the samples', batch_dim. ``x[t]`` had no
    warning before (``unbind`` had, without the batch_dim hint)."""
    model = StepLoopRNN(unbind)
    with pytest.warns(UserWarning, match=r"x\.unbind\(0\)|x\[t\]") as record:
        ddp(fake_mesh, _tag)(model, sgd(model), torch.randn(3, 4, 16), torch.randint(0, 4, (3, 4)))
    messages = [str(w.message) for w in record if "which the plan splits across ranks" in str(w.message)]
    assert messages and ("unbinds" if unbind else "selects one index of") in messages[0], messages
    assert "set the plan's batch_dim" in messages[0], messages[0]


class PackedLSTM(nn.Module):
    """An LSTM over a padded batch packed by its lengths (``pack_padded_sequence``)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.out(self.rnn(packed)[1][0][-1])


def test_a_packed_sequence_names_the_padded_alternative(fake_mesh):
    """PackedSequence's batch sizes are a tensor the RNN reads as Python ints: the trace fails inside
    nn.LSTM; the fix said "run it eagerly on one device first" (it does), now it names the cause and
    the padded form."""
    model = PackedLSTM()

    def step(model, optimizer, x, lengths, y):
        loss = nn.functional.cross_entropy(model(x, lengths), y)
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(4, 5, 8), torch.tensor([5, 3, 2, 4]), torch.randint(0, 4, (4,)))
    msg = str(info.value)
    assert "PackedSequence" in msg and "lengths - 1" in msg and "runs eagerly" not in msg, msg


def _tag(model, optimizer, x, y):
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return loss


def test_returning_python_number_is_a_trace_error(fake_mesh):
    def step(model, optimizer, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return 1.5 * 2, loss

    model = MLP()
    with pytest.raises(spmd.TraceError, match="returned a float"):
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(2, 16))


def test_plan_keys_must_match_mesh_dim_names(fake_mesh):
    named = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = MLP()
    step = spmd.compile(mesh=named, plan={"tp": spmd.DDP()}, lower="eager")(mse_step)
    with pytest.raises(spmd.PlanError) as info:
        step(model, sgd(model), torch.randn(2, 16))
    msg = str(info.value)
    assert "tp" in msg and "dp" in msg, msg


def test_plan_dict_on_unnamed_mesh(fake_mesh):
    model = MLP()
    step = spmd.compile(mesh=fake_mesh, plan={"dp": spmd.DDP()}, lower="eager")(mse_step)
    with pytest.raises(spmd.PlanError):
        step(model, sgd(model), torch.randn(2, 16))


def test_plan_of_wrong_type(fake_mesh):
    model = MLP()
    step = spmd.compile(mesh=fake_mesh, plan="ddp", lower="eager")(mse_step)
    with pytest.raises(spmd.PlanError):
        step(model, sgd(model), torch.randn(2, 16))


def test_bogus_lowering(fake_mesh):
    with pytest.raises(spmd.SpmdError, match="bogus"):
        spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="bogus")(mse_step)


def test_ignored_module_not_in_model(fake_mesh):
    model = MLP()
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(ignored_modules=(nn.Linear(2, 2),)), lower="eager")(mse_step)
    with pytest.raises(spmd.PlanError):
        step(model, sgd(model), torch.randn(2, 16))


# ---------------------------------------------------------------------------------------------- errors inside the step


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(model, x):
    return model(x).square().mean()


def _item_step(model, optimizer, x):
    loss = _loss(model, x)
    scale = loss.item()  # reads the value into Python
    (loss * scale).backward()
    optimizer.step()
    return loss


def _tolist_step(model, optimizer, x):
    out = model(x)
    first = out.sum(1).tolist()[0]  # reads values into Python
    loss = out.square().mean() * first
    loss.backward()
    optimizer.step()
    return loss


def _tensor_index_step(model, optimizer, x):
    out = model(x)
    hardest = out.square().sum(1).argmax()
    loss = out.square().mean() + out[hardest].sum()  # a 0-d tensor used as an index
    loss.backward()
    optimizer.step()
    return loss


def _mask_step(model, optimizer, x):
    out = model(x)
    loss = out[out > 0].sum()  # a shape known only at run time
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("step_fn, line", [(_item_step, "scale = loss.item()"), (_tolist_step, "first = out.sum(1).tolist()[0]")])
def test_reading_a_value_into_python_names_the_line(fake_mesh, step_fn, line):
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="reads a tensor's value into Python") as info:
        ddp(fake_mesh, step_fn)(model, sgd(model), torch.randn(4, 8))
    assert line in str(info.value) and "test_errors.py" in str(info.value)


def test_indexing_with_a_tensor_value_says_what_fixes_it(fake_mesh):
    """``x[t]`` with a 0-d tensor reads ``t`` into Python as an int: the fix is an index op, not a branch."""
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="uses it as an int") as info:
        ddp(fake_mesh, _tensor_index_step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    assert "out[hardest].sum()" in msg and "index_select" in msg and "torch.where" not in msg, msg


def test_value_dependent_shape_says_what_fixes_it(fake_mesh):
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="depends on tensor values") as info:
        ddp(fake_mesh, _mask_step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    assert "loss = out[out > 0].sum()" in msg and "torch.where" in msg and "choose a plan" not in msg


def _class_count_step(model, optimizer, x):
    out = model(x)
    counts = torch.bincount(out.argmax(-1), minlength=4)  # class frequencies for a reweighted loss
    loss = (out.square().mean(0) / (counts + 1)).sum()
    loss.backward()
    optimizer.step()
    return loss


def test_bincount_names_its_static_shape_form(fake_mesh):
    """bincount's length is its largest value + 1 (``minlength`` only a lower bound): the fix is a count
    with a static shape, not the boolean-mask advice."""
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="depends on tensor values") as info:
        ddp(fake_mesh, _class_count_step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    assert "aten.bincount" in msg and "F.one_hot(y, num_classes).sum(0)" in msg and "index_add_" in msg, msg
    assert "out[out > 0]" not in msg


def _all_reduce_step(model, optimizer, x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    torch.distributed.all_reduce(logged)  # a DDP script's logging, carried into the step
    return logged / torch.distributed.get_world_size()


def _functional_all_reduce_step(model, optimizer, x):
    import torch.distributed._functional_collectives as funcol

    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return funcol.all_reduce(loss.detach(), "sum", list(range(torch.distributed.get_world_size())))


@pytest.mark.parametrize(
    "step_fn, line",
    [(_all_reduce_step, "torch.distributed.all_reduce(logged)"), (_functional_all_reduce_step, "return funcol.all_reduce(")],
)
def test_a_collective_the_step_calls_itself_is_refused_at_its_line(fake_mesh, step_fn, line):
    """On one device the step's values already cover the global batch: a collective of its own would
    reduce them again. (c10d's fake kernel draws from Python's random: not the error to give.)"""
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="the step calls a collective itself") as info:
        ddp(fake_mesh, step_fn)(model, sgd(model), torch.randn(4, 8))
    assert line in str(info.value) and "remove the torch.distributed call" in str(info.value)


def test_optimizer_parameter_outside_the_model(fake_mesh):
    model = _mlp()
    stray = nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(spmd.PlanError, match=r"param_groups\[0\]\['params'\]\[4\] \(shape \[3\]"):
        ddp(fake_mesh, _item_step)(model, optimizer, torch.randn(4, 8))


def test_a_lazy_module_not_yet_run_names_the_parameter_and_the_fix(fake_mesh):
    """nn.LazyLinear has no weight shape before its first call: a PlanError, not torch's error from
    reading that shape while placing it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LazyLinear(4))
    with pytest.raises(spmd.PlanError, match=r"parameter '2.weight' of Sequential is uninitialized") as info:
        ddp(fake_mesh, _item_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8))
    assert "run the model once on one batch" in str(info.value)


NORMALIZATION = (torch.zeros(8), torch.ones(8))  # tensors in a global tuple, not the model's


def _global_tensor_step(model, optimizer, x, y):
    x = (x - NORMALIZATION[0]) / NORMALIZATION[1]  # reads tensors in a tuple
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def test_a_tensor_from_outside_the_step_names_the_line_and_the_fix(fake_mesh):
    """A tensor held where the step's inputs are not read from (in a global tuple) would be baked into
    the graph (never updated): refused, with register_buffer as the fix."""
    model = _mlp()
    with pytest.raises(spmd.TraceError, match="computes with a tensor it was not handed") as info:
        ddp(fake_mesh, _global_tensor_step)(model, sgd(model), torch.randn(4, 8), torch.randint(0, 4, (4,)))
    msg = str(info.value)
    assert "x = (x - NORMALIZATION[0])" in msg and "test_errors.py" in msg and "register_buffer" in msg, msg


def test_ema_update_in_the_step_is_not_blamed_on_the_optimizer(fake_mesh):
    """torch.optim.swa_utils is torch.optim code but not Optimizer.step(): the error names the user's line."""
    model = _mlp()
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))

    def step(model, optimizer, x):
        loss = _loss(model, x)
        loss.backward()
        optimizer.step()
        ema.update_parameters(model)  # the EMA copy's tensors are not inputs of the step
        return loss

    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    # (Its count n_averaged, a buffer of a module held in a closure variable, is a graph input: the
    # trace gets as far as the count's branch.)
    assert "SGD.step()" not in msg and "ema.update_parameters(model)" in msg, msg
    # The fix names the branch and the two ways out (was torch's generic "reads a tensor's value").
    assert "n_averaged" in msg and "after the compiled step" in msg and "lerp_" in msg, msg


def test_grad_scaler_names_the_scaler_and_the_fix(fake_mesh):
    """GradScaler.step() branches on found_inf: the error says where (torch's grad_scaler) and what to do."""
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu")

    def step(model, optimizer, x):
        loss = _loss(model, x)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # reads found_inf to decide whether to step
        scaler.update()
        return loss

    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    assert "scaler.step(optimizer)" in msg and "grad_scaler.py" in msg and "bfloat16" in msg, msg


def test_clip_grad_norm_error_if_nonfinite_names_the_option(fake_mesh):
    """clip_grad_norm_(error_if_nonfinite=True) raises on an inf/NaN norm, a branch on its value: the
    error names the call and the option to drop."""
    model = _mlp()

    def step(model, optimizer, x):
        loss = _loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        optimizer.step()
        return loss

    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(4, 8))
    msg = str(info.value)
    assert "clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)" in msg, msg
    assert "pass error_if_nonfinite=False" in msg, msg


class _Gaussian(nn.Module):
    """A VAE's encoder: a ``torch.distributions.Normal`` built in forward (it validates by default)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        mu, logvar = self.fc(x).chunk(2, -1)
        # validate_args explicitly: the first torch.compile in a process turns the default off
        # (torch/_dynamo/eval_frame.py), so this test would depend on which tests ran before it.
        q = torch.distributions.Normal(mu, (0.5 * logvar).exp(), validate_args=True)
        return q.rsample().square().mean()


def _model_loss_step(model, optimizer, x):
    loss = model(x)
    loss.backward()
    optimizer.step()
    return loss


def _gaussian_nll_step(model, optimizer, x):
    out = model(x)
    loss = nn.GaussianNLLLoss()(out[:, 0], x[:, 0], out[:, 1].exp())
    loss.backward()
    optimizer.step()
    return loss


def _ctc_step(model, optimizer, x):
    log_probs = model(x).log_softmax(-1).unsqueeze(0).expand(5, -1, -1)  # T=5, B, C=4
    targets = torch.ones(x.shape[0], 2, dtype=torch.long)
    loss = nn.functional.ctc_loss(log_probs, targets, [5] * x.shape[0], [2] * x.shape[0])
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize(
    "model, step_fn, fix",
    [
        (_Gaussian, _model_loss_step, "validate_args=False"),
        (_mlp, _gaussian_nll_step, "inside torch/nn/functional.py in gaussian_nll_loss reads a tensor's value"),
        (_mlp, _ctc_step, "output shape of aten._ctc_loss.default depends on the values"),
    ],
    ids=["distribution_validates_args", "gaussian_nll_checks_var", "ctc_loss_output_shape"],
)
def test_a_check_inside_torch_names_the_torch_function_and_the_fix(fake_mesh, model, step_fn, fix):
    """Failures inside torch's code get their own fix, not the generic one for the user's branches."""
    model = model()
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, step_fn)(model, sgd(model), torch.randn(4, 8))
    assert fix in str(info.value) and "make sure the step runs eagerly" not in str(info.value), str(info.value)


def _python_random_step(model, optimizer, x):
    flip = random.random() < 0.5  # drawn once, when traced
    loss = _loss(model, x.flip(-1) if flip else x)
    loss.backward()
    optimizer.step()
    return loss


def test_a_python_random_draw_is_refused_and_the_random_state_kept(fake_mesh):
    """``random.random()`` in the step would choose once for every call; the refused call draws nothing."""
    model = _mlp()
    random.seed(7)
    state = random.getstate()
    with pytest.raises(spmd.TraceError, match=r"random\.random\(\) at .*test_errors\.py:\d+ in _python_random_step") as info:
        ddp(fake_mesh, _python_random_step)(model, sgd(model), torch.randn(4, 8))
    assert "torch.rand" in str(info.value)
    assert random.getstate() == state


def test_huggingface_specaugment_masks_drawn_with_numpy_are_refused(fake_mesh):
    """wav2vec2 masks time steps with ``np.random`` in training (mask_time_prob > 0): those masks would
    be the same at every step."""
    import hf_zoo

    config = hf_zoo._wav2vec2("eager")
    config.mask_time_prob, config.mask_time_length = 0.5, 2
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    x, y = hf_zoo.audio_batch(torch.Generator().manual_seed(0))
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(hf_zoo.audio_step)
    with pytest.raises(spmd.TraceError, match=r"numpy\.random\.\w+\(\) at .*modeling_wav2vec2\.py:\d+ in _compute_mask_indices") as info:
        step(model, sgd(model), x[:2], y[:2])
    assert "mask_time_prob=0.0" in str(info.value)


class _Jitter(nn.Module):
    """Scales its input by a factor drawn from a generator object it holds (``rng``), or by a warm-up
    factor on its first call, counted by an iterator it holds (``calls``)."""

    def __init__(self, rng=None, calls=None):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.rng, self.calls = rng, calls

    def forward(self, x):
        if self.rng is not None:
            x = x * float(self.rng.uniform(0.5, 1.5))
        if self.calls is not None and next(self.calls) == 0:
            x = x * 0.1
        return self.linear(x)


def _jitter_step(model, optimizer, x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("rng", ["numpy_generator", "numpy_random_state", "python_random"])
def test_a_draw_from_a_random_generator_object_is_refused_and_the_generator_kept(fake_mesh, rng):
    """A generator object's draw (numpy's ``default_rng()``, ``RandomState``, ``random.Random()``) would
    be made once, when traced: every call would scale by the same factor (measured on 2 gloo ranks
    before the refusal: losses equal one device's on the first call only, with no error)."""
    import numpy as np

    make = {"numpy_generator": np.random.default_rng, "numpy_random_state": np.random.RandomState,
            "python_random": random.Random}[rng]
    generator = make(3)
    torch.manual_seed(0)
    model = _Jitter(rng=generator)
    with pytest.raises(spmd.TraceError, match=r"draws random numbers from model\.rng \(a (numpy\.random\.Generator|numpy\.random\.RandomState|random\.Random)\)") as info:
        ddp(fake_mesh, _jitter_step)(model, sgd(model), torch.randn(4, 8))
    assert "torch.rand" in str(info.value)
    assert generator.uniform(0.5, 1.5) == make(3).uniform(0.5, 1.5)  # put back: the first draw of its seed


def test_an_iterator_advanced_in_the_step_is_refused(fake_mesh):
    """``next(self.calls)`` of an ``itertools.count()`` would run once, when traced: every call would take
    the first call's warm-up branch (measured before the refusal: losses equal one device's on the
    first call only). An iterator cannot be rewound; the error says so."""
    import itertools

    torch.manual_seed(0)
    model = _Jitter(calls=itertools.count())
    with pytest.raises(spmd.TraceError, match=r"advances model\.calls \(a itertools\.count\)") as info:
        ddp(fake_mesh, _jitter_step)(model, sgd(model), torch.randn(4, 8))
    assert "cannot be rewound" in str(info.value) and "self.calls += 1" in str(info.value)


def test_a_generator_object_the_step_does_not_use_is_no_reason_to_refuse(fake_mesh):
    """Held but not drawn from (e.g. used by the data pipeline outside the step): the step compiles."""
    import numpy as np

    torch.manual_seed(0)
    model = _Jitter()
    model.data_rng, model.order = np.random.default_rng(0), iter([3, 1, 2])
    ddp(fake_mesh, _jitter_step)(model, sgd(model), torch.randn(4, 8))
    assert next(model.order) == 3


def _seeding_step(model, optimizer, x):
    torch.manual_seed(1234)  # runs once, when traced
    loss = _loss(model, nn.functional.dropout(x, 0.5))
    loss.backward()
    optimizer.step()
    return loss


def test_seeding_torch_inside_the_step_is_refused_and_the_generator_kept(fake_mesh):
    """Eager reseeds every step; a compiled step would seed once (measured on 2 gloo ranks: step 1
    matched one device, steps 2 and 3 did not, with no error)."""
    model = _mlp()
    torch.manual_seed(5)
    with pytest.raises(spmd.TraceError, match=r"torch\.(random\.)?manual_seed\(\) at .*test_errors\.py:\d+ in _seeding_step") as info:
        ddp(fake_mesh, _seeding_step)(model, sgd(model), torch.randn(4, 8))
    assert "seed before calling the compiled step" in str(info.value)
    assert torch.initial_seed() == 5  # the generator is as before the trace, not seeded with 1234


def test_calling_the_converted_model_outside_a_step_names_the_fix(fake_mesh):
    """An eager evaluation after training started (nanoGPT's estimate_loss) meets DTensor parameters:
    a PlanError naming the compiled evaluation step, not DTensor's mixed Tensor/DTensor error. Calls
    with DTensor inputs, and the step's own trace, are let through."""
    model = MLP()
    compiled = ddp(fake_mesh)
    compiled(model, sgd(model), torch.randn(8, 16), torch.randn(8, 16))
    with pytest.raises(spmd.PlanError) as info, torch.no_grad():
        model(torch.randn(2, 16))
    message = str(info.value)
    assert message.startswith("MLP was called outside a compiled step on plain tensors")
    assert "placements (Replicate(),)" in message
    assert "evaluate = spmd.compile(mesh=mesh, plan=plan)" in message
    with pytest.raises(spmd.PlanError, match=r"^Linear fc2 \(a submodule of MLP\) was called outside a compiled step"):
        model.fc2(torch.randn(2, 32))
    x = DTensor.from_local(torch.randn(2, 16), fake_mesh, [Replicate()])
    assert isinstance(model(x), DTensor)
    compiled(model, sgd(model), torch.randn(8, 16), torch.randn(8, 16))  # the hook does not stop the step


def test_an_attribute_set_on_a_parameter_names_where_to_keep_it(fake_mesh):
    """``p.lr_scale = 2.0`` set on parameters and read in the step: the trace runs on stand-in tensors
    without it. The fix said to run the step eagerly first (it does run eagerly); it names the
    attribute and where per-parameter settings go."""
    model = MLP()
    for p in model.parameters():
        p.lr_scale = 2.0

    def scaled(model, optimizer, x, y):
        loss = (model(x) - y).square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(p.lr_scale)
        optimizer.step()
        return loss

    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, scaled)(model, sgd(model), torch.randn(4, 16), torch.randn(4, 4))
    msg = str(info.value)
    assert "reads attribute 'lr_scale' of a tensor" in msg and "param groups" in msg, msg


def test_an_op_returning_a_python_value_and_an_op_without_a_fake_kernel_get_their_own_fix():
    """torch.cov over the batch (its argument check calls aten.equal) was told "the step branches on
    tensor values", and a Beta draw with batch-sized parameters (aten._sample_dirichlet, no fake
    kernel) "make sure the step runs eagerly first" (it does): both named the wrong cause."""
    from spmd_expand.trace import _trace_failure_hint

    cov = _trace_failure_hint("DataDependentOutputException", "aten.equal.default", True, "")
    assert cov.startswith("aten.equal.default returns a Python value computed from tensor values") and "torch.cov" in cov, cov
    draw = _trace_failure_hint("UnsupportedOperatorException", "aten._sample_dirichlet.default", False, "")
    assert "no fake-tensor (meta) implementation of aten._sample_dirichlet.default" in draw and "tensor argument" in draw, draw
    item = _trace_failure_hint("DataDependentOutputException", "aten._local_scalar_dense.default", True, "")
    assert item.startswith("the step branches on tensor values"), item


_SECOND_OPTIMIZER: list = []  # the generator's optimizer, reached through a global


def _two_updates(model, optimizer, x):
    """A GAN-shaped step: the optimizer argument updates ``a``, a global's second optimizer ``b``."""
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    _SECOND_OPTIMIZER[0].step()
    return loss


def test_a_second_optimizer_the_step_is_not_handed_is_refused(fake_mesh):
    """spmd.compile rebinds the optimizer the step is given to the DTensor parameters; another one (a
    GAN's generator optimizer in a global, or both inside a helper object) kept the replaced tensors,
    which get no gradient: its step updated nothing, silently (2 gloo ranks: the generator's bias moved
    0 where one device's moved 0.0031). Its step() is refused now, naming the fix."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    _SECOND_OPTIMIZER[:] = [torch.optim.SGD(model[2].parameters(), lr=0.1)]
    try:
        with pytest.raises(spmd.PlanError) as info:
            ddp(fake_mesh, _two_updates)(model, first, torch.randn(4, 16))
    finally:
        _SECOND_OPTIMIZER.clear()
    msg = str(info.value)
    assert msg.startswith("SGD.step(): param_groups[0]['params'][0] (shape [4, 8])") and "update nothing" in msg, msg
    assert "compile one step per optimizer" in msg, msg


def test_a_gradient_penalty_through_dot_grad_names_autograd_grad(fake_mesh):
    """``loss.backward(create_graph=True)`` and a penalty on ``p.grad`` differentiated again: refused
    (the gradient read is data to the compiled step) with torch's "no autograd formula" and the fix
    "run the step eagerly first" (it does); the fix names torch.autograd.grad, which is supported."""

    def penalized(model, optimizer, x, y):
        loss = (model(x) - y).square().mean()
        loss.backward(create_graph=True)
        penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
        penalty.backward()
        optimizer.step()
        return loss

    model = MLP()
    with pytest.raises(spmd.TraceError) as info:
        ddp(fake_mesh, penalized)(model, sgd(model), torch.randn(4, 16), torch.randn(4, 4))
    assert "torch.autograd.grad(loss, params, create_graph=True)" in str(info.value), info.value


def test_a_path_component_like_a_size_symbol_gets_no_batch_dim_hint():
    """The hint for a size mismatch looks for a shape symbol (``s53``); a directory named like one
    (``/runs/s52/``) in the message gave the batch_dim fix to an unrelated error."""
    from spmd_expand.trace import _trace_failure_hint

    unrelated = _trace_failure_hint("AttributeError", "File /home/u/runs/s52/model.py: 'FakeTensor' object has no attribute 'x'", False, "")
    assert "batch_dim" not in unrelated, unrelated
    mismatch = _trace_failure_hint("RuntimeError", "The size of tensor a (s53) must match the size of tensor b (4)", False, "")
    assert "traced as the symbol s53" in mismatch and "batch_dim" in mismatch, mismatch


class _SequenceParallelNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(11, 8), nn.LayerNorm(8)
        self.fc1, self.fc2, self.head = nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 11)

    def forward(self, idx):
        return self.head(self.norm(self.fc2(nn.functional.relu(self.fc1(self.emb(idx))))))


def test_an_uneven_sequence_parallel_split_names_the_redistribution_and_the_fix(fake_mesh):
    """Sequence parallelism over 4 ranks with a sequence of 5 tokens: the Linears' flatten of the
    sequence-sharded activation makes a _StridedShard that DTensor redistributes unevenly only from
    values; the PlacementError names it (was fake tensor's DataDependentOutputException)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = spmd.TensorParallel({
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    torch.manual_seed(0)
    model = _SequenceParallelNet()
    step = spmd.compile(mesh=fake_mesh, plan=plan, lower="eager")(_tag)  # next-token cross entropy
    idx = torch.randint(0, 11, (2, 5))
    with pytest.raises(spmd.PlacementError, match=r"DTensor cannot redistribute \w+ of shape .* from \(_StridedShard") as info:
        step(model, sgd(model), idx, idx)
    assert "sequence length by the tensor-parallel degree" in str(info.value) and "test_errors.py" in str(info.value)


def _accumulate(model, optimizer, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss


def test_fsdp_mixed_precision_gradient_added_to_an_unsynced_one_names_the_fix(fake_mesh):
    """FSDP with a mixed-precision policy reduce-scatters a gradient inside backward; added to a gradient
    accumulated under no_sync (still partial), DTensor has no Shard -> Partial redistribution: a
    PlacementError naming the fix (was DTensor's RuntimeError)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
    optimizer = sgd(model)
    plan = spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    accumulate = spmd.compile(mesh=fake_mesh, plan=plan, lower="eager")(_accumulate)
    update = spmd.compile(mesh=fake_mesh, plan=plan, lower="eager")(mse_step)
    x = torch.randn(4, 8)
    with accumulate.no_sync():
        accumulate(model, optimizer, x)
    with pytest.raises(spmd.PlacementError, match=r"from \(Shard\(dim=0\),\) to \(Partial\(sum\),\)") as info:
        update(model, optimizer, x)
    assert "with gradient sync on, or without mp_policy" in str(info.value)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_training_step_called_with_gradients_off_is_refused(fake_mesh, context):
    """One device's loss.backward() raises under no_grad (the loss has no grad_fn); the compiled graph,
    traced with gradients on, trained silently. Refused before it runs, on a new graph and on the fast
    path alike; the parameters are untouched."""
    model = MLP()
    optimizer = sgd(model)
    step = ddp(fake_mesh)
    x = torch.randn(4, 16)
    for _ in range(2):  # the first call compiles; the second reuses the graph
        with context():
            with pytest.raises(spmd.TraceError, match=r"computes gradients \(at File .*\) but is called with gradient computation off"):
                step(model, optimizer, x)
    step(model, optimizer, x)  # with gradients on it trains
    before = [p.detach().to_local().clone() for p in model.parameters()]
    with torch.no_grad(), pytest.raises(spmd.TraceError):
        step(model, optimizer, x)
    assert all(torch.equal(p.detach().to_local(), b) for p, b in zip(model.parameters(), before))


class _StackedLSTM(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.rnn, self.out = nn.LSTM(8, 8, num_layers=2, dropout=dropout, batch_first=True), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


def test_dropout_between_rnn_layers_in_train_mode_is_refused(fake_mesh):
    """torch's RNN decomposition (which the trace records) applies no dropout between layers, where
    one device's kernel does: trained silently without it (hunt on torch's word_language_model:
    losses 0.0055-0.039 off). Refused in train mode with the fix; in eval mode, or without dropout,
    it compiles."""
    x = torch.randn(4, 5, 8)
    model = _StackedLSTM(dropout=0.5)
    with pytest.raises(spmd.TraceError, match=r"runs a 2-layer LSTM with dropout=0.5 between its layers in train mode") as info:
        ddp(fake_mesh)(model, sgd(model), x)
    assert "test_errors.py" in str(info.value) and "nn.LSTM(num_layers=1) per layer" in str(info.value)
    model.eval()
    ddp(fake_mesh)(model, sgd(model), x)
    model = _StackedLSTM(dropout=0.0)
    ddp(fake_mesh)(model, sgd(model), x)


class _PositionalEncoding(nn.Module):
    """torch's word_language_model: ``pe.unsqueeze(0).transpose(0, 1)``, a buffer of shape
    (max_len, 1, d) whose strides are not its contiguous form's (it counts as contiguous)."""

    def __init__(self, d: int = 8, max_len: int = 16):
        super().__init__()
        pe = torch.arange(max_len * d, dtype=torch.float32).view(max_len, d) / 100
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))
        self.fc = nn.Linear(d, d)

    def forward(self, x):  # (seq, batch, d)
        return self.fc(x + self.pe[: x.size(0)])


def test_a_buffer_with_size_one_strides_is_distributed(fake_mesh):
    """Broadcasting the buffer on the first call gave back a view of itself, and copy_ refused the
    overlap with a raw RuntimeError (hunt on torch's examples); its values stay as they were."""
    model = _PositionalEncoding()
    expected = model.pe.clone()
    spmd.compile(mesh=fake_mesh, plan=spmd.DDP(batch_dim=1), lower="eager")(mse_step)(model, sgd(model), torch.randn(5, 4, 8))
    assert torch.equal(model.pe, expected)


def test_a_causal_mask_passed_without_is_causal_names_is_causal(fake_mesh):
    """torch's word_language_model passes generate_square_subsequent_mask without is_causal; the encoder
    then reads the mask's values to detect causality: the fix names is_causal=True."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(5)

    def step(model, optimizer, x):
        loss = model(x, mask=mask).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(spmd.TraceError, match="pass is_causal=True along with the mask"):
        ddp(fake_mesh, step)(model, sgd(model), torch.randn(4, 5, 8))
