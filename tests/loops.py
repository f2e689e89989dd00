"""Training-loop idioms run compiled on W ranks and eagerly on one device, side by side.

Each scenario trains a compiled copy and a reference copy of the same model for several steps, doing
the same thing to both between steps (an LR scheduler step, a hyperparameter change, ``train()`` /
``eval()``, freezing, a new optimizer, ...), and returns both sets of results for the test process to
compare. ``run_scenarios`` is the worker for ``spmd_expand.app.launch.run_local``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import traceback
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_expand as spmd
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice
from spmd_expand.prologue import PrologueRunner

STEPS = 4
BATCH = 8


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class TwoLayer(nn.Module):
    """An MLP whose forward depends on ``self.training`` (as dropout or BatchNorm would)."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h * 0.5 if self.training else h)


class LearnableTemperature(TwoLayer):
    """0-d parameters: CLIP's learnable ``logit_scale`` (used through ``exp()``) and the magnitude of
    a weight-normed layer (``parametrizations.weight_norm(dim=None)``): their Adam states are 0-d too."""

    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        torch.nn.utils.parametrizations.weight_norm(self.fc2, dim=None)

    def forward(self, x):
        return super().forward(x) * self.logit_scale.exp()


class PureBf16(TwoLayer):
    """:class:`TwoLayer` with bfloat16 parameters (``model.bfloat16()``, as LLM fine-tuning scripts do):
    its optimizer states are bfloat16 too. Float32 batches are cast on the way in, logits on the way out."""

    def __init__(self):
        super().__init__()
        self.bfloat16()

    def forward(self, x):
        return super().forward(x.bfloat16()).float()


def classification_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def zero_grad_first_step(model, optimizer, x, y):
    """``model.zero_grad()`` before forward (the order many loops use), no zero_grad at the end."""
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def optimizer_zero_grad_first_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def zero_grad_keep_step(model, optimizer, x, y):
    """``zero_grad(set_to_none=False)``: gradients stay allocated (zeros) between calls."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss


def grads_step(model, optimizer, x, y):
    """Returns the gradients read through the module: ``[p.grad for p in model.parameters()]``."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    return loss, grads


def clip_norm_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def clip_value_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def contrastive_step(model, optimizer, x, y):
    """CLIP/SimCLR's symmetric InfoNCE loss: every row is scored against every other row of the batch."""
    z = F.normalize(model(x), dim=-1)
    w = F.normalize(model(x.flip(-1)), dim=-1)
    logits = z @ w.T / 0.1
    labels = torch.arange(x.shape[0])
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mixup_step(model, optimizer, x, y):
    """mixup inside the step: each row is mixed with a row a random permutation of the batch picks."""
    perm = torch.randperm(x.shape[0])
    out = model(0.7 * x + 0.3 * x[perm])
    loss = 0.7 * F.cross_entropy(out, y) + 0.3 * F.cross_entropy(out, y[perm])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def manual_sgd_step(model, optimizer, x, y):
    """The tutorial update, without an optimizer: ``p -= lr * p.grad`` under no_grad."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return loss


def data_update_step(model, optimizer, x, y):
    """The old idiom: ``p.data.add_(p.grad.data, alpha=-lr)``."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad.data, alpha=-0.1)
        p.grad.zero_()
    return loss


def data_assignment_step(model, optimizer, x, y):
    """The old tutorial update, assigning ``.data`` (a storage swap make_fx does not record)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data = p.data - 0.1 * p.grad
        p.grad = None
    return loss


def flat_vector_then_step(model, optimizer, x, y):
    """Weights shrunk as one flat vector (``vector_to_parameters``: each parameter becomes a slice of
    ``flat``), then an optimizer step that writes them: ``flat`` changes too on one device, but nothing
    reads it afterwards."""
    params = list(model.parameters())
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(params) * 0.99
        torch.nn.utils.vector_to_parameters(flat, params)
    return classification_step(model, optimizer, x, y)


def data_assigned_then_written_step(model, optimizer, x, y):
    """``p.data = buf`` and then an in-place write to ``buf``: on one device ``p`` and ``buf`` are one
    tensor after the assignment, so ``p`` sees the write."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            buf = p.detach().clone() * 0.5
            p.data = buf
            buf.add_(0.25)
    return loss


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization (Foret et al. 2021) as its widely used PyTorch implementation
    (davda54/sam) writes it: ``first_step`` climbs to ``w + e(w)`` keeping ``w`` in ``state["old_p"]``,
    ``second_step`` goes back with ``p.data = state["old_p"]`` and lets the base optimizer update ``p``
    in place, which on one device updates ``old_p`` too (they are one tensor after the assignment)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for g in self.param_groups for p in g["params"] if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def sam_step(model, optimizer, x, y):
    F.cross_entropy(model(x), y).backward()
    optimizer.first_step(zero_grad=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.second_step(zero_grad=True)
    return loss


def grad_data_clamp_step(model, optimizer, x, y):
    """Gradient clipping by assigning the gradient's ``.data``, then an optimizer step."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.grad.data = torch.clamp(p.grad.data, -0.01, 0.01)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def flat_vector_step(model, optimizer, x, y):
    """An update of all parameters as one flat vector (TRPO, evolution strategies):
    ``vector_to_parameters`` assigns each parameter's ``.data``."""
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    flat = torch.nn.utils.parameters_to_vector(params) - 0.1 * torch.nn.utils.parameters_to_vector(grads)
    torch.nn.utils.vector_to_parameters(flat, params)
    return loss


def adversarial_step(model, optimizer, x, y):
    """PGD adversarial training (Madry et al. 2018, as its public implementations write it): a random
    start, three signed-gradient ascent steps on the input perturbation, each assigned through
    ``delta.data`` and clamped, then the model's update on the perturbed batch."""
    eps, alpha = 0.1, 0.04
    delta = torch.zeros_like(x).uniform_(-eps, eps)
    delta.requires_grad = True
    for _ in range(3):
        F.cross_entropy(model(x + delta), y).backward()
        delta.data = (delta + alpha * delta.grad.sign()).clamp(-eps, eps)
        delta.grad.zero_()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x + delta.detach()), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def two_backward_step(model, optimizer, x, y):
    """Two losses, two backward calls (``retain_graph``): their gradients add up."""
    out = model(x)
    main, aux = F.cross_entropy(out, y), out.square().mean()
    main.backward(retain_graph=True)
    aux.backward()
    optimizer.step()
    optimizer.zero_grad()
    return main + aux


def gradient_penalty_step(model, optimizer, x, y):
    """A gradient penalty on the input (WGAN-GP style): ``autograd.grad(create_graph=True)``, then
    backward through it."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.cross_entropy(out, y) + 0.1 * g.square().sum(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def closure_step(model, optimizer, x, y):
    """``optimizer.step(closure)``: forward and backward run inside the optimizer's step."""

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return optimizer.step(closure)


def explicit_gradient_step(model, optimizer, x, y):
    """``out.backward(gradient=...)`` of a non-scalar output."""
    out = model(x)
    out.backward(gradient=torch.full_like(out, 0.1))
    optimizer.step()
    optimizer.zero_grad()
    return out.sum()


def mixup_argument_step(model, optimizer, x, y, lam):
    """mixup with its coefficient drawn outside the step (``lam = np.random.beta(a, a)`` in the loop) and
    passed in: a Python float that changes on every call."""
    out = model(lam * x + (1 - lam) * x.flip(0))
    loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y.flip(0))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class StudentTeacher(nn.Module):
    """BYOL/DINO/MoCo: a teacher without gradients that follows the student as an exponential moving
    average; ``momentum`` follows a schedule, passed to the step each call."""

    def __init__(self):
        super().__init__()
        self.student = TwoLayer()
        self.teacher = TwoLayer().requires_grad_(False)


def ema_teacher_step(model, optimizer, x, y, momentum):
    s = model.student(x)
    with torch.no_grad():
        t = model.teacher(x)
    loss = (F.normalize(s, dim=-1) - F.normalize(t, dim=-1)).pow(2).sum(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for ps, pt in zip(model.student.parameters(), model.teacher.parameters()):
            pt.mul_(momentum).add_(ps.detach(), alpha=1 - momentum)
    return loss


def _momentum_schedule(i):
    return (1 - 0.5 * (math.cos(math.pi * i / 4) + 1) * 0.1,)


def _batch(i: int, rows: int = BATCH):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g)


def _refusal(call: Callable[[], object]) -> str:
    """What ``call()`` raised, as ``"<SpmdError subclass>: <message>"``, or ``"no error"``."""
    try:
        call()
    except spmd.SpmdError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def run_loop(
    mesh,
    plan,
    *,
    model_fn: Callable[[], nn.Module] = TwoLayer,
    optimizer_fn: Callable = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    step: Callable = classification_step,
    between: Optional[Callable] = None,
    steps: int = STEPS,
    lower: str = "eager",
    arguments: Optional[Callable[[int], tuple]] = None,
) -> dict:
    """Train compiled and reference copies for ``steps`` calls; ``between(i, pair)`` runs before call i
    on both ``pair = {"model", "optimizer"}`` dicts (it may replace either object); ``arguments(i)``
    are the step's arguments after the batch in call i."""
    torch.manual_seed(0)
    model = model_fn()
    ref_model = copy.deepcopy(model)
    compiled_pair = {"model": model, "optimizer": optimizer_fn(model.parameters())}
    ref_pair = {"model": ref_model, "optimizer": optimizer_fn(ref_model.parameters())}
    compiled = spmd.compile(mesh=mesh, plan=plan, lower=lower)(step)

    def shard(*batch):
        resolved = resolve_plan(plan, mesh, getattr(compiled_pair["model"], "_orig_mod", compiled_pair["model"]))
        return [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]

    # What ``between`` needs to run a second step of its own (an evaluation), compiled on one side.
    compiled_pair.update(compile=spmd.compile(mesh=mesh, plan=plan, lower=lower), shard=shard, evals=[])
    ref_pair.update(compile=lambda fn: fn, shard=lambda *batch: batch, evals=[])
    outs, ref_outs = [], []
    for i in range(steps):
        if between is not None:
            between(i, compiled_pair)
            between(i, ref_pair)
        x, y = _batch(i)
        local = shard(x, y)
        torch.manual_seed(100 + i)  # steps that draw (a mixup permutation) draw the same on both sides
        extra = arguments(i) if arguments is not None else ()
        outs.append(compiled(compiled_pair["model"], compiled_pair["optimizer"], *local, *extra))
        torch.manual_seed(100 + i)
        ref_outs.append(step(ref_pair["model"], ref_pair["optimizer"], x, y, *extra))

    def states(pair):
        # An optimizer wrapper's (Lookahead's) and its base optimizer's.
        optimizer = pair["optimizer"]
        holders = {"": optimizer, **{f"{a}.": v for a, v in vars(optimizer).items() if isinstance(v, torch.optim.Optimizer)}}
        return {
            f"{k}.{h}{s}": _full(t).detach().clone()
            for k, p in pair["model"].named_parameters()
            for h, o in holders.items()
            for s, t in o.state.get(p, {}).items()
            if isinstance(t, torch.Tensor)
        }

    return {
        "outs": outs,
        "ref_outs": ref_outs,
        "params": {k: _full(v).detach().clone() for k, v in compiled_pair["model"].named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in ref_pair["model"].named_parameters()},
        "buffers": {k: _full(v).detach().clone() for k, v in compiled_pair["model"].named_buffers()},
        "ref_buffers": {k: v.detach().clone() for k, v in ref_pair["model"].named_buffers()},
        "states": states(compiled_pair),
        "ref_states": states(ref_pair),
        "compilations": sum(len(v) for v in compiled.cache.values()),
        # Inductor compilations of those graphs (more than one: a float input held as a constant changed).
        "inductor_compilations": sum(_inductor_compilations(a.runner) for v in compiled.cache.values() for a in v),
        "evals": compiled_pair["evals"],
        "ref_evals": ref_pair["evals"],
    }


def _inductor_compilations(runner) -> int:
    """How many times Inductor compiled one graph (a split graph: each of its parts, the most)."""
    parts = [runner.prologue, runner.rest] if isinstance(runner, PrologueRunner) else [runner]
    return max(len(getattr(getattr(p, "runner", p), "_compiled", ())) for p in parts)


# ---------------------------------------------------------------- what changes between calls
def set_lr(i, pair):
    for g in pair["optimizer"].param_groups:
        g["lr"] = 1e-2 * (i + 1)


def change_hyperparameters(i, pair):
    g = pair["optimizer"].param_groups[0]
    g["betas"] = (0.9 - 0.05 * i, 0.999 - 0.001 * i)
    g["weight_decay"] = 0.1 + 0.05 * i
    g["eps"] = 1e-8 * (i + 1)


def change_momentum(i, pair):
    g = pair["optimizer"].param_groups[0]
    g["momentum"] = 0.5 + 0.1 * i
    g["lr"] = 0.05 + 0.01 * i


def scheduler(make: Callable) -> Callable:
    """Create the scheduler before the first call and step it after every call (as a loop does)."""

    def between(i, pair):
        if i == 0:
            pair["scheduler"] = make(pair["optimizer"])
        else:
            pair["scheduler"].step()

    return between


def toggle_train_eval(i, pair):
    pair["model"].train(i % 2 == 0)


def freeze_unfreeze(i, pair):
    pair["model"].fc1.weight.requires_grad_(i not in (1, 2))


def eval_loss_and_logits(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def evaluation(no_grad_context: Callable) -> Callable:
    """A compiled evaluation step run under ``no_grad_context`` before the first training call and
    after the second, in eval mode (as a validation loop does)."""

    def between(i, pair):
        if i not in (0, 2):
            return
        if "evaluate" not in pair:
            pair["evaluate"] = pair["compile"](eval_loss_and_logits)
        pair["model"].eval()
        with no_grad_context():
            loss, logits = pair["evaluate"](pair["model"], *pair["shard"](*_batch(50 + i)))
        pair["model"].train()
        pair["evals"] += [loss.detach().clone(), logits.detach().clone()]

    return between


def new_optimizer(i, pair):
    if i == 2:
        pair["optimizer"] = torch.optim.SGD(pair["model"].parameters(), lr=0.05, momentum=0.9)


def new_model(i, pair):
    if i == 2:
        torch.manual_seed(7)
        pair["model"] = TwoLayer()
        pair["optimizer"] = torch.optim.AdamW(pair["model"].parameters(), lr=1e-2)


def _torch_compiled() -> nn.Module:
    """nanoGPT's `model = torch.compile(model)` before the training step is written."""
    return torch.compile(TwoLayer(), backend="eager")


class CompiledBlock(TwoLayer):
    """A submodule compiled on its own (`module.compile()`)."""

    def __init__(self):
        super().__init__()
        self.fc1.compile(backend="eager")


class EmaCodebook(nn.Module):
    """VQ-VAE with an EMA codebook (van den Oord et al. 2017, appendix): a frozen ``nn.Parameter``
    that forward updates in training through ``.data =`` from the batch's code assignments."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.codebook = nn.Parameter(torch.randn(6, 8), requires_grad=False)
        self.register_buffer("cluster_size", torch.ones(6))
        self.dec = nn.Linear(8, 4)

    def forward(self, x):
        z = self.enc(x)
        codes = F.one_hot(((z[:, None, :] - self.codebook[None]) ** 2).sum(-1).argmin(1), 6).to(z.dtype)
        q = codes @ self.codebook
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(0.9).add_(codes.sum(0), alpha=0.1)
                means = (codes.t() @ z) / (self.cluster_size[:, None] + 1e-5)
                self.codebook.data = 0.9 * self.codebook.data + 0.1 * means
        return self.dec(z + (q - z).detach())  # straight-through


class Tempered(TwoLayer):
    """Reads a Python float attribute in forward (a temperature a curriculum changes); ``seen`` is a
    counter the loop keeps on the module and forward never reads."""

    def __init__(self):
        super().__init__()
        self.temperature = 1.0
        self.seen = 0

    def forward(self, x):
        return super().forward(x) / self.temperature


def change_temperature(i, pair):
    pair["model"].temperature = 1.0 + 0.5 * (i % 2)  # 1.0, 1.5, 1.0, 1.5: a graph input, one graph


def count_steps(i, pair):
    pair["model"].seen += 1  # not read by the step: no new graph


def train_mode_step(model, optimizer, x, y):
    model.train()  # the step sets its own mode, as many training loops' train functions do
    return classification_step(model, optimizer, x, y)


def eval_mode_step(model, x, y):
    model.eval()
    return eval_loss_and_logits(model, x, y)


def evaluate_setting_its_own_mode(i, pair):
    """Before each training call: the mode the last call left, a compiled evaluation that sets eval
    mode itself, and the mode it left (recorded as tensors, compared with one device's)."""
    if "evaluate" not in pair:
        pair["evaluate"] = pair["compile"](eval_mode_step)
    pair["evals"].append(torch.tensor(float(pair["model"].training)))
    with torch.no_grad():
        loss, logits = pair["evaluate"](pair["model"], *pair["shard"](*_batch(50 + i)))
    pair["evals"] += [loss.detach().clone(), logits.detach().clone(), torch.tensor(float(pair["model"].training))]


def load_full_state_dict(i, pair):
    """``model.load_state_dict`` and ``optimizer.load_state_dict`` of a single-device checkpoint
    (plain full tensors, as ``torch.save`` of an unwrapped model's and its optimizer's state dicts
    wrote them) after two calls: on the compiled side the parameters are DTensors by then. The loaded
    model dict itself is left as it was."""
    if i != 2:
        return
    torch.manual_seed(5)
    model = TwoLayer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    checkpoint = model.state_dict()
    kept = {k: v.clone() for k, v in checkpoint.items()}
    pair["model"].load_state_dict(checkpoint)
    pair["optimizer"].load_state_dict(optimizer.state_dict())
    assert all(type(v) is torch.Tensor and torch.equal(v, kept[k]) for k, v in checkpoint.items())


class TiedSquare(nn.Module):
    """Two square layers sharing one weight (``fc2.weight = fc1.weight``: a tied embedding and head's
    layout), whose state dict names the shared tensor twice."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def load_tied_state_dict(i, pair):
    """:func:`load_full_state_dict` for :class:`TiedSquare`: both names of the shared weight are loaded
    (``best.pt`` of a one-device run of a GPT with a tied head)."""
    if i != 2:
        return
    torch.manual_seed(5)
    pair["model"].load_state_dict(TiedSquare().state_dict())


LOSS_SCALE = 1.0  # a global the step reads


def global_scale_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y) * LOSS_SCALE
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def change_global_scale(i, pair):
    global LOSS_SCALE
    LOSS_SCALE = 2.0 if i >= 2 else 1.0  # 1, 1, 2, 2: a graph input, one graph


class HFStudent(nn.Module):
    """A user's wrapper around a HuggingFace classifier (a tiny ``BertForSequenceClassification`` fed
    the batch as 2 embeddings of 8) with a softmax temperature a curriculum anneals."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=4,
        )
        self.bert = transformers.BertForSequenceClassification(config)
        # Fed embeddings, the token embedding table is unused: frozen and left out of the optimizer.
        self.bert.bert.embeddings.word_embeddings.weight.requires_grad_(False)
        self.temperature = 2.0

    def forward(self, x):
        return self.bert(inputs_embeds=x.view(x.shape[0], 2, 8)).logits / self.temperature


DISTILLATION_WEIGHT = 0.0  # a global the loop anneals
DISTILLATION_ARGS = argparse.Namespace(aux_weight=0.1, epochs=3)


def distillation_step(model, optimizer, x, y):
    """Knowledge distillation (Hinton et al. 2015) as scripts write it: hard-label cross entropy and a
    KL term to a teacher's logits (here the batch's first 4 features), mixed by a global weight, plus a
    logit penalty weighted by ``args.aux_weight``."""
    logits = model(x)
    kl = F.kl_div(F.log_softmax(logits, -1), F.softmax(x[:, :4], -1), reduction="batchmean")
    loss = (1 - DISTILLATION_WEIGHT) * F.cross_entropy(logits, y) + DISTILLATION_WEIGHT * kl
    loss = loss + DISTILLATION_ARGS.aux_weight * logits.square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def anneal_distillation(i, pair):
    """Every float the step reads changes before every call: a global, a namespace's, the model's."""
    global DISTILLATION_WEIGHT
    DISTILLATION_WEIGHT = min(1.0, 0.3 * i)
    DISTILLATION_ARGS.aux_weight = 0.1 / (i + 1)
    pair["model"].temperature = 2.0 - 0.25 * i


# A class-weighted loss in a global criterion and a frozen module a loss term runs (a perceptual or
# feature-matching loss), neither of them the model's: tensors the step reads from elsewhere, graph
# inputs read on every call.
CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 1.0])
WEIGHTED_CRITERION = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS)
FROZEN_PROBE = nn.Linear(4, 3).requires_grad_(False)


def global_tensors_step(model, optimizer, x, y):
    out = model(x)
    loss = WEIGHTED_CRITERION(out, y) + 0.1 * FROZEN_PROBE(out).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def change_global_tensors(i, pair):
    if i == 0:
        WEIGHTED_CRITERION.weight = CLASS_WEIGHTS
        CLASS_WEIGHTS.copy_(torch.tensor([1.0, 2.0, 0.5, 1.0]))
        with torch.no_grad():  # (built at import: each rank's process drew other values)
            FROZEN_PROBE.weight.copy_(torch.linspace(-1.0, 1.0, 12).reshape(3, 4))
            FROZEN_PROBE.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    if i == 2:  # changed in place: a graph input, no compilation
        CLASS_WEIGHTS.copy_(torch.tensor([0.5, 1.0, 3.0, 1.0]))
        with torch.no_grad():
            FROZEN_PROBE.weight.copy_(torch.linspace(2.0, -2.0, 12).reshape(3, 4))
    if i == 3:  # another tensor of the same shape: read from its place on this call
        WEIGHTED_CRITERION.weight = torch.tensor([0.2, 1.0, 1.0, 4.0])


def _closure_scale():
    scale = 1.0

    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def between(i, pair):
        nonlocal scale
        scale = 0.5 if i == 1 else 1.0  # 1, 0.5, 1, 1: a graph input, one graph

    return step, between


_CLOSURE_STEP, _CHANGE_CLOSURE_SCALE = _closure_scale()


def _halve(grad):
    return grad * 0.5


def _scale_output(module, inputs, output):
    return output * 0.5


def _clip_accumulated(param):
    param.grad.clamp_(-0.01, 0.01)


def gradient_hooks(i, pair):
    """A gradient hook before the first call (on the plain parameter), another after two calls
    (on the parameter spmd_expand made a DTensor)."""
    model = pair["model"]
    if i == 0:
        model.fc1.weight.register_hook(_halve)
    if i == 2:
        model.fc2.bias.register_hook(_halve)


def forward_hook_added(i, pair):
    if i == 2:
        pair["hook"] = pair["model"].fc2.register_forward_hook(_scale_output)
    if i == 3:
        pair["hook"].remove()  # back to the first graph


def post_accumulate_grad_hook(i, pair):
    if i == 0:
        pair["model"].fc1.weight.register_post_accumulate_grad_hook(_clip_accumulated)


class RunningMean(TwoLayer):
    """Keeps a running mean of its output in a buffer it *assigns* (not updates in place) in training."""

    def __init__(self):
        super().__init__()
        self.register_buffer("output_mean", torch.zeros(4))

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.output_mean = 0.9 * self.output_mean + 0.1 * out.detach().mean(0)
        return out


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020) written as third-party optimizers write it: a Python-int step count in the
    state (created on the first step), and a trust ratio from the norms of the whole parameter and of
    its update (over the gathered parameter under FSDP)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, trust_ratio=True, count_in_group=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.trust_ratio = trust_ratio  # False: AdamW (LAMB's trust ratio cancels the bias corrections)
        self.count_in_group = count_in_group  # timm's optimizers count steps in the param group

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            if self.count_in_group:
                group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] = group["step"] if self.count_in_group else state["step"] + 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                exp_avg = state["exp_avg"] / (1 - beta1 ** state["step"])
                exp_avg_sq = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = exp_avg / exp_avg_sq.sqrt().add(group["eps"]) + group["weight_decay"] * p
                if self.trust_ratio:
                    weight_norm, update_norm = p.norm().clamp(0, 10), update.norm()
                    update = update * torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
                p.add_(update, alpha=-group["lr"])


class GroupCountedLookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as timm writes it: a wrapper that does not call
    ``Optimizer.__init__`` (no step hooks), shares its base optimizer's param groups, counts steps in
    them (a Python int) and keeps the slow weights in the *base* optimizer's state, created on the
    first sync. Every ``k``-th step pulls the slow weights ``alpha`` of the way to the fast ones and
    resets the fast weights to them."""

    def __init__(self, base, alpha=0.5, k=2):
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = {**base.defaults, "lookahead_alpha": alpha, "lookahead_k": k}
        self.state = collections.defaultdict(dict)
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"]:
                continue
            for p in group["params"]:
                state = self.base.state[p]
                if "slow" not in state:
                    state["slow"] = p.detach().clone()
                state["slow"].add_(p - state["slow"], alpha=group["lookahead_alpha"])
                p.copy_(state["slow"])
        return loss


class AttributeCountedLookahead(torch.optim.Optimizer):
    """Lookahead as its paper's authors wrote it: the step count in an attribute of the wrapper,
    reset to 0 at every sync (so its values repeat: a compiled step reuses the graph of each value,
    and the count it assigns must be assigned again), the slow weights in the wrapper's own state."""

    def __init__(self, base, alpha=0.5, k=2):
        self.base, self.alpha, self.k, self.count = base, alpha, k, 0
        self.state = collections.defaultdict(dict)
        for group in base.param_groups:
            for p in group["params"]:
                self.state[p]["slow"] = p.detach().clone()

    @property
    def param_groups(self):
        return self.base.param_groups

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        self.count += 1
        if self.count >= self.k:
            self.count = 0
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.state[p]["slow"]
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss


class ForwardingWrapper(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate's ``AcceleratedOptimizer`` is written: ``state``,
    ``param_groups`` and ``defaults`` are properties that forward to the wrapped optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state):
        self.optimizer.state = state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.optimizer.param_groups = groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


def _resume_python_step_state(i, pair):
    """As if loaded from a checkpoint before the first call: the Python-int step count exists already
    (the first trace then changes it, rather than creating it)."""
    if i == 0:
        for p in pair["model"].parameters():
            pair["optimizer"].state[p] = {"step": 3, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.full_like(p, 1e-4)}


def _clamp_grad_data(param):
    param.grad.data = param.grad.data.clamp(-0.01, 0.01)


def clamp_hook_assigning_data(i, pair):
    """A post-accumulate-grad hook that assigns the gradient's ``.data`` (backward runs it)."""
    if i == 0:
        for p in pair["model"].parameters():
            p.register_post_accumulate_grad_hook(_clamp_grad_data)


def _deep_mlp():
    layers = []
    for _ in range(10):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(nn.Linear(16, 32), *layers, nn.Linear(32, 4))


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalization (``torch.optim._muon._zeropower_via_newtonschulz``: the quintic
    Newton-Schulz iteration) in float32 instead of bfloat16, so a sharded run agrees with one device to
    fp32 tolerance (in bfloat16, sharded matmuls round differently: parameters differ by ~4e-3)."""
    a, b, c = ns_coefficients
    wide = grad.size(0) > grad.size(1)
    x = grad.float().T if wide else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class Fp32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iteration in float32 (:func:`_newton_schulz_fp32`)."""

    def step(self, closure=None):
        import torch.optim._muon as muon

        original = muon._zeropower_via_newtonschulz
        muon._zeropower_via_newtonschulz = _newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            muon._zeropower_via_newtonschulz = original


def _matrices(ps):
    """Muon updates 2-D parameters only (the biases keep their values and accumulate gradients)."""
    return [p for p in ps if p.ndim == 2]


SCENARIOS: dict[str, dict] = {
    "lr_set_directly_sgd": dict(optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=1e-2), between=set_lr),
    "lr_set_directly_adamw": dict(between=set_lr),
    "step_lr": dict(between=scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))),
    "cosine": dict(between=scheduler(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3))),
    "linear_warmup": dict(between=scheduler(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3))),
    "one_cycle_adam_foreach": dict(
        optimizer_fn=lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
        between=scheduler(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 1)),
    ),
    "one_cycle_sgd": dict(
        optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        between=scheduler(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 1)),
    ),
    "betas_weight_decay_eps": dict(
        optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
        between=change_hyperparameters,
    ),
    "momentum": dict(optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, foreach=True), between=change_momentum),
    "train_eval": dict(between=toggle_train_eval),
    "evaluate_no_grad": dict(between=evaluation(torch.no_grad)),
    "evaluate_inference_mode": dict(between=evaluation(torch.inference_mode)),
    "freeze_unfreeze": dict(between=freeze_unfreeze),
    "new_optimizer": dict(between=new_optimizer),
    "new_model": dict(between=new_model),
    "zero_grad_first": dict(step=zero_grad_first_step),
    "optimizer_zero_grad_first": dict(step=optimizer_zero_grad_first_step),
    "zero_grad_set_to_none_false": dict(step=zero_grad_keep_step),
    "grads_through_module": dict(step=grads_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "clip_grad_norm": dict(step=clip_norm_step),
    "clip_grad_value": dict(step=clip_value_step),
    # Adam's default path on CPU (single-tensor) and foreach, 5 steps of a 10-layer MLP at lr 1e-2:
    # the traced update rounds like eager except for bias corrections computed in float32.
    # Python values the step reads are baked into its graph: a change compiles again, never a stale graph.
    "module_attribute": dict(model_fn=Tempered, between=change_temperature),
    "module_attribute_not_read": dict(model_fn=Tempered, between=count_steps),
    "global_scalar": dict(step=global_scale_step, between=change_global_scale),
    "closure_scalar": dict(step=_CLOSURE_STEP, between=_CHANGE_CLOSURE_SCALE),
    # Hooks run inside the traced step; one added or removed between calls compiles again.
    "gradient_hooks": dict(optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1), between=gradient_hooks),
    "forward_hook_added": dict(between=forward_hook_added),
    "post_accumulate_grad_hook": dict(optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1), between=post_accumulate_grad_hook),
    # Steps written in other common ways: whole-batch losses, random batch mixing, updates without an
    # optimizer, several backward calls, double backward, closures, explicit output gradients.
    "contrastive_clip": dict(step=contrastive_step),
    "mixup_randperm": dict(step=mixup_step),
    # (The optimizer handed to these is never stepped: plain SGD, which keeps no state.)
    "manual_sgd_no_optimizer": dict(step=manual_sgd_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "data_attribute_update": dict(step=data_update_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "two_backward_retain_graph": dict(step=two_backward_step),
    # `.data` assigned inside the step: recorded as an in-place copy (the graph dropped it before).
    "data_assignment_sgd": dict(step=data_assignment_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    # After `p.data = value` the two are one tensor for the rest of the step (trace._share_assigned_data):
    # a write to either one shows in the other (was lost: parameters off by the write, SAM's old_p stale).
    "data_assigned_then_written": dict(step=data_assigned_then_written_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sam_sgd_momentum": dict(step=sam_step, optimizer_fn=lambda ps: SAM(ps, torch.optim.SGD, lr=0.1, momentum=0.9)),
    "flat_vector_then_step": dict(step=flat_vector_then_step),
    # A plain checkpoint loaded after the parameters became DTensors, the shared weight named twice.
    "load_full_state_dict_tied": dict(model_fn=TiedSquare, between=load_tied_state_dict),
    "grad_data_clamp": dict(step=grad_data_clamp_step),
    "flat_vector_update": dict(step=flat_vector_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "ema_codebook_in_forward": dict(model_fn=EmaCodebook),
    "pgd_adversarial": dict(step=adversarial_step),
    "grad_data_in_hook": dict(between=clamp_hook_assigning_data),
    "gradient_penalty_double_backward": dict(step=gradient_penalty_step),
    "optimizer_step_closure": dict(step=closure_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "explicit_backward_gradient": dict(step=explicit_gradient_step, optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    # A model or block the user already wrapped in torch.compile: its Python forward is traced.
    "torch_compiled_model": dict(model_fn=_torch_compiled),
    "torch_compiled_block": dict(model_fn=CompiledBlock),
    # A buffer assigned in forward is written back like one updated in place.
    "buffer_assigned": dict(model_fn=RunningMean),
    "load_full_state_dict": dict(between=load_full_state_dict),
    "learnable_temperature_adamw": dict(model_fn=LearnableTemperature),
    "modes_set_inside_steps": dict(step=train_mode_step, between=evaluate_setting_its_own_mode),
    "adam_single_tensor_deep": dict(model_fn=_deep_mlp, optimizer_fn=lambda ps: torch.optim.Adam(ps, lr=1e-2), steps=5),
    "adam_foreach_deep": dict(model_fn=_deep_mlp, optimizer_fn=lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True), steps=5),
    # Parameters and optimizer states in bfloat16, the LR changed every step by a scheduler.
    "bf16_adamw_cosine": dict(
        model_fn=PureBf16,
        optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
        between=scheduler(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3)),
    ),
    # torch's Muon (momentum, then the gradient orthogonalized by Newton-Schulz matmuls over the whole
    # matrix: under FSDP and TP the sharded gradient is gathered for them), with an LR schedule.
    "muon": dict(
        optimizer_fn=lambda ps: torch.optim.Muon(_matrices(ps), lr=0.02, momentum=0.9), between=set_lr
    ),
    # A Python-int step count: each call compiles again (its count is baked in), and is stored back.
    "lamb_python_int_step": dict(optimizer_fn=lambda ps: Lamb(ps)),
    "adamw_python_int_step_in_group": dict(optimizer_fn=lambda ps: Lamb(ps, trust_ratio=False, count_in_group=True)),
    "adamw_python_int_step_resumed": dict(optimizer_fn=lambda ps: Lamb(ps, trust_ratio=False), between=_resume_python_step_state),
    "muon_fp32": dict(
        optimizer_fn=lambda ps: Fp32Muon(_matrices(ps), lr=0.02, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ),
    # Optimizer wrappers: the base optimizer's state (SGD's momentum, the slow weights) is a graph input
    # too, and a count the wrapper keeps in an attribute is assigned again after each call.
    "lookahead_sgd_momentum": dict(
        optimizer_fn=lambda ps: GroupCountedLookahead(torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    ),
    "forwarding_wrapper_adamw": dict(
        optimizer_fn=lambda ps: ForwardingWrapper(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)), between=set_lr
    ),
    # Float arguments of the step are graph inputs: one compilation while they change every call.
    "float_argument_mixup": dict(step=mixup_argument_step, arguments=lambda i: ([0.7, 0.2, 0.9, 0.4, 0.6][i],)),
    "float_argument_ema_teacher": dict(model_fn=StudentTeacher, step=ema_teacher_step, arguments=_momentum_schedule),
    "global_tensor_constants": dict(step=global_tensors_step, between=change_global_tensors),
    # Floats the step reads from a global, a settings object and a module attribute are graph inputs:
    # annealed before every call, one compilation.
    "hf_distillation_annealed": dict(
        model_fn=HFStudent, step=distillation_step, between=anneal_distillation,
        optimizer_fn=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-2, weight_decay=0.1),
    ),
    "lookahead_attribute_count_adamw": dict(
        optimizer_fn=lambda ps: AttributeCountedLookahead(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)), steps=5
    ),
}

PLANS = {
    "ddp": (None, lambda: spmd.DDP()),
    "fsdp": (None, lambda: spmd.FSDP()),
    "tp": (None, lambda: spmd.TensorParallel({"fc1": _colwise(), "fc2": _rowwise()})),
    "fsdp+tp": (("dp", "tp"), lambda: {"dp": spmd.FSDP(), "tp": spmd.TensorParallel({"fc1": _colwise(), "fc2": _rowwise()})}),
}


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def _rowwise():
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel()


def _mesh(plan: str, world: int):
    names = PLANS[plan][0]
    if names is None:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)


def run_scenarios(rank: int, world: int, names: list[str], plan: str = "ddp", lower: str = "eager") -> dict:
    """Worker: run each named scenario under ``plan``; errors are returned per scenario."""
    mesh = _mesh(plan, world)
    results = {}
    for name in names:
        try:
            results[name] = run_loop(mesh, PLANS[plan][1](), lower=lower, **SCENARIOS[name])
        except Exception:  # noqa: BLE001 - reported per scenario by the test
            results[name] = {"error": traceback.format_exc()}
    return results


# ---------------------------------------------------------------- refused batches
class _Options:
    """A plain object passed to the step (its default repr names its address)."""


def scaled_step(model, optimizer, x, y, scale, options=None):
    loss = F.cross_entropy(model(x), y) * scale
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def run_bad_batches(rank: int, world: int) -> dict:
    """Worker: each case passes batches the plan cannot split; returns the error text per case."""
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        # (rows on rank 0, rows on rank 1)
        "uneven_4_6": (4, 6),
        "global_7": (4, 3),
        "empty_rank": (4, 0),
    }
    results = {}
    for name, rows in cases.items():
        torch.manual_seed(0)
        model = TwoLayer()
        step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
        x, y = _batch(0, rows[rank])
        results[name] = _refusal(lambda: step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y))
    torch.manual_seed(0)
    model = TwoLayer()
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(batch_dim=2), lower="eager")(classification_step)
    x, y = _batch(0, 4)
    results["missing_batch_dim"] = _refusal(lambda: step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y))
    # A sparse batch tensor (a GCN's adjacency) on one rank only: refused on every rank, no hang.
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
    x, y = _batch(0, 4)
    results["sparse_on_rank_0"] = _refusal(lambda: step(model, torch.optim.SGD(model.parameters(), lr=0.1), x.to_sparse() if rank == 0 else x, y))
    # A batch tensor that requires grad (another model's output passed without detach()) on rank 0,
    # after a call that bound the fast path: traced as data, it would get no gradient, silently.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, x, y)
    results["requires_grad_on_rank_0"] = _refusal(lambda: step(model, optimizer, x.clone().requires_grad_(rank == 0), y))
    # A Python argument is a constant of the one program: ranks passing different values are refused,
    # also when each value's graph is already compiled (no trace, so no graph comparison, would see it).
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(scaled_step)
    model, x_y = TwoLayer(), _batch(0, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, *x_y, 1)
    step(model, optimizer, *x_y, 2)
    results["different_constants"] = _refusal(lambda: step(model, optimizer, *x_y, [1, 2][rank]))
    # A float argument is a graph input (one graph for every value), compared across ranks the same way.
    step(model, optimizer, *x_y, 1.0)
    results["different_float_arguments"] = _refusal(lambda: step(model, optimizer, *x_y, [1.0, 2.0][rank]))
    # An argument whose repr names its address (different in each process) is the same value.
    step(model, optimizer, *x_y, 1.0, _Options())
    # A tensor read from a global is a replicated input: ranks holding different values are refused,
    # also when they agreed on the call that compiled and one changes it in place later.
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(global_tensors_step)
    change_global_tensors(0, None)
    step(model, optimizer, *x_y)
    if rank == 1:
        CLASS_WEIGHTS[0] = 3.0
    results["different_global_tensors"] = _refusal(lambda: step(model, optimizer, *x_y))
    change_global_tensors(0, None)
    # So is a float read from a global (a graph input too).
    global LOSS_SCALE
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(global_scale_step)
    step(model, optimizer, *x_y)
    LOSS_SCALE = [1.0, 0.5][rank]
    results["different_global_floats"] = _refusal(lambda: step(model, optimizer, *x_y))
    LOSS_SCALE = 1.0
    # An LR scheduler stepped on rank 0 only (`if rank == 0:` around logging and scheduling, or
    # ReduceLROnPlateau fed each rank's own metric): the ranks would update the same parameters with
    # different learning rates, silently. Refused on every rank, and the parameters are untouched.
    model = TwoLayer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
    step(model, optimizer, *x_y)
    scheduler.step()
    step(model, optimizer, *x_y)
    if rank == 0:
        scheduler.step()
    before = [p.full_tensor().clone() for p in model.parameters()]
    results["different_lr"] = _refusal(lambda: step(model, optimizer, *x_y))
    results["different_lr_untouched"] = all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    if rank == 1:
        scheduler.step()  # the fix: every rank steps it
    step(model, optimizer, *x_y)
    # One rank takes the full path (its binding dropped here by hand; in use, any state its snapshot
    # sees as new) while the other reuses the last graph: the fast rank runs the graph's prologue with
    # its check in flight, meets the full-path rank's check, then both compare the replicated values,
    # all-reduce the loss denominator themselves (the fast path sends it in the check) and run the
    # same graph. Rank 0's targets are partly ignored (-100), so the ranks' denominators differ. The
    # results are those of one device on the global batch, and of calls where both ranks take the fast path.
    def global_batch(i):
        x, y = _batch(i, 8)
        y[1:4] = -100
        return x, y

    def train(full_path_on_rank_0: bool):
        torch.manual_seed(0)
        model = TwoLayer()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
        losses = []
        for i in range(4):
            if i == 2 and full_path_on_rank_0 and rank == 0:
                step._binding = None
            x, y = global_batch(i)
            losses.append(float(step(model, optimizer, x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])))
        return losses, [p.full_tensor() for p in model.parameters()], type(step.last.runner).__name__

    torch.manual_seed(0)
    reference = TwoLayer()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = [float(classification_step(reference, ref_optimizer, *global_batch(i))) for i in range(4)]
    both_fast, mixed = train(False), train(True)
    results["mixed_paths_equal"] = both_fast[0] == mixed[0] and all(torch.equal(a, b) for a, b in zip(both_fast[1], mixed[1]))
    results["mixed_paths_match_one_device"] = torch.allclose(torch.tensor(mixed[0]), torch.tensor(ref_losses), atol=1e-6) and all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(mixed[1], reference.parameters())
    )
    results["mixed_paths_runner"] = mixed[2]
    results["mixed_paths_runner"] = mixed[2]
    # A model left in eval() on rank 0 only (a rank-0-only evaluation that does not restore train()):
    # rank 0 would compile the eval graph while rank 1 runs its train graph ("new"), or, once both
    # graphs are compiled, each rank would run its own, whose collectives match ("cached"): silently
    # wrong. Refused on every rank at once, naming the mode.
    model = TwoLayer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
    step(model, optimizer, *x_y)
    for name in ("eval_on_rank_0_new", "eval_on_rank_0_cached"):
        model.train(rank != 0)
        results[name] = _refusal(lambda: step(model, optimizer, *x_y))
        model.eval()
        step(model, optimizer, *x_y)  # every rank in eval(): the eval graph, now compiled on both
        model.train()
    # Ranks whose random generators differ (seeded `seed + rank`, or an extra draw on one rank) would
    # each keep their slice of a different dropout mask: not what one device draws. Refused when the
    # graph is compiled ("seeded_by_rank": the check of the global graph) and on every later call
    # ("extra_draw": the per-call check).
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
    for name, rank_draws in (("seeded_by_rank", False), ("extra_draw", True)):
        torch.manual_seed(0 if rank_draws else rank)
        if rank_draws:
            step(model, optimizer, *x_y)
            if rank == 0:
                torch.rand(3)
        results[name] = _refusal(lambda: step(model, optimizer, *x_y))
    torch.manual_seed(0)  # the fix
    step(model, optimizer, *x_y)
    # Tensor-parallel ranks must pass the same batch (a DistributedSampler over all ranks gives each
    # its own): each would compute its columns from other samples, and the row-parallel all-reduce
    # would add them up. A 0-d tensor argument is replicated under DDP: a rank's own count is wrong.
    tp = spmd.TensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()})
    for name, plan, args in (
        ("tp_different_batches", tp, _batch(rank, 4)),
        ("ddp_different_scalars", spmd.DDP(), (*x_y, torch.tensor(float(rank + 1)))),
    ):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(scaled_step)
        results[name] = _refusal(lambda: step(model, torch.optim.SGD(model.parameters(), lr=0.1), *args, *([1.0] if len(args) == 2 else [])))
    # The same on a later call, when the graph of the first (equal values) is bound: checked every call.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(scaled_step)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, *x_y, torch.tensor(2.0))
    step(model, optimizer, *x_y, torch.tensor(3.0))
    results["ddp_different_scalars_later"] = _refusal(lambda: step(model, optimizer, *x_y, torch.tensor(float(rank + 1))))
    # State edited between calls on rank 0 only (`load_state_dict` or a weight edit under
    # `if rank == 0:`): no call can see it, the ranks train different models from then on.
    # spmd.check_replicas compares the values: it passes before the edit, names the tensor after it,
    # and does not mistake an FSDP shard (a different piece on each rank) for a divergence.
    for plan_name, plan in (("ddp", spmd.DDP()), ("fsdp", spmd.FSDP())):
        torch.manual_seed(0)
        model = TwoLayer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(classification_step)
        step(model, optimizer, *x_y)
        results[f"replicas_{plan_name}_agree"] = spmd.check_replicas(model, optimizer)
        if rank == 0:
            with torch.no_grad():
                model.fc2.bias.to_local().add_(1.0)
        step(model, optimizer, *x_y)
        try:
            results[f"replicas_{plan_name}_edited"] = f"no error: {spmd.check_replicas(model, optimizer)} tensors"
        except spmd.SpmdError as e:
            results[f"replicas_{plan_name}_edited"] = f"{type(e).__name__}: {e}"
    # Loading under `if rank == 0:` (torch DDP's habit): after the first call the load distributes rank
    # 0's values (a collective), so rank 0 would wait in it while rank 1 runs its step, until the
    # timeout. Both ranks are told at once; loading on every rank works.
    full = {k: v.full_tensor() * 2 for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()  # as a single-device checkpoint holds it: plain tensors
    plain_states = {**saved, "state": {i: {k: _full(v) for k, v in st.items()} for i, st in saved["state"].items()}}

    def load_plain_optimizer_state():
        optimizer.load_state_dict(plain_states)

    for name in ("load_model_on_rank_0", "load_optimizer_on_rank_0"):
        try:
            if rank == 0:
                model.load_state_dict(full) if name == "load_model_on_rank_0" else load_plain_optimizer_state()
            step(model, optimizer, *x_y)
            results[name] = "no error"
        except spmd.SpmdError as e:
            results[name] = f"{type(e).__name__}: {e}"
    load_plain_optimizer_state()  # the fix: every rank loads
    model.load_state_dict(full)
    step(model, optimizer, *x_y)
    results["loaded_on_every_rank"] = spmd.check_replicas(model, optimizer)
    # An evaluation step called under `if rank == 0:` while rank 1 trains: the two steps' exchanges
    # would pair up; named as such (not as a difference in hyperparameters).
    evaluate = spmd.compile(mesh=mesh, plan=plan, lower="eager")(eval_loss_and_logits)
    try:
        if rank == 0:
            evaluate(model, *x_y)
        step(model, optimizer, *x_y)
        results["eval_step_on_rank_0"] = "no error"
    except spmd.SpmdError as e:
        results["eval_step_on_rank_0"] = f"{type(e).__name__}: {e}"
    # One more batch on rank 0 (a longer data loader) while rank 1 goes on to check the replicas.
    try:
        if rank == 0:
            step(model, optimizer, *x_y)
        spmd.check_replicas(model, optimizer)
        results["one_more_step_on_rank_0"] = "no error"
    except spmd.SpmdError as e:
        results["one_more_step_on_rank_0"] = f"{type(e).__name__}: {e}"
    plain = TwoLayer()  # a plain model, replicated over the default process group
    if rank == 1:
        with torch.no_grad():
            plain.fc1.weight.mul_(2.0)
    try:
        results["replicas_plain"] = f"no error: {spmd.check_replicas(plain)} tensors"
    except spmd.SpmdError as e:
        results["replicas_plain"] = f"{type(e).__name__}: {e}"
    # Uneven local batches under torch.compile(backend="spmd") (no per-call exchange there): each rank
    # captures another global shape; the compile-time comparison names the batch input and the fix.
    parallel = spmd.parallelize(TwoLayer(), mesh, spmd.DDP())
    compiled = torch.compile(parallel, backend="spmd", options={"mesh": mesh, "plan": spmd.DDP(), "lower": "eager"})
    try:
        compiled(_batch(0, (4, 6)[rank])[0]).sum().backward()
        results["backend_uneven_4_6"] = "no error"
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error in BackendCompilerFailed
        results["backend_uneven_4_6"] = str(e)
    finally:
        torch._dynamo.reset()
    # After refusals, a good batch still trains (nothing was lost, no rank is stuck).
    x, y = _batch(1, 4)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(classification_step)
    results["after"] = step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    return results


def scheduler_inside_step(rank: int, world: int) -> str:
    """Worker: an LR scheduler stepped inside the compiled step is refused with a clear error."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TwoLayer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(model, optimizer, x, y):
        loss = classification_step(model, optimizer, x, y)
        sched.step()
        return loss

    x, y = _batch(0, 4)
    try:
        spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(step)(model, optimizer, x, y)
        return "no error"
    except spmd.SpmdError as e:
        return f"{type(e).__name__}: {e}"


def _assign_data_between_calls(i, pair):
    if i == 2:
        weight = pair["model"].fc2.weight
        weight.data = weight.data * 0.5


def _data_alias_read_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    old = model.fc2.weight.data
    model.fc2.weight.data = old - 0.1 * model.fc2.weight.grad
    return loss + old.sum()


SWA_BIAS = {"fc2.bias": torch.zeros(4)}  # a tensor the step reads from a global: a graph input


def _data_shared_with_input_step(model, optimizer, x, y):
    loss = classification_step(model, optimizer, x, y)
    model.fc2.bias.data = SWA_BIAS["fc2.bias"]  # one tensor with the global's after the call
    return loss


def _flat_vector_returned_step(model, optimizer, x, y):
    params = list(model.parameters())
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(params) * 0.99
        torch.nn.utils.vector_to_parameters(flat, params)
    return classification_step(model, optimizer, x, y), flat  # on one device `flat` holds the updated weights


def _data_dtype_step(model, optimizer, x, y):
    loss = classification_step(model, optimizer, x, y)
    model.fc2.bias.data = model.fc2.bias.data.double()
    return loss


def _set_storage_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        model.fc2.weight.set_(model.fc2.weight - 0.1 * model.fc2.weight.grad)
    return loss


# `.data` assignments a compiled step cannot stand for: each must raise, never run on.
REFUSED_DATA_ASSIGNMENTS = {
    # Outside the step, on a DTensor parameter: DTensor keeps `_local_tensor`, the values are lost.
    "between_calls": dict(between=_assign_data_between_calls),
    # `old` keeps the old values on one device; the graph's in-place copy would change it.
    "alias_read_after": dict(step=_data_alias_read_step),
    "dtype_changed": dict(step=_data_dtype_step),
    # `p` and a global's tensor stay one tensor after the call on one device; two graph inputs here.
    "shared_with_input": dict(step=_data_shared_with_input_step),
    "flat_vector_returned": dict(step=_flat_vector_returned_step),
    # Tensor.set_ (a storage swap by another name): functionalization dropped it, silently.
    "set_storage": dict(step=_set_storage_step),
}


def run_refused_data_assignments(rank: int, world: int, plan: str) -> dict:
    """Worker: the error each of :data:`REFUSED_DATA_ASSIGNMENTS` raises (``"no error"`` if none)."""
    mesh = _mesh(plan, world)
    results = {}
    for name, scenario in REFUSED_DATA_ASSIGNMENTS.items():
        results[name] = _refusal(lambda: run_loop(mesh, PLANS[plan][1](), **scenario))
    return results


def discriminator_step(gan, opt_d, real, z):
    """A GAN's discriminator update: real rows scored 1, generated rows (no generator gradient) 0."""
    with torch.no_grad():
        fake = gan.G(z)
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    loss = F.binary_cross_entropy_with_logits(gan.D(real), ones) + F.binary_cross_entropy_with_logits(gan.D(fake), zeros)
    loss.backward()
    opt_d.step()
    opt_d.zero_grad()
    return loss


def generator_step(gan, opt_g, z):
    """A GAN's generator update through the discriminator; the discriminator's gradients are dropped."""
    loss = F.binary_cross_entropy_with_logits(gan.D(gan.G(z)), torch.ones(z.shape[0], 1))
    loss.backward()
    opt_g.step()
    gan.zero_grad()
    return loss


def _gan() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(dict(
        G=nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6)),
        D=nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)),
    ))


def run_gan(rank: int, world: int, plans: list[str]) -> dict:
    """Worker: DCGAN's loop (torch's examples) as two compiled steps over one model, one optimizer each
    (the discriminator's Adam over D, the generator's over G), against the same loop on one device."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for plan in plans:
        try:
            gan, ref = _gan(), _gan()
            # The generator's optimizer is built before the first compiled call converts the parameters.
            opt_g, ref_opt_g = (torch.optim.Adam(m.G.parameters(), lr=1e-2, betas=(0.5, 0.999)) for m in (gan, ref))
            opt_d, ref_opt_d = (torch.optim.Adam(m.D.parameters(), lr=1e-2, betas=(0.5, 0.999)) for m in (gan, ref))
            compiled_d = spmd.compile(mesh=mesh, plan=PLANS[plan][1](), lower="eager")(discriminator_step)
            compiled_g = spmd.compile(mesh=mesh, plan=PLANS[plan][1](), lower="eager")(generator_step)
            outs, ref_outs = [], []
            rows = BATCH // world
            for i in range(STEPS):
                g = torch.Generator().manual_seed(300 + i)
                real, z = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)
                mine = slice(rank * rows, (rank + 1) * rows)
                ref_outs += [discriminator_step(ref, ref_opt_d, real, z), generator_step(ref, ref_opt_g, z)]
                outs += [compiled_d(gan, opt_d, real[mine], z[mine]), compiled_g(gan, opt_g, z[mine])]
            results[plan] = {
                "outs": torch.stack([o.detach() for o in outs]),
                "ref_outs": torch.stack([o.detach() for o in ref_outs]),
                "params": {k: _full(p).detach() for k, p in gan.named_parameters()},
                "ref_params": {k: p.detach() for k, p in ref.named_parameters()},
                "compilations": [sum(map(len, c.cache.values())) for c in (compiled_d, compiled_g)],
            }
        except Exception:  # noqa: BLE001 - reported by the test
            results[plan] = {"error": traceback.format_exc()}
    return results


# ---------------------------------------------------------------- batch layouts, state carried across calls
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(vocab, 16), nn.Linear(16, 16), nn.Linear(16, vocab)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))


def next_token_step(model, optimizer, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def scaled_in_place_step(model, optimizer, x, y):
    x.mul_(0.5)  # written through to the caller's tensor, here a view of a larger one
    return classification_step(model, optimizer, x, y)


class WordLM(nn.Module):
    """pytorch/examples' word_language_model (LSTM, tied encoder/decoder weights), without dropout.
    Its sequences are (time, batch): the batch is dim 1."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2):
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(vocab, d), nn.LSTM(d, d, layers), nn.Linear(d, vocab)
        self.decoder.weight = self.encoder.weight

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.encoder(tokens), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden


def truncated_bptt_step(model, tokens, targets, h, c):
    """The example's loop body: detach the carried state, clip, then its manual SGD on ``p.data``."""
    model.zero_grad()
    output, (h, c) = model(tokens, (h.detach(), c.detach()))
    loss = F.nll_loss(output.reshape(-1, output.size(-1)), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-1.0)
    return loss, h, c


class TransposedState(nn.Module):
    """A buffer and a parameter created as transposes (not contiguous), reshaped in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(4, 16).t())
        self.w = nn.Parameter(torch.randn(4, 16).t())

    def forward(self, x):
        return self.fc(x * self.scale.reshape(-1)[:16]) + x @ self.w.reshape(16, 4)


def run_batch_layouts(rank: int, world: int, plan: str) -> dict:
    """Worker: batches that are views (not contiguous) and state a step returns and gets back, compiled
    on ``world`` ranks and on one device over the global batch. Each rank passes its rows as a view of
    the global tensor (``tensor_split``), as a loader's slices would be."""
    mesh = _mesh(plan, world)
    results = {}

    def mine(t, dim=0):
        return t.tensor_split(world, dim)[rank]

    def pair(model_fn, optimizer_fn, step, plan_obj):
        torch.manual_seed(0)
        model = model_fn()
        ref = copy.deepcopy(model)
        compiled = spmd.compile(mesh=mesh, plan=plan_obj, lower="eager")(step)
        opts = [optimizer_fn(m.parameters()) for m in (model, ref)] if optimizer_fn else [None, None]
        return model, ref, compiled, opts

    def params(model, ref):
        return {k: (_full(v).detach().clone(), r.detach().clone()) for (k, v), r in zip(model.named_parameters(), ref.parameters())}

    # A language model's inputs and targets: two overlapping views of one token tensor. Odd calls pass
    # contiguous copies, so the graph compiled for one layout also serves the other.
    model, ref, compiled, (opt, ref_opt) = pair(TinyLM, lambda ps: torch.optim.AdamW(ps, lr=1e-2), next_token_step, PLANS[plan][1]())
    losses = []
    for i in range(4):
        data = torch.randint(0, 32, (8, 13), generator=torch.Generator().manual_seed(i))
        x, y = mine(data[:, :-1]), mine(data[:, 1:])
        if i % 2:
            x, y = x.contiguous(), y.contiguous()
        losses.append((compiled(model, opt, x, y), next_token_step(ref, ref_opt, data[:, :-1], data[:, 1:])))
    results["views"] = {"losses": losses, "params": params(model, ref), "compilations": sum(len(v) for v in compiled.cache.values())}

    # A transposed batch, written in place by the step: the caller's tensor sees the write.
    model, ref, compiled, (opt, ref_opt) = pair(TwoLayer, lambda ps: torch.optim.SGD(ps, lr=0.1), scaled_in_place_step, PLANS[plan][1]())
    features = torch.randn(16, BATCH, generator=torch.Generator().manual_seed(7))
    ref_features = features.clone()
    labels = torch.randint(0, 4, (BATCH,), generator=torch.Generator().manual_seed(8))
    x = mine(features.t())
    loss = compiled(model, opt, x, mine(labels))
    ref_loss = scaled_in_place_step(ref, ref_opt, ref_features.t(), labels)
    results["written_in_place"] = {
        "losses": [(loss, ref_loss)], "params": params(model, ref), "mine": x.clone(), "ref_mine": mine(ref_features.t()),
    }

    # A module whose buffer and parameter are not contiguous.
    model, ref, compiled, (opt, ref_opt) = pair(TransposedState, lambda ps: torch.optim.AdamW(ps, lr=1e-2), classification_step, PLANS[plan][1]())
    losses = []
    for i in range(2):
        x, y = _batch(i)
        losses.append((compiled(model, opt, mine(x), mine(y)), classification_step(ref, ref_opt, x, y)))
    results["transposed_state"] = {"losses": losses, "params": params(model, ref)}

    # An RNN's hidden state carried from one call to the next (truncated backpropagation through time).
    # A call returns the global state; each rank passes its own rows back in.
    rnn_plan = {"ddp": spmd.DDP, "fsdp": spmd.FSDP}[plan](batch_dim=1)
    model, ref, compiled, _ = pair(WordLM, None, truncated_bptt_step, rnn_plan)
    tokens = torch.randint(0, 32, (21, 4), generator=torch.Generator().manual_seed(9))
    h = c = torch.zeros(2, 4, 16)
    ref_h = ref_c = torch.zeros(2, 4, 16)
    losses = []
    for i in range(4):
        x, y = tokens[5 * i:5 * i + 5], tokens[5 * i + 1:5 * i + 6]
        loss, h, c = compiled(model, mine(x, 1), mine(y, 1), mine(h, 1), mine(c, 1))
        ref_loss, ref_h, ref_c = truncated_bptt_step(ref, x, y, ref_h, ref_c)
        losses.append((loss, ref_loss))
    results["rnn_state"] = {"losses": losses, "params": params(model, ref), "state": (h, ref_h), "cell": (c, ref_c)}
    # The returned (global) state passed back as it is.
    results["global_state_passed_back"] = _refusal(lambda: compiled(model, mine(x, 1), mine(y, 1), h, c))
    return results


def run_changing_batch_shapes(rank: int, world: int) -> dict:
    """Worker: language-model batches padded to 8, 12, 8 and 12 tokens: two graphs, one warning."""
    import warnings

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiled = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(next_token_step)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, length in enumerate((8, 12, 8, 12)):
            data = torch.randint(0, 32, (8, length + 1), generator=torch.Generator().manual_seed(i))
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            loss = compiled(model, opt, x.tensor_split(world)[rank], y.tensor_split(world)[rank])
            losses.append((loss, next_token_step(ref, ref_opt, x, y)))
    return {
        "losses": losses,
        "compilations": sum(len(v) for v in compiled.cache.values()),
        "warnings": [(str(w.message), w.filename) for w in caught if "new batch shapes" in str(w.message)],
    }


def weighted_pair_step(model, optimizer, batch):
    """A dict batch of two same-shaped tensors used differently (HuggingFace's input_ids / labels)."""
    loss = (model(batch["x"]) - batch["target"]).square().mean() + 0.1 * batch["target"].mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def keyword_pair_step(model, optimizer, *, x, target):
    return weighted_pair_step(model, optimizer, {"x": x, "target": target})


def run_argument_structures(rank: int, world: int) -> dict:
    """Worker: the same tensors passed as a dict in one key order, then the other, and as keywords in
    both orders. Batch inputs are bound by their position among the arguments' leaves: each order is
    its own graph (was: the cached graph ran with the two tensors swapped, no warning)."""
    import warnings

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    by_dict = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(weighted_pair_step)
    by_keywords = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(keyword_pair_step)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, order in enumerate(("x", "target", "x", "target")):
            g = torch.Generator().manual_seed(i)
            x, target = torch.randn(8, 4, generator=g), 3.0 + torch.randn(8, 4, generator=g)
            local = {"x": x.tensor_split(world)[rank], "target": target.tensor_split(world)[rank]}
            first, second = ("x", "target") if order == "x" else ("target", "x")
            dict_loss = by_dict(model, opt, {first: local[first], second: local[second]})
            keyword_loss = by_keywords(model, opt, **{first: local[first], second: local[second]})
            ref_dict = weighted_pair_step(ref, ref_opt, {first: {"x": x, "target": target}[first], second: {"x": x, "target": target}[second]})
            ref_keywords = keyword_pair_step(ref, ref_opt, x=x, target=target)
            losses += [(dict_loss, ref_dict), (keyword_loss, ref_keywords)]
    return {
        "losses": losses,
        "params": [(_full(p).detach(), r.detach()) for p, r in zip(model.parameters(), ref.parameters())],
        "compilations": [sum(len(v) for v in c.cache.values()) for c in (by_dict, by_keywords)],
        "warnings": [str(w.message) for w in caught if "another structure" in str(w.message)],
    }
