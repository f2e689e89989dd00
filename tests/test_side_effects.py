"""Python state a traced step changes: kept, undone or refused, and always reported.

``make_fx`` runs the step's Python once, when it is traced, on tensors that exist only while tracing.
A step that appends its loss to a global list, counts calls in a dict, caches a tensor on a module or
assigns a buffer would otherwise do so once, or keep a placeholder tensor, with no error
(spmd_expand.trace._settle_state_changes, spmd_expand.python_values.StateWatch). Tracing-only, on a
fake 4-rank mesh; the parity of an assigned buffer on real gloo ranks is the ``buffer_assigned``
scenario of tests/loops.py.

The same holds for the Python the step reaches beyond its own code: the hooks it runs, the methods it
or a ``forward`` calls by name, the callables a module holds, a custom ``autograd.Function``: what they
change is reported or refused, and the values they read are guarded (a new value compiles again).
"""

from __future__ import annotations

import argparse
import collections
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import cases
import spmd_expand as spmd

LOSSES: list = []
STATS = {"steps": 0}
LAST = None


class Tracker:
    """A user object a step logs into."""

    def __init__(self):
        self.history = []
        self.count = 0


TRACKER = Tracker()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


_train = cases.mse_step  # forward, backward, step, zero_grad


_update = cases.update  # the end of the steps below, which differ in how they compute ``loss``


def _compiled(fake_mesh, step):
    return spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(step)


def _call(fake_mesh, step, model=None):
    model = model if model is not None else _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(fake_mesh, step)(model, optimizer, torch.randn(8, 8))
    return [str(w.message) for w in caught if "spmd.compile" in str(w.message)]


def _append_loss(model, optimizer, x):
    loss = _train(model, optimizer, x)
    LOSSES.append(loss)
    return loss


def _assign_loss(model, optimizer, x):
    global LAST
    loss = _train(model, optimizer, x)
    LAST = loss
    return loss


def _log_into_object(model, optimizer, x):
    loss = _train(model, optimizer, x)
    TRACKER.count += 1
    TRACKER.history.append(loss.detach())
    return loss


def test_a_loss_appended_to_a_global_list_is_refused_and_undone(fake_mesh):
    LOSSES[:] = ["before"]
    with pytest.raises(spmd.TraceError, match="global LOSSES of test_side_effects") as info:
        _call(fake_mesh, _append_loss)
    assert "1 -> 2 items" in str(info.value) and "return the value from the step" in str(info.value)
    assert LOSSES == ["before"]  # the placeholder tensor did not stay behind


def test_a_loss_assigned_to_a_global_is_refused_and_undone(fake_mesh):
    global LAST
    LAST = None
    with pytest.raises(spmd.TraceError, match="global LAST of test_side_effects"):
        _call(fake_mesh, _assign_loss)
    assert LAST is None


ARGS = argparse.Namespace(last_loss=None, rows=None)
NAMESPACE = SimpleNamespace(last_loss=None)


def _loss_into_namespaces(model, optimizer, x):
    loss = _update(model(x).square().mean(), optimizer)
    ARGS.last_loss, ARGS.rows = loss.detach(), x.shape[0]
    NAMESPACE.last_loss = loss.detach()
    return loss


def test_a_loss_kept_in_a_global_namespace_is_refused_and_undone(fake_mesh):
    """An ``argparse.Namespace`` or ``SimpleNamespace`` global kept the FakeTensor of the trace with no
    word (their classes are the standard library's, and only user classes' objects were watched)."""
    with pytest.raises(spmd.TraceError, match=r"global ARGS of test_side_effects \(last_loss: None -> a tensor") as info:
        _call(fake_mesh, _loss_into_namespaces)
    assert "global NAMESPACE of test_side_effects" in str(info.value)
    assert ARGS.last_loss is None and ARGS.rows is None and NAMESPACE.last_loss is None


def test_every_change_is_undone_when_one_is_refused(fake_mesh):
    """The counter was changed by the same refused trace: the call changes nothing."""
    TRACKER.history, TRACKER.count = [], 0
    with pytest.raises(spmd.TraceError, match=r"global TRACKER of test_side_effects\.history"):
        _call(fake_mesh, _log_into_object)
    assert TRACKER.history == [] and TRACKER.count == 0


def test_python_bookkeeping_is_kept_and_reported(fake_mesh):
    STATS["steps"] = 0

    def step(model, optimizer, x):
        STATS["steps"] += 1
        return _train(model, optimizer, x)

    messages = _call(fake_mesh, step)
    assert STATS["steps"] == 1  # ran once, when traced, as the warning says
    assert any("global STATS of test_side_effects ('steps': 0 -> 1)" in m and "not on every call" in m for m in messages), messages


def test_a_failed_trace_undoes_the_python_changes_it_made(fake_mesh):
    STATS["steps"] = 0

    def step(model, optimizer, x):
        STATS["steps"] += 1
        loss = _train(model, optimizer, x)
        if loss > 0:  # data-dependent: refused
            return loss
        return -loss

    with pytest.raises(spmd.TraceError, match="depends on tensor values|data-dependent"):
        _call(fake_mesh, step)
    assert STATS["steps"] == 0


class CachingModule(nn.Module):
    """Caches a tensor derived from its input on itself, as HF wav2vec2-BERT's rotary embedding does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.cached = None

    def forward(self, x):
        if self.cached is None:
            self.cached = torch.ones(x.shape[-1])
        return self.fc(x * self.cached)


def test_a_tensor_cached_on_a_module_is_undone_with_a_warning(fake_mesh):
    model = CachingModule()
    messages = _call(fake_mesh, _train, model)
    assert model.cached is None
    assert any("model (cached: None -> a tensor computed in the step)" in m and "undone" in m for m in messages), messages


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def test_a_counter_on_a_module_counts_every_call_by_compiling_again(fake_mesh):
    """The step reads the counter it changes: each call sees a new value, compiles again (saying why)
    and counts."""
    model = Counting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(fake_mesh, _train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step(model, optimizer, torch.randn(8, 8))
    assert model.calls == 3
    assert sum("attribute calls of the model" in str(w.message) for w in caught) == 2, [str(w.message) for w in caught]


class Alternating(nn.Module):
    """Updates only on every other call (a phase it flips): its values repeat, so the graph of each
    phase is reused, and the phase the step assigns must be assigned again after each call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.phase = 0

    def forward(self, x):
        self.phase = 1 - self.phase
        return self.fc(x) * self.phase


def test_a_python_value_the_step_assigns_is_assigned_again_when_a_graph_is_reused(fake_mesh):
    model = Alternating()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(fake_mesh, _train)
    phases, moved = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            before = _local(model.fc.weight).clone()
            step(model, optimizer, torch.randn(8, 8))
            phases.append(model.phase)
            moved.append(not torch.equal(_local(model.fc.weight), before))
    assert phases == [1, 0, 1, 0, 1]
    assert moved == [True, False, True, False, True]
    assert sum(map(len, step.cache.values())) == 2


class Logged:
    """A user object a step keeps numbers in (a SimpleNamespace would do too, but has every attribute
    guarded, as read: it takes no recording class, so each new value would compile again)."""

    lam = lr = rows = None


LOGGED = Logged()


def _logging_step(model, optimizer, x, lam):
    """Keeps numbers of its float inputs for logging: the mixup coefficient it was passed, the learning
    rate (a graph input too), the global batch's row count (a size of the trace)."""
    loss = model(x).square().mean() * lam
    model.last_lam = lam
    LOGGED.lam, LOGGED.lr, LOGGED.rows = 1 - lam, optimizer.param_groups[0]["lr"] / 2, x.shape[0]
    return _update(loss, optimizer)


def test_numbers_computed_from_float_inputs_are_assigned_each_calls_value(fake_mesh):
    """A number the step keeps that it computed from a float input is a symbolic number while traced:
    it was refused (a global) or undone (a module attribute). It is assigned again after each call
    with that call's value, and the step compiles once."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(fake_mesh, _logging_step)
    for i, lam in enumerate([0.75, 0.5, 0.25]):
        optimizer.param_groups[0]["lr"] = 0.1 * (i + 1)
        step(model, optimizer, torch.randn(8, 8), lam)
        assert model.last_lam == lam and type(model.last_lam) is float
        assert (LOGGED.lam, LOGGED.lr, LOGGED.rows) == (1 - lam, 0.1 * (i + 1) / 2, 32)
    assert sum(map(len, step.cache.values())) == 1


class Reassigning(nn.Module):
    def __init__(self, replace_weight=False, new_shape=None):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.replace_weight, self.new_shape = replace_weight, new_shape

    def forward(self, x):
        out = self.fc(x)
        if self.replace_weight:
            self.fc.weight = nn.Parameter(self.fc.weight * 2)
        self.ema = out.detach().mean(0) if self.new_shape is None else out.detach().mean().expand(*self.new_shape)
        return out


def test_assigning_a_parameter_in_the_step_is_refused(fake_mesh):
    model = Reassigning(replace_weight=True)
    weight = model.fc.weight.detach().clone()
    with pytest.raises(spmd.TraceError, match=r"assigns parameter fc\.weight .*copy_"):
        _call(fake_mesh, _train, model)
    assert torch.equal(model.fc.weight.full_tensor(), weight)  # a DTensor now, with the same values


def test_assigning_a_buffer_of_another_shape_is_refused(fake_mesh):
    model = Reassigning(new_shape=(2, 2))
    with pytest.raises(spmd.TraceError, match=r"assigns buffer ema a torch.float32 tensor of shape \(2, 2\), where it is a torch.float32 tensor of shape \(4,\)"):
        _call(fake_mesh, _train, model)
    assert model.ema.shape == (4,)


def test_an_assigned_buffer_is_written_back(fake_mesh):
    """Each rank's local value on the fake group: the buffer is no longer its zeros (parity on real
    ranks: loops.py ``buffer_assigned``)."""
    model = Reassigning()
    messages = _call(fake_mesh, _train, model)
    assert not messages and model.ema.abs().sum() > 0


# Hooks run when the step is traced, as the step's own Python does: what they change is reported or
# refused and what they read is guarded, whatever kind of callable the hook is.
ACTIVATIONS: list = []
HOOK_CALLS = {"forward": 0, "step": 0}
GRADIENT_SCALE = 1.0


def _keep_activation(module, inputs, output):
    ACTIVATIONS.append(output.detach())


def _count_forward(module, inputs, output):
    HOOK_CALLS["forward"] += 1


def _count_step(optimizer, args, kwargs):
    HOOK_CALLS["step"] += 1


def _scale_gradient(grad):
    return grad * GRADIENT_SCALE


class ActivationRecorder:
    """A callable hook object, as feature-extraction and logging utilities write them."""

    def __init__(self):
        self.outputs = []

    def __call__(self, module, inputs, output):
        self.outputs.append(output.detach())


def test_a_forward_hook_keeping_an_activation_is_refused_and_undone(fake_mesh):
    ACTIVATIONS[:] = []
    model = _mlp()
    model[0].register_forward_hook(_keep_activation)
    with pytest.raises(spmd.TraceError, match="global ACTIVATIONS of test_side_effects"):
        _call(fake_mesh, _train, model)
    assert ACTIVATIONS == []  # no placeholder (FakeTensor) left in the user's list


def test_a_hook_object_keeping_an_activation_is_refused_and_undone(fake_mesh):
    model, recorder = _mlp(), ActivationRecorder()
    model[2].register_forward_hook(recorder)
    with pytest.raises(spmd.TraceError, match=r"the hook object ActivationRecorder\.outputs"):
        _call(fake_mesh, _train, model)
    assert recorder.outputs == []


@pytest.mark.parametrize("where", ["forward", "step"])
def test_a_counting_hook_is_kept_and_reported(fake_mesh, where):
    HOOK_CALLS.update(forward=0, step=0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if where == "forward":
        model[0].register_forward_hook(_count_forward)
    else:
        optimizer.register_step_post_hook(_count_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(fake_mesh, _train)(model, optimizer, torch.randn(8, 8))
    assert HOOK_CALLS[where] == 1
    assert any(f"global HOOK_CALLS of test_side_effects ('{where}': 0 -> 1)" in str(w.message) for w in caught)


def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param.detach()


def _updates_follow(fake_mesh, model, weight, set_scale, scales=(1.0, 0.0), step_fn=_train, args=()):
    """Call the compiled step (``step_fn(model, optimizer, x, *args)``) once per value in ``scales``
    (set by ``set_scale``, a value the traced Python reads): ``weight`` moves where the value is not 0
    and stays where it is 0, so each call ran a graph traced with its value. Returns the compiled step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _compiled(fake_mesh, step_fn)
    x = torch.randn(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for scale in scales:
                set_scale(scale)
                before = _local(weight).clone()
                step(model, optimizer, x, *args)
                assert (not torch.equal(_local(weight), before)) == (scale != 0.0), scale
        finally:
            set_scale(1.0)
    return step


def _set_global(name):
    return lambda value: globals().__setitem__(name, value)


def test_a_float_a_gradient_hook_reads_is_a_graph_input(fake_mesh):
    """``lambda g: g * SCALE`` with SCALE a float global: a graph input (as a float argument is), so
    one graph serves every value, and the updates follow the value (SCALE 0 leaves the weight as it is)."""
    model = _mlp()
    model[0].weight.register_hook(_scale_gradient)
    step = _updates_follow(fake_mesh, model, model[0].weight, _set_global("GRADIENT_SCALE"), (1.0, 0.0, 0.0, 1.0))
    assert sum(map(len, step.cache.values())) == 1


class GradientScaler:
    """A callable gradient hook whose setting lives on the object."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, grad):
        return grad * self.scale


def test_an_attribute_a_hook_object_reads_is_guarded(fake_mesh):
    model, scaler = _mlp(), GradientScaler()
    model[0].weight.register_hook(scaler)
    _updates_follow(fake_mesh, model, model[0].weight, lambda value: setattr(scaler, "scale", value))


# Methods reached through an attribute (self.helper(x), model.compute_loss(...)), not a global: the
# globals they read are guarded as the forward's own.
HELPER_SCALE = 1.0


class WithHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def scaled(self, h):
        return h * HELPER_SCALE

    def forward(self, x):
        return self.fc2(self.scaled(self.fc1(x)))

    def compute_loss(self, x):
        return self(x).pow(2).mean() * HELPER_SCALE


def _train_with_method(model, optimizer, x):
    loss = model.compute_loss(x)
    return _update(loss, optimizer)


@pytest.mark.parametrize("called_from", ["forward", "step"])
def test_a_float_a_method_reads_is_a_graph_input(fake_mesh, called_from):
    """HELPER_SCALE 0 stops fc1's updates (read in ``forward``'s ``self.scaled``) or every update (read
    in ``model.compute_loss``, which the step calls): the methods' code is followed, and the float
    global they read is a graph input (one graph for every value)."""
    model = WithHelpers()
    step_fn = _train_with_method if called_from == "step" else _train
    step = _updates_follow(fake_mesh, model, model.fc1.weight, _set_global("HELPER_SCALE"), (1.0, 0.0, 1.0), step_fn)
    assert sum(map(len, step.cache.values())) == 1
    assert "global HELPER_SCALE of test_side_effects" in [str(hp) for hp in step.last.traced.hyperparameters]


def _scale_by_global(h):
    return h * HELPER_SCALE


class ScaleByGlobal:
    """A user callable object (an activation or loss object a model holds or a global names)."""

    def __call__(self, h):
        return h * HELPER_SCALE


GLOBAL_ACTIVATION = ScaleByGlobal()
GLOBAL_PARTIAL = functools.partial(_scale_by_global)


class HoldsActivation(WithHelpers):
    def __init__(self, activation):
        super().__init__()
        self.activation = activation

    def forward(self, x):
        act = self.activation if self.activation is not None else GLOBAL_ACTIVATION
        return self.fc2(act(self.fc1(x)))


class CallsGlobalPartial(WithHelpers):
    def forward(self, x):
        return self.fc2(GLOBAL_PARTIAL(self.fc1(x)))


@pytest.mark.parametrize("held", ["attribute_function", "attribute_object", "global_object", "global_partial", "decorated_function"])
def test_a_value_a_held_callable_reads_is_guarded(fake_mesh, held):
    """The callable a module holds as an attribute, or a global names (a user object's ``__call__``, a
    ``functools.partial``), reads HELPER_SCALE: 0 stops fc1's updates."""
    model = {
        "attribute_function": lambda: HoldsActivation(_scale_by_global),
        "attribute_object": lambda: HoldsActivation(ScaleByGlobal()),
        "global_object": lambda: HoldsActivation(None),
        "global_partial": CallsGlobalPartial,
        "decorated_function": CallsDecorated,
    }[held]()
    _updates_follow(fake_mesh, model, model.fc1.weight, _set_global("HELPER_SCALE"))



@torch.no_grad()
def _no_grad_scale():
    return HELPER_SCALE


class CallsDecorated(WithHelpers):
    """Calls a function behind a library decorator (``@torch.no_grad()`` wraps it in torch's code)."""

    def forward(self, x):
        return self.fc2(self.fc1(x) * _no_grad_scale())


class ReverseGradient(torch.autograd.Function):
    """Gradient reversal (Ganin and Lempitsky, 2015) scaled by a global, as domain-adaptation code
    schedules it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * HELPER_SCALE


class ReversesGradient(WithHelpers):
    def forward(self, x):
        return self.fc2(ReverseGradient.apply(self.fc1(x)))


def test_a_value_an_autograd_function_reads_is_guarded(fake_mesh):
    """``ReverseGradient.apply`` runs its class's ``backward``, which reads HELPER_SCALE: 0 stops fc1's
    updates."""
    model = ReversesGradient()
    _updates_follow(fake_mesh, model, model.fc1.weight, _set_global("HELPER_SCALE"))


_PROJECT_STEP = '''
import torch.nn.functional as F

SCALE = 1.0


def step(model, optimizer, x):
    loss = model(x).pow(2).mean() * SCALE
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss
'''


def test_user_code_in_a_directory_named_spmd_expand_is_the_users(fake_mesh, tmp_path):
    """A checkout of this project (or any project) called ``spmd_expand``: the step written there is
    the user's code, whose values are guarded, not spmd_expand's own (which a path substring said)."""
    import importlib.util

    from spmd_expand.errors import in_torch_or_spmd_expand

    path = tmp_path / "spmd_expand" / "train_step.py"
    path.parent.mkdir()
    path.write_text(_PROJECT_STEP)
    spec = importlib.util.spec_from_file_location("project_train_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not in_torch_or_spmd_expand(str(path))
    assert in_torch_or_spmd_expand(spmd.__file__) and in_torch_or_spmd_expand(torch.__file__)
    model = _mlp()
    _updates_follow(fake_mesh, model, model[0].weight, lambda value: setattr(module, "SCALE", value), step_fn=module.step)


class NotebookRecorder(ActivationRecorder):
    """Defined in a notebook: its module is ``__main__``, which has no file there (here, ``__main__``
    is pytest's, whose file is library code)."""


NotebookRecorder.__module__ = "__main__"


def test_a_hook_object_of_a_notebook_class_is_the_users(fake_mesh):
    model, recorder = _mlp(), NotebookRecorder()
    model[2].register_forward_hook(recorder)
    with pytest.raises(spmd.TraceError, match=r"the hook object NotebookRecorder\.outputs"):
        _call(fake_mesh, _train, model)
    assert recorder.outputs == []


_PROJECT_CONFIG = '''
SCALE = 1.0


def scale(h):
    return h * SCALE
'''


class ReadsConfigModule(WithHelpers):
    def __init__(self, through_function):
        super().__init__()
        self.through_function = through_function

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(PROJECT_CONFIG.scale(h) if self.through_function else h * PROJECT_CONFIG.SCALE)


PROJECT_CONFIG = None  # the user's module, loaded by the test


@pytest.mark.parametrize("through_function", [False, True], ids=["attribute", "function"])
def test_a_value_a_user_module_holds_is_guarded(fake_mesh, tmp_path, through_function):
    """``import config`` then ``config.SCALE`` (or ``config.scale(h)``, which reads its module's
    SCALE) in a forward: a user module's attributes are followed as globals are."""
    import importlib.util

    global PROJECT_CONFIG
    path = tmp_path / "project_config.py"
    path.write_text(_PROJECT_CONFIG)
    spec = importlib.util.spec_from_file_location("project_config", path)
    PROJECT_CONFIG = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(PROJECT_CONFIG)
    model = ReadsConfigModule(through_function)
    _updates_follow(fake_mesh, model, model.fc1.weight, lambda value: setattr(PROJECT_CONFIG, "SCALE", value))


class LossComputer:
    """A user object the step calls a method of (a trainer's ``compute_loss``), reached through a global."""

    def weighted(self, loss):
        return loss * HELPER_SCALE


LOSS_COMPUTER = LossComputer()


def _train_with_global_object(model, optimizer, x):
    loss = LOSS_COMPUTER.weighted(model(x).pow(2).mean())
    return _update(loss, optimizer)


def test_a_value_a_global_objects_method_reads_is_guarded(fake_mesh):
    model = _mlp()
    _updates_follow(fake_mesh, model, model[0].weight, _set_global("HELPER_SCALE"), step_fn=_train_with_global_object)


class LossRecorder:
    """A user object a module holds (``self.criterion = ...``) that keeps each loss it computes."""

    def __init__(self):
        self.history = []

    def __call__(self, out):
        loss = out.pow(2).mean()
        self.history.append(loss.detach())
        return loss


class HoldsRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.criterion = LossRecorder()

    def forward(self, x):
        return self.criterion(self.fc(x))


def test_a_tensor_kept_by_an_object_a_module_holds_is_undone_with_a_warning(fake_mesh):
    model = HoldsRecorder()
    messages = _call(fake_mesh, cases.scalar_step, model)
    assert model.criterion.history == []  # no placeholder (FakeTensor) left behind
    assert any("model.criterion.history (0 -> 1 items)" in m and "undone" in m for m in messages), messages


# Modules outside the model: a loss module a global or a default argument holds, whose setting a
# schedule changes between calls.
class ScaledMSE(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, out):
        return out.pow(2).mean() * self.scale


CRITERION = ScaledMSE()


def _train_with_global_criterion(model, optimizer, x):
    loss = CRITERION(model(x))
    return _update(loss, optimizer)


def _train_with_default_criterion(model, optimizer, x, criterion=ScaledMSE()):
    loss = criterion(model(x))
    return _update(loss, optimizer)


@pytest.mark.parametrize("held_by", ["global", "default argument"])
def test_an_attribute_of_a_loss_module_outside_the_model_is_guarded(fake_mesh, held_by):
    model = _mlp()
    if held_by == "global":
        step_fn, criterion = _train_with_global_criterion, CRITERION
    else:
        step_fn, criterion = _train_with_default_criterion, _train_with_default_criterion.__defaults__[0]
    _updates_follow(fake_mesh, model, model[0].weight, lambda value: setattr(criterion, "scale", value), step_fn=step_fn)


class Options:
    """A plain object passed to the step: its repr names its address, not its values."""

    def __init__(self):
        self.scale = 1.0


def _train_with_options(model, optimizer, x, options):
    loss = model(x).pow(2).mean() * options.scale
    return _update(loss, optimizer)


def test_an_attribute_of_an_object_passed_to_the_step_is_part_of_the_cache_key(fake_mesh):
    model, options = _mlp(), Options()
    _updates_follow(
        fake_mesh, model, model[0].weight, lambda value: setattr(options, "scale", value), step_fn=_train_with_options, args=(options,)
    )


# Values read through a class or a global list: no instance attribute read records them.
class ClassScaled(nn.Module):
    SCALE = 1.0

    def __init__(self, read):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.read = read

    def forward(self, x):
        if self.read == "class name":
            scale = ClassScaled.SCALE
        elif self.read == "type(self)":
            scale = type(self).SCALE
        else:
            scale = self.__class__.SCALE
        return self.fc(x) * scale


@pytest.mark.parametrize("read", ["class name", "type(self)", "self.__class__"])
def test_a_class_attribute_read_through_the_class_is_guarded(fake_mesh, read):
    model = ClassScaled(read)
    _updates_follow(fake_mesh, model, model.fc.weight, lambda value: setattr(ClassScaled, "SCALE", value))


class Setting:
    def __init__(self):
        self.scale = 1.0


SETTINGS = [Setting()]


class ListScaled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * SETTINGS[0].scale


def test_an_attribute_of_an_object_in_a_global_list_is_guarded(fake_mesh):
    model = ListScaled()
    _updates_follow(fake_mesh, model, model.fc.weight, lambda value: setattr(SETTINGS[0], "scale", value))


# Settings objects inside settings objects: a trainer's args, a nested config.
class NestedTrainer:
    def __init__(self):
        self.args = argparse.Namespace(scale=1.0)

    def train_step(self, model, optimizer, x):
        loss = model(x).pow(2).mean() * self.args.scale
        return _update(loss, optimizer)


NESTED_CONFIG = SimpleNamespace(optim=SimpleNamespace(scale=1.0))


def _train_with_nested_config(model, optimizer, x):
    loss = model(x).pow(2).mean() * NESTED_CONFIG.optim.scale
    return _update(loss, optimizer)


class NestedConfigured(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.cfg = argparse.Namespace(head=argparse.Namespace(scale=1.0))

    def forward(self, x):
        return self.fc(x) * self.cfg.head.scale


@pytest.mark.parametrize("held_by", ["trainer.args", "global config.optim", "module self.cfg.head"])
def test_an_attribute_of_a_nested_settings_object_is_guarded(fake_mesh, held_by):
    if held_by == "trainer.args":
        model, trainer = _mlp(), NestedTrainer()
        _updates_follow(fake_mesh, model, model[0].weight, lambda v: setattr(trainer.args, "scale", v), step_fn=trainer.train_step)
    elif held_by == "global config.optim":
        model = _mlp()
        _updates_follow(fake_mesh, model, model[0].weight, lambda v: setattr(NESTED_CONFIG.optim, "scale", v), step_fn=_train_with_nested_config)
    else:
        model = NestedConfigured()
        _updates_follow(fake_mesh, model, model.fc.weight, lambda v: setattr(model.cfg.head, "scale", v))


# A global read through a chain of helpers deeper than the four calls once followed.
DEEP_SCALE = 1.0


def _deep5(h):
    return h * DEEP_SCALE


def _deep4(h):
    return _deep5(h)


def _deep3(h):
    return _deep4(h)


def _deep2(h):
    return _deep3(h)


def _deep1(h):
    return _deep2(h)


class DeepHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return _deep1(self.fc(x))


def test_a_global_read_five_helpers_deep_is_guarded(fake_mesh):
    model = DeepHelpers()
    _updates_follow(fake_mesh, model, model.fc.weight, _set_global("DEEP_SCALE"))


class ForwardingOptimizer(torch.optim.Optimizer):
    """A wrapper that steps its base optimizer and does not call ``Optimizer.__init__``."""

    def __init__(self, base):
        self.base, self.param_groups, self.defaults = base, base.param_groups, base.defaults
        self.state = collections.defaultdict(dict)

    def step(self, closure=None):
        return self.base.step(closure)

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)


def _zero_parameters(optimizer, args, kwargs):
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.zero_()


def test_a_step_hook_added_to_a_wrapped_optimizer_compiles_again(fake_mesh):
    model = _mlp()
    optimizer = ForwardingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step = _compiled(fake_mesh, _train)
    step(model, optimizer, torch.randn(8, 8))
    optimizer.base.register_step_post_hook(_zero_parameters)
    step(model, optimizer, torch.randn(8, 8))
    assert sum(map(len, step.cache.values())) == 2
    assert not _local(model[0].weight).any()


# A function the step runs, held by a global, an object or a module, given another between calls.
def _full_loss(out):
    return out.pow(2).mean()


def _no_loss(out):
    return out.pow(2).mean() * 0.0


LOSS_FUNCTION = _full_loss
LOSS_HOLDER = SimpleNamespace(loss=_full_loss)


def _train_with_global_function(model, optimizer, x):
    loss = LOSS_FUNCTION(model(x))
    return _update(loss, optimizer)


def _train_with_held_function(model, optimizer, x):
    loss = LOSS_HOLDER.loss(model(x))
    return _update(loss, optimizer)


class Activated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.act = torch.tanh

    def forward(self, x):
        return self.act(self.fc(x))


def _zeroed(h):
    return h * 0.0


def _function_for(scale):
    return _full_loss if scale else _no_loss


@pytest.mark.parametrize("held_by", ["global", "object", "module"])
def test_a_function_given_another_between_calls_compiles_again(fake_mesh, held_by):
    if held_by == "module":
        model = Activated()
        # _zeroed as the activation: a zero gradient reaches the weight.
        set_scale = lambda v: setattr(model, "act", torch.tanh if v else _zeroed)  # noqa: E731
        step = _updates_follow(fake_mesh, model, model.fc.weight, set_scale, (1.0, 0.0, 1.0))
    else:
        model = _mlp()
        if held_by == "global":
            set_scale, step_fn = lambda v: globals().__setitem__("LOSS_FUNCTION", _function_for(v)), _train_with_global_function
        else:
            set_scale, step_fn = lambda v: setattr(LOSS_HOLDER, "loss", _function_for(v)), _train_with_held_function
        step = _updates_follow(fake_mesh, model, model[0].weight, set_scale, (1.0, 0.0, 1.0), step_fn=step_fn)
    assert sum(map(len, step.cache.values())) == 2
