"""The per-call fast path never runs a stale graph.

After a full call, ``CompiledStep`` binds the call's graph to a :class:`spmd_expand.guards.Snapshot`
of the model and optimizer and, while later snapshots are equal, skips re-deriving the cache key and
input roles. These tests change, between calls, every kind of state the README's table says the graph
depends on and check that the snapshot sees it (and, end to end on the fake process group, that the
step compiles again), and that what is a graph input (learning rate, betas, values) does not.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import functools
import math
import os
import types
import warnings

import pytest
import numpy as np
import torch
import torch.nn as nn

import cases
import spmd_expand as spmd
from spmd_expand.guards import snapshot
from spmd_expand.trace import FloatArgument


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) * self.scale


def _pair():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _new_group(m, o):
    extra = nn.Parameter(torch.zeros(3))
    m.extra = extra
    o.add_param_group({"params": [extra]})


CHANGES = {
    "eval_submodule": lambda m, o: m.fc1.eval(),
    "freeze": lambda m, o: m.fc2.weight.requires_grad_(False),
    "replace_parameter": lambda m, o: setattr(m.fc1, "bias", nn.Parameter(m.fc1.bias.detach().clone())),
    "parameter_data_new_shape": lambda m, o: setattr(m.fc1.bias, "data", torch.zeros(17)),
    "swap_activation": lambda m, o: setattr(m, "act", nn.ReLU()),
    "delete_submodule": lambda m, o: delattr(m, "act"),
    "add_buffer": lambda m, o: m.register_buffer("offset", torch.zeros(4)),
    "buffer_new_shape": lambda m, o: setattr(m.scale, "data", torch.ones(5)),
    "gradient_present": lambda m, o: setattr(m.fc1.weight, "grad", torch.zeros_like(m.fc1.weight)),
    "foreach_setting": lambda m, o: o.param_groups[0].__setitem__("foreach", True),
    "amsgrad_setting": lambda m, o: o.param_groups[0].__setitem__("amsgrad", True),
    "lr_becomes_tensor": lambda m, o: o.param_groups[0].__setitem__("lr", torch.tensor(0.01)),
    "new_param_group": _new_group,
    "group_member_removed": lambda m, o: o.param_groups[0]["params"].pop(),
    "state_cleared": lambda m, o: o.state[m.fc1.weight].clear(),
    "state_dropped": lambda m, o: o.state.pop(m.fc1.weight),
    "state_key_added": lambda m, o: o.state[m.fc1.weight].__setitem__("extra", None),
    "state_tensor_replaced": lambda m, o: o.state[m.fc1.weight].__setitem__("exp_avg", o.state[m.fc1.weight]["exp_avg"].clone()),
    "state_number_changed": lambda m, o: o.state[m.fc1.weight].__setitem__("step", 7),
    "optimizer_reloaded": lambda m, o: o.load_state_dict(o.state_dict()),
}

NOT_CHANGES = {
    "lr": lambda m, o: o.param_groups[0].__setitem__("lr", 0.5),
    "betas": lambda m, o: o.param_groups[0].__setitem__("betas", (0.8, 0.9)),
    "weight_decay": lambda m, o: o.param_groups[0].__setitem__("weight_decay", 0.3),
    "parameter_values": lambda m, o: m.fc1.weight.data.mul_(2),
    "state_values": lambda m, o: o.state[m.fc1.weight]["exp_avg"].mul_(2),
    "train_again": lambda m, o: m.train(),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_snapshot_sees_change(name):
    model, optimizer = _pair()
    before = snapshot(model, optimizer)
    assert snapshot(model, optimizer).same_as(before)
    CHANGES[name](model, optimizer)
    assert not snapshot(model, optimizer).same_as(before), name


@pytest.mark.parametrize("name", sorted(NOT_CHANGES))
def test_snapshot_ignores_graph_inputs(name):
    model, optimizer = _pair()
    before = snapshot(model, optimizer)
    NOT_CHANGES[name](model, optimizer)
    assert snapshot(model, optimizer).same_as(before), name


def test_snapshot_compares_non_tensor_states_by_value():
    """A non-tensor optimizer state replaced by an equal new object is the same state; another value is not."""
    model, optimizer = _pair()
    state = optimizer.state[model.fc1.weight]
    state["count"] = float("1.5")
    before = snapshot(model, optimizer)
    state["count"] = float("1.5")
    assert state["count"] is not before.states[[k for st in optimizer.state.values() for k in st].index("count")]
    assert snapshot(model, optimizer).same_as(before)
    state["count"] = 2.5
    assert not snapshot(model, optimizer).same_as(before)


def _step(model, optimizer, x):
    return cases.update(model(x).square().mean(), optimizer)


def _compiled(fake_mesh, fn, model_class=Net):
    """A fresh seeded model, its AdamW, ``fn`` compiled for DDP on the fake mesh (eager lowering), and a batch."""
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(fn), torch.randn(2, 8)


def test_fast_path_recompiles_after_module_swap(fake_mesh):
    """A module without parameters swapped between calls (GELU -> ReLU) compiles a new graph, and the
    fast path then serves the new graph; ``lr`` changes do not compile."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_step)
    x = torch.randn(2, 8)
    graphs = []
    for i in range(6):
        if i == 3:
            model.act = nn.ReLU()
        optimizer.param_groups[0]["lr"] = 1e-2 / (i + 1)
        step(model, optimizer, x)
        graphs.append(step.last)
    assert graphs[0] is graphs[1] is graphs[2]
    assert graphs[3] is graphs[4] is graphs[5] and graphs[3] is not graphs[0]
    relu = [n for n in graphs[3].local_graph.graph.nodes if "relu" in str(n.target)]
    gelu = [n for n in graphs[0].local_graph.graph.nodes if "gelu" in str(n.target)]
    assert relu and gelu
    assert not any("gelu" in str(n.target) for n in graphs[3].local_graph.graph.nodes)
    del reference


def test_reset_compiles_again(fake_mesh):
    """``reset()`` drops the graphs the fast path would serve: the next call compiles a new one."""
    model, optimizer, step, x = _compiled(fake_mesh, _step)
    step(model, optimizer, x)
    first = step.last
    step(model, optimizer, x)
    assert step.last is first
    step.reset()
    step(model, optimizer, x)
    assert step.last is not first
    assert sum(len(v) for v in step.cache.values()) == 1


# ------------------------------------------------------------------ Python values the trace read

NEGATIVE_SLOPE = 0.1  # read by a helper the step calls, not by the step itself


def _leaky(h):
    return torch.nn.functional.leaky_relu(h, NEGATIVE_SLOPE)


def _helper_step(model, optimizer, x):
    loss = _leaky(model(x)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_float_global_read_by_a_called_function_is_a_graph_input(fake_mesh):
    """A float global read two calls deep (leaky_relu's slope) is a graph input, like a float
    argument: a new value runs the same graph with it, no compilation, no warning."""
    global NEGATIVE_SLOPE
    model, optimizer, step, x = _compiled(fake_mesh, _helper_step)
    try:
        step(model, optimizer, x)
        first = step.last
        slopes = [n.args[1] for n in first.traced.graph_module.graph.nodes if "leaky_relu" in str(n.target)]
        assert slopes and all(isinstance(s, torch.fx.Node) and s.op == "placeholder" for s in slopes), slopes
        assert "global NEGATIVE_SLOPE of test_guards" in [str(hp) for hp in first.traced.hyperparameters]
        NEGATIVE_SLOPE = 0.2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(model, optimizer, x)
        assert step.last is first
        assert NEGATIVE_SLOPE == 0.2  # the trace's stand-in is not left behind
        # Holding something else than a float, it is no input: the full path, a graph of its own.
        NEGATIVE_SLOPE = 1
        step(model, optimizer, x)
        assert step.last is not first
        assert 1 in [n.args[1] for n in step.last.traced.graph_module.graph.nodes if "leaky_relu" in str(n.target)]
    finally:
        NEGATIVE_SLOPE = 0.1


POWER = 2  # an int read by a helper: a constant of the graph, guarded


def _powered(h):
    return h.abs().pow(POWER)


def _int_helper_step(model, optimizer, x):
    loss = _powered(model(x)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_an_int_global_read_by_a_called_function_recompiles_with_a_warning(fake_mesh):
    """An int global read two calls deep is baked in (a constant of pow): a change compiles again and
    the warning names it; the old value's graph is reused when the value comes back."""
    global POWER
    model, optimizer, step, x = _compiled(fake_mesh, _int_helper_step)
    try:
        step(model, optimizer, x)
        first = step.last
        assert 2 in {n.args[1] for n in first.traced.graph_module.graph.nodes if "pow" in str(n.target)}
        POWER = 3
        with pytest.warns(UserWarning, match=r"global POWER of test_guards == 2 \(now 3\)") as record:
            step(model, optimizer, x)
        assert not any("float argument" in str(w.message) for w in record)  # not a fix for an int
        assert step.last is not first
        POWER = 2
        step(model, optimizer, x)
        assert step.last is first
    finally:
        POWER = 2


def test_module_attribute_reads_are_recorded_and_classes_restored(fake_mesh):
    """Only attributes forward reads are guarded (not a counter kept on the module); every module gets
    its own class back after tracing, also when tracing fails."""

    class Scaled(Net):
        def __init__(self):
            super().__init__()
            self.factor = 2  # an int: a constant of the graph (a float would be a graph input)
            self.calls = 0

        def forward(self, x):
            return super().forward(x) * self.factor

    model, optimizer, step, x = _compiled(fake_mesh, _step, Scaled)
    classes = [type(m) for m in model.modules()]
    step(model, optimizer, x)
    assert [type(m) for m in model.modules()] == classes
    described = [v.description for v in step.last.traced.python_guards.values]
    assert "attribute factor of the model" in described and not any("calls" in d for d in described), described
    first = step.last
    model.calls += 1
    step(model, optimizer, x)
    assert step.last is first
    model.factor = 3.0
    step(model, optimizer, x)
    assert step.last is not first

    def failing(model, optimizer, x):
        raise RuntimeError("boom")

    with pytest.raises(spmd.TraceError):
        spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(failing)(model, optimizer, x)
    assert [type(m) for m in model.modules()] == classes


def test_a_step_traced_under_autocast_is_not_reused_outside_it(fake_mesh):
    """torch's global state (here autocast) is part of what a graph assumed: the bf16 graph traced
    inside ``torch.autocast`` is not run outside it, and comes back when autocast does."""
    model, optimizer, step, x = _compiled(fake_mesh, _step)

    def bf16_nodes(artifacts):
        return [n for n in artifacts.traced.graph_module.graph.nodes if getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(model, optimizer, x)
    mixed = step.last
    assert bf16_nodes(mixed)
    with pytest.warns(UserWarning, match=r"global state differs .*autocast\(cpu\)_enabled"):
        step(model, optimizer, x)
    assert step.last is not mixed and not bf16_nodes(step.last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(model, optimizer, x)
    assert step.last is mixed


def test_a_list_attribute_changed_in_place_compiles_again(fake_mesh):
    """A list of numbers forward reads is compared by value (a copy is kept): ``model.mix[1] = ...``
    changes the graph's constants."""

    class Mixed(Net):
        def __init__(self):
            super().__init__()
            self.mix = [1.0, 0.5]

        def forward(self, x):
            out = super().forward(x)
            return out * self.mix[0] + out.square() * self.mix[1]

    model, optimizer, step, x = _compiled(fake_mesh, _step, Mixed)
    step(model, optimizer, x)
    first = step.last
    model.mix[1] = 0.25
    with pytest.warns(UserWarning, match=r"attribute mix of the model == \[1.0, 0.5\] \(now \[1.0, 0.25\]\)"):
        step(model, optimizer, x)
    assert step.last is not first


def test_a_module_whose_class_changed_compiles_again(fake_mesh):
    """``module.__class__ = ...`` (what torch's parametrize and FSDP2 do to a module) is a new graph."""
    model, optimizer, step, x = _compiled(fake_mesh, _step)
    step(model, optimizer, x)
    first = step.last
    model.act.__class__ = nn.ReLU
    model.act.inplace = False
    step(model, optimizer, x)
    assert step.last is not first
    assert any("relu" in str(n.target) for n in step.last.local_graph.graph.nodes)


CALLS = 0


def _counting_step(model, optimizer, x):
    global CALLS
    CALLS += 1  # Python bookkeeping inside the step
    return _step(model, optimizer, x)


def test_assigning_a_global_in_the_step_warns(fake_mesh):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_counting_step)
    with pytest.warns(UserWarning, match=r"the step assigns global CALLS at .*test_guards.py:\d+; .* not on every call"):
        step(model, optimizer, torch.randn(2, 8))


def _printing_step(model, optimizer, x):
    loss = _step(model, optimizer, x)
    print("loss", loss)  # debugging output inside the step
    return loss


class PrintingNet(Net):
    def forward(self, x):
        out = super().forward(x)
        print(out.shape)
        return out


def test_print_in_the_step_or_forward_warns(fake_mesh, capsys):
    """print() runs once, at trace time, on fake tensors: the warning names each call site."""
    torch.manual_seed(0)
    model = PrintingNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_printing_step)
    with pytest.warns(UserWarning, match=r"calls print\(\) at .*test_guards.py:\d+; .*return the values from the step") as record:
        step(model, optimizer, torch.randn(2, 8))
    sites = {str(w.message).split(" at ")[1].split(";")[0] for w in record if "print()" in str(w.message)}
    assert len(sites) == 2, sites  # the step's print and forward's
    assert "FakeTensor" in capsys.readouterr().out  # what the user saw: a stand-in, not the loss


def test_reads_of_a_trace_time_stand_in_guard_the_models_own_module(fake_mesh):
    """SyncBatchNorm is traced through a single-device stand-in that exists only while tracing: the
    guards read the model's own module (one compilation for three calls), and a change of its
    momentum compiles again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.SyncBatchNorm(6), nn.Linear(6, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_step)
    x = torch.randn(4, 8)
    for _ in range(3):
        step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 1
    first = step.last
    model[1].momentum = 0.5
    step(model, optimizer, x)
    assert step.last is not first


def test_a_read_of_a_module_with_no_place_in_the_model_guards_the_nearest_one():
    """A module inside a trace-time stand-in has no place in the restored model: its read is not
    dropped but guards every scalar attribute of the nearest module that has one."""
    from spmd_expand.python_values import ModuleRead, PythonGuards

    model = Net()
    inner = nn.Dropout(0.1)  # stood at "act.inner" inside a stand-in for "act"
    guards = PythonGuards(module_reads=[ModuleRead(inner, "act.inner", "p", 0.1)])
    guards.bind(model)
    assert [v.description for v in guards.values] == ["attribute act.approximate of the model"]
    assert guards.check() is None
    model.act.approximate = "tanh"
    assert "act.approximate" in guards.check()


def test_a_settings_object_read_through_a_stand_in_is_still_guarded():
    """A config held by a module with no place in the restored model (inside a trace-time stand-in)
    is guarded on the object itself; the read was dropped, with no guard."""
    from spmd_expand.python_values import ModuleRead, PythonGuards

    model = Net()
    config = _Config()
    holder = nn.Module()  # stood at "act.inner" inside a stand-in for "act"
    guards = PythonGuards(module_reads=[ModuleRead(holder, "act.inner", "residual_scale", 1.0, via="config", held=config)])
    guards.bind(model)
    assert guards.check() is None
    config.residual_scale = 0.5
    assert "residual_scale" in guards.check() and "act.inner.config" in guards.check()


# ------------------------------------------------------------------ settings objects the trace read

ARGS = argparse.Namespace(label_smoothing=0.0, epochs=10)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    scale: float = 1.0


@dataclasses.dataclass(slots=True)
class _Slotted:
    scale: float = 1.0


def _settings_step(settings):
    """A step that reads ``settings.scale`` (the object is a closure variable)."""

    def step(model, optimizer, x):
        loss = model(x).square().mean() * settings.scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _args_step(model, optimizer, x):
    y = torch.zeros(x.shape[0], dtype=torch.long)
    loss = nn.functional.cross_entropy(model(x), y, label_smoothing=ARGS.label_smoothing)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_an_attribute_of_a_global_namespace_is_guarded_exactly_as_read(fake_mesh):
    """``args.label_smoothing`` is a float graph input that cross_entropy takes as a constant: changed
    between calls, it compiles again, the warning naming it; ``args.epochs``, which the step never
    reads, changes nothing."""
    model, optimizer, step, x = _compiled(fake_mesh, _args_step)
    try:
        step(model, optimizer, x)
        first = step.last
        ARGS.epochs = 11
        step(model, optimizer, x)
        assert step.last is first
        ARGS.label_smoothing = 0.1
        with pytest.warns(UserWarning, match=r"assumed Eq\(attribute label_smoothing of global ARGS of test_guards, 0.0\)"):
            step(model, optimizer, x)
        assert step.last is not first
        assert type(ARGS) is argparse.Namespace  # its class is given back after tracing
    finally:
        ARGS.label_smoothing, ARGS.epochs = 0.0, 10


@pytest.mark.parametrize("make", [_Frozen, _Slotted, lambda: types.SimpleNamespace(scale=1.0)], ids=["frozen_dataclass", "slots_dataclass", "simple_namespace"])
def test_an_attribute_of_a_settings_object_in_a_closure_is_guarded(fake_mesh, make):
    """A float attribute of a settings object is a graph input where it is a plain attribute (a frozen
    dataclass's, a SimpleNamespace's: one graph for every value); a slots dataclass's has no place to
    hold the input's stand-in, so it is guarded: a change compiles again, the warning naming it."""
    settings = make()
    model, optimizer, step, x = _compiled(fake_mesh, _settings_step(settings))
    step(model, optimizer, x)
    first = step.last
    object.__setattr__(settings, "scale", 2.0)
    if make is _Slotted:
        with pytest.warns(UserWarning, match=r"attribute scale of closure variable settings of .* == 1.0 \(now 2.0\)"):
            step(model, optimizer, x)
        assert step.last is not first
        scales = {a for n in step.last.traced.graph_module.graph.nodes if n.target is torch.ops.aten.mul.Tensor for a in n.args}
        assert 2.0 in scales  # the new graph multiplies by the new value
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(model, optimizer, x)
        assert step.last is first
        assert any(str(hp).startswith("attribute scale of closure variable settings of") for hp in first.traced.hyperparameters)
        assert settings.scale == 2.0  # the stand-in is not left behind
    assert type(settings) is type(make())


class _Config:
    """A model config as HuggingFace models hold it (``self.config``), shared by several modules."""

    def __init__(self):
        self.residual_scale = 1.0
        self.vocab_size = 32


class _Configured(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.inner = Net()
        self.inner.config = self.config

    def forward(self, x):
        return self.inner(x) * self.config.residual_scale


def test_an_attribute_of_a_config_a_module_holds_is_guarded(fake_mesh):
    model, optimizer, step, x = _compiled(fake_mesh, _step, _Configured)
    step(model, optimizer, x)
    first = step.last
    model.config.vocab_size = 64  # not read by forward
    step(model, optimizer, x)
    assert step.last is first
    model.config.residual_scale = 0.5
    with pytest.warns(UserWarning, match=r"attribute config.residual_scale of the model == 1.0 \(now 0.5\)"):
        step(model, optimizer, x)
    assert step.last is not first
    assert type(model.config) is _Config


class _Trainer:
    def __init__(self):
        self.loss_scale = 1.0

    def train_step(self, model, optimizer, x):
        loss = model(x).square().mean() * self.loss_scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss


def test_an_attribute_of_the_object_a_method_step_belongs_to_is_read_on_every_call(fake_mesh):
    """A trainer's float ``self.loss_scale`` is a graph input (one graph for every value); an int one
    is a constant of the graph: a change compiles again, the warning naming it."""
    trainer = _Trainer()
    model, optimizer, step, x = _compiled(fake_mesh, trainer.train_step)
    step(model, optimizer, x)
    first = step.last
    trainer.loss_scale = 4.0
    step(model, optimizer, x)
    assert step.last is first
    assert "attribute loss_scale of the _Trainer object of _Trainer.train_step" in [str(hp) for hp in first.traced.hyperparameters]
    trainer.loss_scale = 4
    step(model, optimizer, x)  # an int now: no input for it, a graph of its own
    second = step.last
    assert second is not first
    trainer.loss_scale = 2
    with pytest.warns(UserWarning, match=r"attribute loss_scale of the _Trainer object of _Trainer.train_step == 4 \(now 2\)"):
        step(model, optimizer, x)
    assert step.last is not second


class SelfAnnealing(Net):
    """Anneals its own temperature in forward (``self.temperature *= 0.5``)."""

    def __init__(self):
        super().__init__()
        self.temperature = 1.0

    def forward(self, x):
        out = super().forward(x) / self.temperature
        self.temperature *= 0.5
        return out


class SetattrAnnealing(Net):
    """The same through ``setattr`` (no ``STORE_ATTR`` in the code)."""

    def __init__(self):
        super().__init__()
        vars(self)["temperature"] = 1.0

    def forward(self, x):
        out = super().forward(x) / self.temperature
        setattr(self, "temperature", self.temperature * 0.5)
        return out


@pytest.mark.parametrize("module", [SelfAnnealing, SetattrAnnealing])
def test_a_float_attribute_the_step_assigns_is_not_an_input(fake_mesh, module):
    """A float attribute the step assigns stays a guarded constant whose assignment is replayed after
    each call (a graph input's place holds its stand-in only while tracing, so the step's own
    assignment would be lost): left out where the code assigns it (``STORE_ATTR``), and an assignment
    found after tracing (``setattr``) traces again with the values. The attribute ends where eager's does."""
    model, optimizer, step, x = _compiled(fake_mesh, _step, module)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # each call compiles again: the value it reads changed
        for _ in range(3):
            step(model, optimizer, x)
    assert model.temperature == 0.125
    assert not any("temperature" in str(hp) for hp in step.last.traced.hyperparameters)
    if module is SetattrAnnealing:
        assert any("the step assigns attribute temperature of the model" in str(w.message) for w in record)


def test_a_float_attribute_of_a_user_module_is_a_graph_input(fake_mesh):
    """``self.temperature`` read in forward (a curriculum changes it between calls): one graph for
    every value; an nn.Module of torch's keeps its float settings constants (``nn.Dropout.p``)."""
    model, optimizer, step, x = _compiled(fake_mesh, _step, Tempered)
    step(model, optimizer, x)
    first = step.last
    names = [str(hp) for hp in first.traced.hyperparameters]
    assert "attribute temperature of the model" in names and not any(" p of " in n for n in names), names
    for t in (2.0, 0.5):
        model.temperature = t
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(model, optimizer, x)
        assert step.last is first and model.temperature == t


class Tempered(Net):
    def __init__(self):
        super().__init__()
        self.temperature = 1.0
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(super().forward(x)) / self.temperature


# ------------------------------------------------------------------ float arguments of the step


def _weighted_step(model, optimizer, x, lam, cfg):
    loss = model(x).square().mean() * lam + model(x).abs().mean() * cfg["beta"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_float_arguments_are_graph_inputs(fake_mesh):
    """A Python float among the step's arguments (a mixup ``lam``, a weight in a dict) is a graph input,
    as ``lr`` is: new values every call, one compilation, no warning."""
    model, optimizer, step, x = _compiled(fake_mesh, _weighted_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lam, beta in [(0.5, 0.1), (0.7, 0.2), (0.1, 0.9), (0.5, 0.1)]:
            step(model, optimizer, x, lam, {"beta": beta})
    assert sum(len(v) for v in step.cache.values()) == 1
    assert [hp.label for hp in step.last.traced.hyperparameters if isinstance(hp, FloatArgument)] == ["lam", "cfg['beta']"]


def _exp_step(model, optimizer, x, lam):
    scale = math.exp(lam) if lam > 0.5 else 1.0  # a branch, then a read as a number (specialized)
    return _step(model, optimizer, x * scale)


def test_a_float_argument_read_as_a_number_compiles_once_per_value(fake_mesh):
    """Where the step needs the number (``math.exp(lam)``) the graph holds it: a new value compiles
    again, with a warning that names the argument; where it only branches, one graph per side."""
    model, optimizer, step, x = _compiled(fake_mesh, _exp_step)
    step(model, optimizer, x, 0.1)
    step(model, optimizer, x, 0.2)  # the same side of the branch: the same graph
    assert sum(len(v) for v in step.cache.values()) == 1
    with pytest.warns(UserWarning, match=r"assumed argument lam <= 0.5.*float argument that the step branches on"):
        step(model, optimizer, x, 0.7)
    with pytest.warns(UserWarning, match=r"assumed Eq\(argument lam, 0.7\)"):
        step(model, optimizer, x, 0.8)
    assert sum(len(v) for v in step.cache.values()) == 3


def _formatted_step(model, optimizer, x, lam):
    tag = f"{lam:.2f}"  # a format spec a symbolic float does not take
    return _step(model, optimizer, x * lam) if tag else None


def test_float_arguments_that_cannot_be_inputs_become_constants_with_a_warning(fake_mesh):
    """A step that fails with its float arguments as inputs is traced with their values: it runs, says
    why, and says so again for each value that compiles."""
    model, optimizer, step, x = _compiled(fake_mesh, _formatted_step)
    with pytest.warns(UserWarning, match=r"float arguments \(lam\) are constants of its graph.*SymFloat.__format__"):
        step(model, optimizer, x, 0.5)
    with pytest.warns(UserWarning, match=r"new value of its arguments lam=0.25 \(before: 0.5\)"):
        step(model, optimizer, x, 0.25)
    assert sum(len(v) for v in step.cache.values()) == 2


RUN_SCALE = 1.0  # a global a log line formats


def _tagged_step(model, optimizer, x, lam):
    tag = f"run-{RUN_SCALE:.1f}"  # a format spec a symbolic float does not take
    return _step(model, optimizer, x * lam * RUN_SCALE) if tag else None


def test_a_float_global_that_cannot_be_an_input_leaves_the_float_arguments_inputs(fake_mesh):
    """A float global read where a symbolic float cannot go is traced with its value (guarded: a change
    compiles again), and the step's float arguments stay inputs (one graph for every ``lam``)."""
    global RUN_SCALE
    model, optimizer, step, x = _compiled(fake_mesh, _tagged_step)
    with pytest.warns(UserWarning, match=r"the floats _tagged_step reads from globals and attributes \(global RUN_SCALE of test_guards\) are constants"):
        step(model, optimizer, x, 0.5)
    first = step.last
    step(model, optimizer, x, 0.25)
    assert step.last is first
    assert [str(hp) for hp in first.traced.hyperparameters if "lam" in str(hp)] == ["argument lam"]
    try:
        RUN_SCALE = 2.0
        with pytest.warns(UserWarning, match=r"global RUN_SCALE of test_guards == 1.0 \(now 2.0\)"):
            step(model, optimizer, x, 0.25)
        assert step.last is not first
    finally:
        RUN_SCALE = 1.0


def _counter_step(model, optimizer, x, i):
    return _step(model, optimizer, x) if i >= 0 else None


def test_an_int_argument_with_a_new_value_compiles_again_with_a_warning(fake_mesh):
    """An int argument is a constant of the graph: a step counter passed in compiles on every call, and
    says so (before, it compiled silently)."""
    model, optimizer, step, x = _compiled(fake_mesh, _counter_step)
    step(model, optimizer, x, 0)
    with pytest.warns(UserWarning, match=r"new value of its arguments i=1 \(before: 0\).*a step counter"):
        step(model, optimizer, x, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, optimizer, x, 0)  # cached: no compilation, no warning


def _clipped_step(model, optimizer, x, max_norm):
    loss = model(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_an_infinite_float_argument_gets_a_graph_of_its_own(fake_mesh):
    """``max_norm=float("inf")`` (clipping off, a common default) is read as a number by
    ``clip_grad_norm_``; sympy folds that guard (symbols are finite) to False, and it was dropped: the
    graph traced for inf ran, clipping nothing, after max_norm changed to 0.01. A graph traced with a
    non-finite value is now only for that value, and a finite one's only for finite values."""
    model, optimizer, step, x = _compiled(fake_mesh, _clipped_step)
    step(model, optimizer, x, float("inf"))
    step(model, optimizer, x, float("inf"))
    inf_graph = step.last
    with pytest.warns(UserWarning, match=r"assumed argument max_norm == inf"):
        step(model, optimizer, x, 0.01)
    assert step.last is not inf_graph
    step(model, optimizer, x, float("inf"))
    assert step.last is inf_graph
    with pytest.warns(UserWarning, match=r"argument max_norm == 0.01"):  # the last graph's
        step(model, optimizer, x, float("nan"))
    assert sum(len(v) for v in step.cache.values()) == 3


# ------------------------------------------------------------------ numpy values the trace read

SCALE_NP = np.float64(1.0)
WEIGHTS_NP = np.ones(4, dtype=np.float32)


def _numpy_step(model, optimizer, x):
    return _step(model, optimizer, x * SCALE_NP * torch.as_tensor(WEIGHTS_NP).sum())


class NumpyMixing(Net):
    """mixup written with numpy: the loop sets ``model.lam = np.random.beta(a, a)`` before a call."""

    lam = np.float64(0.5)

    def forward(self, x):
        return super().forward(self.lam * x + (1 - self.lam) * x.flip(0))


def test_numpy_values_the_trace_read_are_guarded(fake_mesh):
    """A numpy scalar (``np.float64``, ``np.float32``: not Python floats to an exact type check) and a
    numpy array (held by the graph as a constant) were baked in with no guard: a global scale set to
    0.0 or an array rebound kept the first trace's (2-layer MLP on one gloo rank: 0.046 then 0.073
    away from one device's parameters, no warning). Scalars are compared by value, arrays by identity
    (a write into the same array reaches the graph, which holds its memory)."""
    global SCALE_NP, WEIGHTS_NP
    model, optimizer, step, x = _compiled(fake_mesh, _numpy_step)
    try:
        step(model, optimizer, x)
        first = step.last
        WEIGHTS_NP[0] = 3.0  # in place: the same array, the same graph
        step(model, optimizer, x)
        assert step.last is first
        SCALE_NP = np.float64(0.0)
        with pytest.warns(UserWarning, match=r"global SCALE_NP of test_guards == np.float64\(1.0\) \(now np.float64\(0.0\)\)"):
            step(model, optimizer, x)
        WEIGHTS_NP = np.ones(4, dtype=np.float32)
        with pytest.warns(UserWarning, match=r"global WEIGHTS_NP of test_guards == array"):
            step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 3
    finally:
        SCALE_NP, WEIGHTS_NP = np.float64(1.0), np.ones(4, dtype=np.float32)
    model, optimizer, step, x = _compiled(fake_mesh, _step, NumpyMixing)
    step(model, optimizer, x)
    model.lam = np.float32(0.25)
    with pytest.warns(UserWarning, match=r"attribute lam of the model == np.float64\(0.5\) \(now np.float32\(0.25\)\)"):
        step(model, optimizer, x)


class Phase(enum.Enum):
    PRETRAIN = 1
    FINETUNE = 2


PHASE = Phase.PRETRAIN


class Skipping(Net):
    """Settings a forward reads that are not numbers: a set of layers to skip (changed in place) and
    a frozenset of them."""

    def __init__(self):
        super().__init__()
        self.skip, self.frozen = set(), frozenset()
        self.layer_scale = collections.OrderedDict({0: 1.0})  # int keys, a dict subclass
        self.blocks = range(1)

    def forward(self, x):
        h = self.act(self.fc1(x))
        if "act" in self.skip:
            h = self.fc1(x)
        for i in self.blocks:
            h = h * self.layer_scale[i]
        return self.fc2(h) * (0.5 if "fc2" in self.frozen else 1.0)


def _phase_step(model, optimizer, x):
    return _step(model, optimizer, x * 2 if PHASE == Phase.FINETUNE else x)


def test_enum_members_and_sets_the_trace_read_are_guarded(fake_mesh):
    """An Enum member compared with ``==``, a set changed in place, a frozenset replaced, a dict with
    int keys (an OrderedDict) changed in place and a range replaced were baked in with no guard (one
    gloo rank: 0.046, 0.021, 0.030, 0.195 and 0.050 away from one device's parameters after the
    change, no warning)."""
    global PHASE
    model, optimizer, step, x = _compiled(fake_mesh, _phase_step)
    try:
        step(model, optimizer, x)
        PHASE = Phase.FINETUNE
        with pytest.warns(UserWarning, match=r"global PHASE of test_guards == <Phase.PRETRAIN: 1> \(now <Phase.FINETUNE: 2>\)") as record:
            step(model, optimizer, x)
        assert not any("float argument" in str(w.message) for w in record)  # not a fix for an Enum
    finally:
        PHASE = Phase.PRETRAIN
    model, optimizer, step, x = _compiled(fake_mesh, _step, Skipping)
    step(model, optimizer, x)
    model.skip.add("act")
    with pytest.warns(UserWarning, match=r"attribute skip of the model == set\(\) \(now \{'act'\}\)"):
        step(model, optimizer, x)
    model.frozen = frozenset({"fc2"})
    with pytest.warns(UserWarning, match=r"attribute frozen of the model == frozenset\(\)"):
        step(model, optimizer, x)
    model.layer_scale[0] = 0.5
    with pytest.warns(UserWarning, match=r"attribute layer_scale of the model == OrderedDict\(\[\(0, 1.0\)\]\)"):
        step(model, optimizer, x)
    model.blocks = range(0)
    with pytest.warns(UserWarning, match=r"attribute blocks of the model == range\(0, 1\)"):
        step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 5


def _leaky_step(model, optimizer, x, slope):
    return _step(model, optimizer, torch.nn.functional.leaky_relu(x, slope))


def test_a_float_argument_inductor_takes_as_a_constant_compiles_per_value(fake_mesh):
    """``leaky_relu``'s slope is a float Inductor's kernels take as a number (tensorify cannot pass a
    tensor): a new value compiles the graph again for it, at the call, with a warning. That compilation
    read the autograd metadata of the step's in-place-updated local tensors and failed."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="inductor")(_leaky_step)
    x = torch.randn(2, 8)
    step(model, optimizer, x, 0.1)
    step(model, optimizer, x, 0.1)
    with pytest.warns(UserWarning, match=r"holds float inputs .* as constants, and they changed to \[.*0.2\]"):
        step(model, optimizer, x, 0.2)
    assert sum(len(v) for v in step.cache.values()) == 1


def _smoothed_step(model, optimizer, x, lam):
    loss = torch.nn.functional.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long), label_smoothing=lam / 2)
    return cases.update(loss, optimizer)


def test_guards_with_torchs_sympy_functions_are_checked(fake_mesh):
    """``label_smoothing=lam / 2`` specializes ``FloatTrueDiv(lam, 2)``: the guard, evaluated by
    ``sympy.lambdify``, raised NameError on the next call; it is printed as Dynamo prints guards."""
    model, optimizer, step, x = _compiled(fake_mesh, _smoothed_step)
    step(model, optimizer, x, 0.5)
    step(model, optimizer, x, 0.5)
    with pytest.warns(UserWarning, match=r"assumed Eq\(FloatTrueDiv\(argument lam, 2.0\), 0.25\)"):
        step(model, optimizer, x, 0.3)
    assert sum(len(v) for v in step.cache.values()) == 2


class OptionalScale(Net):
    """Reads settings that may not exist yet: ``getattr(self, "gain", 1.0)``, ``hasattr(self, "boost")``."""

    def forward(self, x):
        out = super().forward(x) * getattr(self, "gain", 1.0)
        return out * 2 if hasattr(self, "boost") else out


class _Settings:
    pass


SETTINGS_OBJECT = _Settings()


def _optional_global_step(model, optimizer, x):
    return _step(model, optimizer, x * getattr(SETTINGS_OBJECT, "scale", 1.0))


def test_an_attribute_read_while_missing_is_guarded(fake_mesh):
    """An attribute that did not exist when the step was traced (its default taken) and was set later
    was never compared: the graph of the default ran on (one gloo rank: 0.084 then 0.18 away from one
    device's parameters, no warning). A read that finds nothing is recorded as missing."""
    model, optimizer, step, x = _compiled(fake_mesh, _step, OptionalScale)
    step(model, optimizer, x)
    model.gain = 3.0
    with pytest.warns(UserWarning, match=r"attribute gain of the model == <missing> \(now 3.0\)"):
        step(model, optimizer, x)
    model.boost = True
    with pytest.warns(UserWarning, match=r"attribute boost of the model == <missing> \(now True\)"):
        step(model, optimizer, x)
    model, optimizer, step, x = _compiled(fake_mesh, _optional_global_step)
    step(model, optimizer, x)
    SETTINGS_OBJECT.scale = 0.5
    try:
        with pytest.warns(UserWarning, match=r"attribute scale of global SETTINGS_OBJECT of test_guards == <missing>"):
            step(model, optimizer, x)
    finally:
        del SETTINGS_OBJECT.scale


def test_an_attribute_set_later_on_a_simple_namespace_is_guarded(fake_mesh):
    """A ``SimpleNamespace`` takes no recording class, so a read of an attribute it lacks
    (``getattr(ns, "scale", 1.0)``) is not seen; setting it later ran the graph of the default (one
    gloo rank: 0.021 then 0.027 away from one device's parameters, no warning). The names it holds are
    guarded with its values."""
    settings = types.SimpleNamespace(epochs=10)

    def step_fn(model, optimizer, x):
        return _step(model, optimizer, x * getattr(settings, "scale", 1.0))

    model, optimizer, step, x = _compiled(fake_mesh, step_fn)
    step(model, optimizer, x)
    step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 1
    settings.scale = 0.5
    with pytest.warns(UserWarning, match=r"closure variable settings of .* has attributes set or deleted since the trace \(set: scale; deleted: none\)"):
        step(model, optimizer, x)
    # The new graph reads the value set as a graph input: another value runs it again.
    second = step.last
    assert any(str(hp).startswith("attribute scale of closure variable settings") for hp in second.traced.hyperparameters)
    settings.scale = 0.25
    step(model, optimizer, x)
    assert step.last is second


def _optimizer_scaled_step(model, optimizer, x):
    return _step(model, optimizer, x * optimizer.loss_scale)


def test_an_attribute_set_on_a_torch_optimizer_is_guarded(fake_mesh):
    """``optimizer.loss_scale``, set by the user on a torch optimizer and read by the step, was baked
    in with no guard (one gloo rank: 0.046 then 0.073 away from one device's parameters after a change
    from 1.0 to 0.0); torch's optimizers were not recorded, only optimizers of the user's classes."""
    model, optimizer, step, x = _compiled(fake_mesh, _optimizer_scaled_step)
    optimizer.loss_scale = 1.0
    step(model, optimizer, x)
    optimizer.param_groups[0]["lr"] = 0.5  # a graph input: no compilation
    step(model, optimizer, x)
    optimizer.loss_scale = 0.0
    with pytest.warns(UserWarning, match=r"attribute loss_scale of the AdamW optimizer == 1.0 \(now 0.0\)"):
        step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 2


LOSS_WEIGHTS = torch.ones(4)
PENALTY = nn.Linear(4, 2).requires_grad_(False)  # a frozen module a loss term runs, not the model's
TABLES = {"shift": torch.zeros(8)}


def _global_tensors_step(model, optimizer, x):
    out = model(x - TABLES["shift"])
    return cases.update((out.square() * LOSS_WEIGHTS).mean() + PENALTY(out).square().mean(), optimizer)


def test_tensors_read_from_globals_are_graph_inputs(fake_mesh):
    """A tensor a global holds, and a frozen module's parameters there, are replicated graph inputs
    read from their place on every call (they were a TraceError): changed in place or replaced by a
    tensor of the same shape, one graph; another shape compiles again. Values: tests/loops.py's
    global_tensor_constants compares them with one device on 2 gloo ranks."""
    global LOSS_WEIGHTS
    model, optimizer, step, x = _compiled(fake_mesh, _global_tensors_step)
    saved = LOSS_WEIGHTS
    try:
        step(model, optimizer, x)
        roles = [r for r in step.last.traced.inputs if r.kind == "constant"]
        assert [r.key for r in roles] == [
            "global TABLES of test_guards['shift']", "global LOSS_WEIGHTS of test_guards",
            "parameter weight of global PENALTY of test_guards", "parameter bias of global PENALTY of test_guards",
        ]
        TABLES["shift"] = torch.full((8,), 0.5)  # another tensor in the dict: an input too
        LOSS_WEIGHTS.mul_(2.0)
        step(model, optimizer, x)
        LOSS_WEIGHTS = torch.full((4,), 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no recompilation warning
            step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 1
        assert step._binding.local_inputs([x])[-3] is LOSS_WEIGHTS  # the new tensor is the input
        LOSS_WEIGHTS = torch.ones(1)  # broadcasts too, another shape: another graph
        step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 2
        LOSS_WEIGHTS = torch.ones(4, 2)[:, 0]  # not contiguous: the graph takes contiguous inputs
        with pytest.raises(spmd.TraceError, match=r"(?s)computes with a tensor it was not handed .* or is not contiguous"):
            step(model, optimizer, x)
    finally:
        LOSS_WEIGHTS = saved
        TABLES["shift"] = torch.zeros(8)


def _assigning_step(model, optimizer, x):
    global LOSS_WEIGHTS
    loss = cases.update((model(x).square() * LOSS_WEIGHTS).mean(), optimizer)
    LOSS_WEIGHTS = LOSS_WEIGHTS * 0.9
    return loss


def test_a_step_assigning_a_global_tensor_it_reads_is_refused(fake_mesh):
    """The graph takes the global's tensor as an input; a new tensor assigned to it would exist only in
    the trace. Refused, and the global keeps its tensor."""
    model, optimizer, step, x = _compiled(fake_mesh, _assigning_step)
    before = LOSS_WEIGHTS
    with pytest.raises(spmd.TraceError, match=r"assigns a new tensor to global LOSS_WEIGHTS of test_guards") as info:
        step(model, optimizer, x)
    assert "update it in place" in str(info.value)
    assert LOSS_WEIGHTS is before


class _ScaledNet(Net):
    """A tensor kept as a plain attribute (``self.gain = ...`` in ``__init__``, not a registered buffer)."""

    def __init__(self):
        super().__init__()
        self.gain = torch.ones(8)

    def forward(self, x):
        return super().forward(x * self.gain)


class _ArgsTrainer:
    def __init__(self):
        self.args = types.SimpleNamespace(weights=torch.ones(2))

    def train_step(self, model, optimizer, x):
        return cases.update((model(x).square() * self.args.weights.sum()).mean(), optimizer)


def test_tensors_held_as_attributes_are_graph_inputs(fake_mesh):
    """A tensor held as a plain attribute of one of the model's modules, and one of a settings object
    the object a method step belongs to holds (``self.args.weights``), are graph inputs (they were a
    TraceError): one graph while they change in place."""
    model, optimizer, step, x = _compiled(fake_mesh, _step, _ScaledNet)
    model.fc1.cached = torch.ones(3)  # no code reads it: not an input (its values are not compared either)
    step(model, optimizer, x)
    model.gain.mul_(2.0)
    step(model, optimizer, x)
    assert [r.key for r in step.last.traced.inputs if r.kind == "constant"] == ["attribute gain of the model"]
    trainer = _ArgsTrainer()
    model, optimizer, step, x = _compiled(fake_mesh, trainer.train_step)
    step(model, optimizer, x)
    trainer.args.weights.fill_(3.0)
    step(model, optimizer, x)
    assert [r.key for r in step.last.traced.inputs if r.kind == "constant"] == ["attribute weights of args of the _ArgsTrainer object of _ArgsTrainer.train_step"]
    assert sum(len(v) for v in step.cache.values()) == 1


def test_optimizer_state_created_after_a_momentum_change_is_named_briefly(fake_mesh):
    """SGD without momentum keeps no state; once a schedule sets momentum, its first step creates
    momentum buffers and the next call compiles for them. The warning says that, in one line, not the
    repr of every state tensor (it printed them all)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(cases.mse_step)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for momentum in (0.0, 0.9, 0.9):
            optimizer.param_groups[0]["momentum"] = momentum
            step(model, optimizer, x)
    messages = [str(w.message) for w in caught if "spmd.compile" in str(w.message)]
    created = [m for m in messages if "state is not the one" in m]
    assert len(created) == 1, messages
    assert "the SGD optimizer's state is not the one the step was traced with" in created[0], created[0]
    assert "now a defaultdict of 4 entries" in created[0] and len(created[0]) < 400, created[0]


def _doubled(h):
    return h * 2.0


SCALED = functools.partial(torch.mul, other=1.5)


class _Squashers:
    def tanh(self, h):
        return torch.tanh(h)

    def sigmoid(self, h):
        return torch.sigmoid(h)


SQUASHERS = _Squashers()


class _Patchable(nn.Module):
    """A forward that calls a method of its class, a global function, a global partial and a callable
    it holds: each can be replaced between calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.squash = SQUASHERS.tanh  # a bound method of a user object

    def act(self, h):
        return SCALED(_doubled(h))

    def forward(self, x):
        return self.a(self.squash(self.act(x)))


def _replace_instance_forward(model, optimizer):
    model.forward = types.MethodType(lambda self, x: self.a(x), model)


def _replace_class_method(model, optimizer):
    _Patchable.act = lambda self, h: h


def _shadow_method(model, optimizer):
    model.act = lambda h: h


def _replace_held_callable(model, optimizer):
    model.squash = SQUASHERS.sigmoid


def _replace_code(model, optimizer):
    _doubled.__code__ = (lambda h: h * 3.0).__code__


def _change_partial(model, optimizer):
    SCALED.keywords["other"] = 2.5


def _wrap_optimizer_step(model, optimizer):
    step = optimizer.step
    optimizer.step = lambda *a, **k: step(*a, **k)


@pytest.mark.parametrize(
    "patch, said",
    [
        (_replace_instance_forward, "model has other instance attributes (set: forward"),
        (_replace_class_method, "class _Patchable has other attributes (act set, replaced or deleted)"),
        (_shadow_method, "model has other instance attributes (set: act"),
        (_replace_held_callable, "model.squash holds another callable than when traced"),
        (_replace_code, "the code of function _doubled was replaced"),
        (_change_partial, "the functools.partial of mul has other arguments"),
        (_wrap_optimizer_step, "the SGD optimizer's step was replaced on the instance"),
    ],
    ids=["instance_forward", "class_method", "shadowing_method", "held_callable", "code", "partial", "optimizer_step"],
)
def test_code_replaced_between_calls_compiles_again(fake_mesh, patch, said):
    """The graph is the code the trace ran: a method, forward, held callable, function body, partial or
    optimizer step replaced after it compiled ran the old code on every later call, silently (measured
    on 2 gloo ranks: parameters 0.02-0.2 away from one device's)."""
    saved = (_Patchable.act, _doubled.__code__, dict(SCALED.keywords))
    try:
        torch.manual_seed(0)
        model = _Patchable()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(cases.mse_step)
        x = torch.randn(4, 8)
        step(model, optimizer, x)
        step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 1
        patch(model, optimizer)
        with pytest.warns(UserWarning, match="the code the step runs is not the code it was traced with: ") as caught:
            step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 2
        assert any(said in str(w.message) for w in caught), [str(w.message) for w in caught]
        step(model, optimizer, x)  # the new code's graph is reused
        assert sum(len(v) for v in step.cache.values()) == 2
    finally:
        _Patchable.act, _doubled.__code__ = saved[0], saved[1]
        SCALED.keywords.clear()
        SCALED.keywords.update(saved[2])


def _compiled_and_called_twice(mesh, fn, model, optimizer, x):
    """``fn`` compiled (DDP, eager), called twice on ``x``: one graph."""
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(fn)
    step(model, optimizer, x)
    step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 1
    return step


AUXILIARY = nn.Module()  # set by the test: a module the step reaches through a global, not the model's


def _auxiliary_loss_step(model, optimizer, x):
    h = model(x)
    loss = h.square().mean() + AUXILIARY(h).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _auxiliary_head():
    return nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.01), nn.Dropout(0.5)).requires_grad_(False)


def _swap_activation(head):
    head[1] = nn.Tanh()


def _another_head(head):
    global AUXILIARY
    AUXILIARY = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 4)).requires_grad_(False)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda head: head.eval(), "the module in global AUXILIARY of test_guards changed since the trace: the module (Sequential) was switched to eval()"),
        (lambda head: head[2].train(False), "submodule '2' (Dropout) was switched to eval()"),
        (_swap_activation, "its submodules are others (at '1': a module added, removed or replaced)"),
        (lambda head: head.register_forward_hook(lambda m, i, o: o * 3.0), "the module (Sequential) has hooks added or removed"),
        (lambda head: setattr(head[1], "negative_slope", 0.5), "negative_slope of submodule 1 of global AUXILIARY of test_guards == 0.01 (now 0.5)"),
        (_another_head, "global AUXILIARY of test_guards holds another object than the module the step was traced with (now a Sequential)"),
    ],
    ids=["eval", "submodule_eval", "submodule_replaced", "hook", "submodule_setting", "rebound"],
)
def test_a_module_the_step_reaches_outside_the_model_is_guarded(fake_mesh, change, said):
    """An auxiliary head, a frozen teacher or a criterion a global or closure variable holds: its
    tensors are graph inputs read by name, and the rest of it is baked into the graph. Its train/eval
    switch, submodules, hooks, the settings of its submodules and the object the variable holds were
    not guarded: 2 gloo ranks ran the first trace on after each (second-call losses 1.2763-1.3640
    where one device had 1.3731-2.3693). Each compiles again now, with a warning naming it."""
    global AUXILIARY
    torch.manual_seed(0)
    AUXILIARY = _auxiliary_head()
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    step = _compiled_and_called_twice(fake_mesh, _auxiliary_loss_step, model, optimizer, x)
    change(AUXILIARY)
    with pytest.warns(UserWarning, match="compiling _auxiliary_loss_step again") as caught:
        step(model, optimizer, x)
    assert any(said in str(w.message) for w in caught), [str(w.message) for w in caught]
    graphs = sum(len(v) for v in step.cache.values())
    step(model, optimizer, x)  # the new state's graph is reused
    assert sum(len(v) for v in step.cache.values()) == graphs


_SCHEDULED: dict = {}


def _scheduled_scale_step(model, optimizer, x):
    """Reads a number off an LR scheduler a global holds (a loss weight following the schedule)."""
    loss = model(x).square().mean() * (_SCHEDULED["scheduler"].get_last_lr()[0] * 10)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_number_read_off_an_lr_scheduler_is_guarded(fake_mesh):
    """torch's LR schedulers are read like settings objects: their scalar attributes the step reads
    (``get_last_lr()`` returns ``_last_lr``) are guarded. They were baked in silently (stale-graph hunt:
    the second call's loss 0.2001 where one device had 0.1423)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _SCHEDULED["scheduler"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    try:
        step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_scheduled_scale_step)
        x = torch.randn(4, 8)
        step(model, optimizer, x)
        step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 1
        _SCHEDULED["scheduler"].step()
        with pytest.warns(UserWarning, match=r"_last_lr .*== \[0\.1\] \(now \[0\.05\]\)"):
            step(model, optimizer, x)
        assert sum(len(v) for v in step.cache.values()) == 2
    finally:
        _SCHEDULED.clear()


class _Doubling(torch.overrides.TorchFunctionMode):
    """Doubles every linear layer's output (a user's instrumentation that changes values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


@pytest.mark.parametrize("around", ["function_mode", "saved_tensors_hooks"])
def test_modes_and_saved_tensor_hooks_around_the_call_are_guarded(fake_mesh, around):
    """The trace runs the step through the torch function modes, dispatch modes and saved-tensor hooks
    around the call; a call under other ones compiled nothing and ran the first graph (stale-graph
    hunt: outputs 0.034 and parameters 0.02 off one device's). They are part of the global-state guard."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(cases.mse_step)
    x = torch.randn(4, 8)
    step(model, optimizer, x)
    context = _Doubling() if around == "function_mode" else torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t)
    with context, pytest.warns(UserWarning, match="function modes, dispatch modes or saved-tensor hooks"):
        step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 2
    step(model, optimizer, x)  # without them again: the first graph
    assert sum(len(v) for v in step.cache.values()) == 2


def _momentum_scaled_step(model, optimizer, x):
    loss = model(x).square().mean() * (1.0 + optimizer.defaults["momentum"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_changed_dict_entry_is_named_in_the_recompile_warning(fake_mesh):
    """A dict the trace read (``optimizer.defaults``) with one entry changed: the warning named only
    "a dict of 9 entries (now a dict of 9 entries)" (stale-graph hunt); it names the entry now."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(_momentum_scaled_step)
    step(model, optimizer, torch.randn(4, 4))
    optimizer.defaults["momentum"] = 0.5
    with pytest.warns(UserWarning, match=r"now a dict of \d+ entries; entries 'momentum' differ"):
        step(model, optimizer, torch.randn(4, 4))


def _environment_switched_step(model, optimizer, x):
    loss = model(x).square().mean()
    if os.environ.get("SPMD_TEST_EXTRA_L1") == "1":  # a debug switch read inside the step
        loss = loss + model.weight.abs().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_an_environment_variable_the_step_reads_is_guarded(fake_mesh, monkeypatch):
    """``os.environ.get(...)`` in the step was baked in (a switch set after the first call ran the old
    graph, silently). The user's reads are recorded while tracing and compared on every call."""
    monkeypatch.delenv("SPMD_TEST_EXTRA_L1", raising=False)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    step = _compiled_and_called_twice(fake_mesh, _environment_switched_step, model, optimizer, x)
    monkeypatch.setenv("SPMD_TEST_EXTRA_L1", "1")
    with pytest.warns(UserWarning, match=r"environment variable SPMD_TEST_EXTRA_L1 == <missing> \(now '1'\)"):
        step(model, optimizer, x)
    assert sum(len(v) for v in step.cache.values()) == 2
    assert type(os.environ).__name__ == "_Environ" and type(os.environ).__module__ == "os"  # put back
