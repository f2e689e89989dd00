"""Training loops for ``torch.compile(model, backend="spmd")``, each against one device over the global batch.

The user's own loop: eager ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``, an LR
scheduler; the loss is computed outside the compiled model from its local result.
"""

from __future__ import annotations

import copy
import gc
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.backend import stats
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice

import module_zoo_cases
from cases import GPT_CONFIG, GPT_TP, PLANS, make_mesh
from spmd_expand.app.models import build_gpt


@dataclass
class Loop:
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]
    loss: Callable[..., torch.Tensor]  # loss(model_callable, *batch) -> scalar
    tp: dict | Callable[[nn.Module], dict] | None = None  # a TP plan, or how to read one from the model
    setup: Callable[[nn.Module], None] | None = None  # run on the model and on its reference copy
    allow_rnn: bool = False  # torch._dynamo.config.allow_rnn: capture nn.LSTM / nn.GRU in the graph
    # torch's compiled-optimizer recipe on the parallelized model: `torch.compile(optimizer.step)`, the
    # learning rate a tensor (the scheduler fills it in place: no recompilation per LR change).
    compiled_optimizer: bool = False


def _halve(grad):
    return grad * 0.5


def _gradient_hooks(model):
    """A gradient hook on a parameter, registered before spmd.parallelize (which makes it a DTensor)."""
    model.fc1.weight.register_hook(_halve)


def _tokens(g):
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (8, 8), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _lm_loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm_loss_inside(model, idx, targets):
    """The model computes its loss itself (as HuggingFace models do given labels): the global mean."""
    return model(idx, targets)


class BreakMLP(nn.Module):
    """An MLP whose forward has a graph break in the middle (a print Dynamo cannot trace)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 24), nn.Linear(24, 24), nn.Linear(24, 5)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        h = h * torch.sigmoid(self.fc2(h))
        return self.fc3(h)


class _Break(nn.Module):
    def forward(self, x):
        torch._dynamo.graph_break()
        return x


def nested_break_mlp() -> nn.Module:
    """A graph break inside a child of an ``nn.Sequential``: Dynamo runs the whole Sequential eagerly,
    on the DTensor parameters (their gradients came out ``Partial``, not reduced per the plan)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), _Break(), nn.Linear(24, 5))


class Recurrent(nn.Module):
    """Embedding, LSTM, classifier: torch's word-language-model shape."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(20, 6), nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0][:, -1])


class FusedKernels(nn.Module):
    """Layers whose fused ATen kernels DTensor has no rule for, which Dynamo met while capturing (it
    runs DTensor's rules): EmbeddingBag (2-D bags), a token pool over a transposed tensor (Swin's
    ``AdaptiveAvgPool1d(1)``, restrided with ``as_strided_``), Bilinear, a 2-layer LSTM (oneDNN's
    layer). The backend's forward records them in spmd_expand's equal forms (``forms.EqualForms``)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode="mean", padding_idx=0)
        self.emb = nn.Embedding(20, 6)
        self.rnn = nn.LSTM(6, 6, num_layers=2, batch_first=True)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.mix = nn.Bilinear(6, 6, 5)

    def forward(self, ids):
        tokens = self.rnn(self.emb(ids))[0]
        return self.mix(self.bag(ids), self.pool(tokens.transpose(1, 2)).flatten(1))


def _ids_y(g):
    return torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 5, (8,), generator=g)


def _images_classes(g):
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, module_zoo_cases.CLASSES, (8,), generator=g)


def _xy(g):
    return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def _two_shapes_accumulated(model, x, y):
    """Gradient accumulation over micro-batches of 3 and 1 rows per rank (of a 4-row local batch):
    the second compiles new graphs after the first's backward has filled ``.grad``."""
    first = lambda t: t.unflatten(0, (-1, 4))[:, :3].flatten(0, 1)  # noqa: E731
    second = lambda t: t.unflatten(0, (-1, 4))[:, 3:].flatten(0, 1)  # noqa: E731
    (F.cross_entropy(model(first(x)), first(y)) * 0.75).backward()
    return F.cross_entropy(model(second(x)), second(y)) * 0.25


def _llama():
    import tp_cases

    return tp_cases.build_llama()


def _llama_tokens(g):
    import tp_cases

    return tp_cases.llama_tokens(g)


def _llama_loss(model, idx, labels):
    logits = model(input_ids=idx, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _t5():
    import hf_zoo

    return hf_zoo.ZOO["t5"].build()


def _t5_batch(g):
    import hf_zoo

    return hf_zoo.seq2seq_batch(g)


def _t5_loss(model, ids, labels):
    # T5 builds its decoder inputs from the labels (``_shift_right``: ``t[..., 0] = start``, a fill of
    # a batch-sharded DTensor) and computes the loss inside forward.
    return model(input_ids=ids, labels=labels).loss


LOOPS = {
    "gpt": Loop(lambda: build_gpt(GPT_CONFIG, seed=0), _tokens, _lm_loss, GPT_TP),
    "gpt_compiled_optimizer": Loop(lambda: build_gpt(GPT_CONFIG, seed=0), _tokens, _lm_loss, GPT_TP, compiled_optimizer=True),
    "gpt_loss_inside": Loop(lambda: build_gpt(GPT_CONFIG, seed=0), _tokens, _lm_loss_inside, GPT_TP),
    "graph_break": Loop(lambda: torch.manual_seed(0) and BreakMLP(), _xy, _ce),
    "nested_graph_break": Loop(nested_break_mlp, _xy, _ce),
    "fused_kernels": Loop(lambda: torch.manual_seed(0) and FusedKernels(), _ids_y, _ce, allow_rnn=True),
    # Reflection, replication and circular padding: DTensor had no rule for the first two (Dynamo
    # runs DTensor's rules while it captures).
    "padded_cnn": Loop(lambda: torch.manual_seed(0) and module_zoo_cases._pads(), _images_classes, _ce),
    "graph_break_accumulate": Loop(lambda: torch.manual_seed(0) and BreakMLP(), _xy, _two_shapes_accumulated),
    "llama": Loop(_llama, _llama_tokens, _llama_loss, lambda m: spmd.TensorParallel.from_huggingface(m).plan),
    "t5": Loop(_t5, _t5_batch, _t5_loss),
    "lstm": Loop(lambda: torch.manual_seed(0) and Recurrent(), _ids_y, _ce, allow_rnn=True),
    "gradient_hook": Loop(lambda: torch.manual_seed(0) and BreakMLP(), _xy, _ce, setup=_gradient_hooks),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_loop(name: str, plan_name: str, mesh, steps: int, lower: str = "eager") -> dict:
    loop = LOOPS[name]
    # Each run is a new model of a class an earlier run compiled: start from an empty Dynamo cache so
    # runs do not add up to Dynamo's recompile limit for the class's forward.
    torch._dynamo.reset()
    torch._dynamo.config.allow_rnn = loop.allow_rnn
    torch.manual_seed(0)
    model = loop.model()
    reference = copy.deepcopy(model)
    for m in (model, reference) if loop.setup is not None else ():
        loop.setup(m)
    plan = PLANS[plan_name][1](loop.tp(model) if callable(loop.tp) else loop.tp)
    before = stats.graphs_compiled
    spmd.parallelize(model, mesh, plan)
    resolved = resolve_plan(plan, mesh, reference)
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan, "lower": lower})
    lr = torch.tensor(3e-3) if loop.compiled_optimizer else 3e-3
    optimizers = [torch.optim.AdamW(m.parameters(), lr=r, weight_decay=0.1) for m, r in ((model, lr), (reference, 3e-3))]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
    # aot_eager: Dynamo and AOTAutograd over the DTensor parameters and states, as Inductor gets them,
    # without Inductor's C++ compile time.
    optimizer_frames = CompileCounterWithBackend("aot_eager")
    model_step = torch.compile(optimizers[0].step, backend=optimizer_frames) if loop.compiled_optimizer else optimizers[0].step
    losses, ref_losses, norms, ref_norms = [], [], [], []
    after_first = None
    for i in range(steps):
        batch = loop.batch(torch.Generator().manual_seed(100 + i))
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]
        for m, fn, args, out, out_norms, opt, opt_step, sched in (
            (model, compiled, local, losses, norms, optimizers[0], model_step, schedulers[0]),
            (reference, reference, batch, ref_losses, ref_norms, optimizers[1], optimizers[1].step, schedulers[1]),
        ):
            loss = loop.loss(fn, *args)
            loss.backward()
            out_norms.append(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)).detach())
            opt_step()
            sched.step()
            opt.zero_grad()
            out.append(loss.detach())
        if i == 0:
            after_first = stats.graphs_compiled - before
    # One more backward, left unzeroed: the gradients the eager optimizer would read.
    loop.loss(compiled, *local).backward()
    grads_follow_params = all(
        isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in model.parameters()
    )
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "norms": torch.stack(norms),
        "ref_norms": torch.stack(ref_norms),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "compilations": stats.graphs_compiled - before,
        "compilations_after_first_step": after_first,
        "loss_is_plain": type(losses[0]) is torch.Tensor,
        "grads_follow_params": grads_follow_params,
        "optimizer_compilations": optimizer_frames.frame_count if loop.compiled_optimizer else None,
    }


def run_loops(rank: int, world: int, runs: list[tuple[str, str, str]], steps: int = 3) -> dict:
    """Worker: each (loop, plan, lower) on this rank; errors are returned per run, not raised."""
    results = {}
    for name, plan_name, lower in runs:
        try:
            results[(name, plan_name, lower)] = run_loop(name, plan_name, make_mesh(plan_name, world), steps, lower)
        except Exception:  # noqa: BLE001 - reported per run by the test
            results[(name, plan_name, lower)] = {"error": traceback.format_exc()}
    return results


def eager_gradient_worker(rank: int, world: int) -> dict:
    """A parallelized parameter used by eager DTensor code (what Dynamo runs outside its graphs): its
    gradient arrives ``Partial``; the hook ``spmd.parallelize`` installs reduces it to the plan's
    placement (DDP: replicated) and warns once. Returns the placements and the warnings."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    spmd.parallelize(model, mesh, spmd.DDP())
    x = DTensor.from_local(torch.full((2, 4), float(rank + 1)), mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            (x * model.weight).sum().backward()
    return {
        "placements": tuple(model.weight.grad.placements),
        "grad": model.weight.grad.to_local().clone(),
        "warnings": [str(w.message) for w in caught if "eager DTensor code" in str(w.message)],
    }


def _parallelized_copy(build: Callable[[], nn.Module], plan_name: str, world: int, timeout=None, **options):
    """``(compiled, model, reference)``: ``build()`` seeded, an untouched copy for one device, and the
    model parallelized under DDP or FSDP on a ``(world,)`` CPU mesh (``timeout``: parallelize's),
    compiled by the spmd backend."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    plan = spmd.DDP() if plan_name == "ddp" else spmd.FSDP()
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    spmd.parallelize(model, mesh, plan, timeout=timeout)
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan, **options})
    return compiled, model, reference


class _WithStatistic(nn.Module):
    """Returns batch rows (logits) and a statistic over the batch (a [width] mean): not rows of a rank."""

    def __init__(self, width: int = 5):
        super().__init__()
        self.a, self.c = nn.Linear(4, width), nn.Linear(width, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h), h.mean(0)


def statistic_output_worker(rank: int, world: int, plan_name: str, width: int = 5) -> dict:
    """A compiled model's output that is not split over the ranks (a batch statistic of ``width``
    features; the global batch is 8 rows), used in each rank's loss: its value and the gradients,
    beside one device over the global batch."""
    compiled, model, reference = _parallelized_copy(lambda: _WithStatistic(width), plan_name, world)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, statistic = compiled(x.chunk(world)[rank])
    if statistic.shape != (width,):
        return {"shape": tuple(statistic.shape), "warnings": [str(w.message) for w in caught]}
    (F.cross_entropy(out, y.chunk(world)[rank]) + statistic.norm()).backward()
    ref_out, ref_statistic = reference(x)
    (F.cross_entropy(ref_out, y) + ref_statistic.norm()).backward()
    return {
        "statistic": statistic.detach(), "ref_statistic": ref_statistic.detach(), "warnings": [str(w.message) for w in caught],
        "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
    }


class _Centered(nn.Module):
    """Rows centered over the batch, ``h - h.mean(0, keepdim=True)``: a partial value with the batch's rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0, keepdim=True)


def centered_rows_worker(rank: int, world: int, plan_name: str) -> dict:
    """Each rank's loss on its rows of :class:`_Centered`'s output (one row per rank): shapes and
    gradients, beside one device over the global batch."""
    compiled, model, reference = _parallelized_copy(_Centered, plan_name, world, lower="eager")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(world, 6, generator=g), torch.randn(world, 3, generator=g)
    out = compiled(x.chunk(world)[rank])
    (out - y.chunk(world)[rank]).square().mean().backward()
    (reference(x) - y).square().mean().backward()
    return {
        "shape": tuple(out.shape),
        "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
    }


class _SequenceFirstOutput(nn.Module):
    """Batch-first input ``(B, T, F)``, sequence-first log-probabilities ``(T, B, C)`` out, as a CTC
    model returns them for ``F.ctc_loss``."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x))).transpose(0, 1).log_softmax(-1)


def sequence_first_output_worker(rank: int, world: int, plan_name: str, loss: str) -> dict:
    """The user's loop over :class:`_SequenceFirstOutput`'s local result: an NLL over every time step,
    or a CTC loss (targets of each sample); local output shapes, losses averaged over the ranks (per
    the DDP convention, a per-rank mean's mean), gradients, and one device's over the global batch."""
    compiled, model, reference = _parallelized_copy(_SequenceFirstOutput, plan_name, world, lower="eager")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, 6, generator=g), torch.randint(1, 5, (4, 8), generator=g)
    targets = torch.randint(1, 5, (4, 3), generator=g)

    def loss_of(logp, y, targets):
        if loss == "ctc":
            n = logp.shape[1]
            return F.ctc_loss(logp, targets, torch.full((n,), 8), torch.full((n,), 3))
        return F.nll_loss(logp.flatten(0, 1), y.transpose(0, 1).flatten())

    part = lambda t: t.chunk(world)[rank]  # noqa: E731
    out = compiled(part(x))
    local_loss = loss_of(out, part(y), part(targets))
    local_loss.backward()
    ref_loss = loss_of(reference(x), y, targets)
    ref_loss.backward()
    return {
        "shape": tuple(out.shape), "loss": local_loss.detach(), "ref_loss": ref_loss.detach(),
        "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
    }


class _TwoHeads(nn.Module):
    """Two task heads over one body; a multi-task loop trains one head per step."""

    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head_a(h), self.head_b(h)


def alternating_heads_worker(rank: int, world: int, plan_name: str) -> dict:
    """The loop's loss reads one head's output per step (the other is returned, unused), AdamW with
    weight decay: whether the unused head got a gradient, and the parameters, beside one device."""
    compiled, model, reference = _parallelized_copy(_TwoHeads, plan_name, world, lower="eager")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, reference)]
    part = lambda t: t.chunk(world)[rank]  # noqa: E731
    unused_grads = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, a, b = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g), torch.randint(0, 3, (8,), generator=g)
        for run, optimizer, batch in ((compiled, optimizers[0], (part(x), part(a), part(b))), (reference, optimizers[1], (x, a, b))):
            out_a, out_b = run(batch[0])
            loss = F.cross_entropy(out_a, batch[1]) if step % 2 == 0 else F.cross_entropy(out_b, batch[2])
            loss.backward()
            if step == 0:  # head_b's output was not used
                unused_grads.append((model if run is compiled else reference).head_b.weight.grad is None)
            optimizer.step()
            optimizer.zero_grad()
    return {
        "unused_grad_none": unused_grads,
        "params": [p.full_tensor().detach() for p in model.parameters()], "ref_params": [p.detach() for p in reference.parameters()],
    }


class _SumAcrossBreak(nn.Module):
    """A reduction over the batch (a partial value on each rank: a sum, a mean, a norm) carried across
    a graph break."""

    def __init__(self, reduction: str = "sum"):
        super().__init__()
        self.a, self.c = nn.Linear(4, 3), nn.Linear(3, 2)
        self.reduction = reduction

    def forward(self, x):
        h = self.a(x)
        s = {"sum": lambda: h.sum(0), "mean": lambda: h.mean(0), "norm": lambda: h.norm()}[self.reduction]()
        torch._dynamo.graph_break()  # a print() or a logging call does the same
        return self.c(h + s)


def sum_across_break_worker(rank: int, world: int, reduction: str = "sum") -> dict:
    """:class:`_SumAcrossBreak` under DDP: outputs and gradients beside one device's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _SumAcrossBreak(reduction)
    reference = copy.deepcopy(model)
    spmd.parallelize(model, mesh, spmd.DDP())
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": spmd.DDP()})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)
    F.cross_entropy(compiled(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    F.cross_entropy(reference(x), y).backward()
    return {"grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()]}


class _CountReadAsNumber(nn.Module):
    """A loss normalised inside forward by a count over the batch read as a Python number (`.item()`
    breaks the graph there): the count must be the global one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)

    def forward(self, x, y):
        n = (y >= 0).sum().item()
        return F.cross_entropy(self.a(x), y, reduction="sum") / n


def count_read_as_number_worker(rank: int, world: int) -> dict:
    """:class:`_CountReadAsNumber` under DDP: loss and gradients beside one device's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _CountReadAsNumber()
    reference = copy.deepcopy(model)
    spmd.parallelize(model, mesh, spmd.DDP())
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": spmd.DDP()})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    loss = compiled(x.chunk(world)[rank], y.chunk(world)[rank])
    loss.backward()
    ref_loss = reference(x, y)
    ref_loss.backward()
    return {
        "loss": loss.detach(), "ref_loss": ref_loss.detach(),
        "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
    }


def run_workers(rank: int, world: int, calls: list[tuple]) -> dict:
    """Several workers of this module on one spawn of the ranks (a spawn costs seconds of imports):
    ``{(name, *args): result}`` for each ``(name, *args)`` of ``calls``, run as ``name(rank, world,
    *args)`` after a reset of Dynamo's caches and a collection of the last worker's models; a worker that raises gives ``{"error": traceback}``."""
    results = {}
    for name, *args in calls:
        torch._dynamo.reset()
        gc.collect()  # the last worker's parallelized models, which a graph reading no parameters would match
        try:
            results[(name, *args)] = globals()[name](rank, world, *args)
        except Exception:
            results[(name, *args)] = {"error": traceback.format_exc()}
    return results


@torch._dynamo.disable
def _loss_outside_graphs(name: str, h, target, labels, weight):
    """Losses Dynamo does not compile (``torch._dynamo.disable``): eager code on DTensors, whose
    eager rules in torch 2.13 give W times the gradients of a mean MSE / smooth L1, average the
    ranks' means of a cross-entropy with ignored labels, and write no diagonal into a row-split tensor."""
    if name == "mse":
        return F.mse_loss(h, target) + 0.1 * weight.square().sum()
    if name == "smooth_l1":
        return F.smooth_l1_loss(h, target)
    if name == "cross_entropy_ignore_index":
        return F.cross_entropy(h, labels, ignore_index=-100)
    if name == "norm":
        return h.norm(dim=0).sum()
    if name == "fill_diagonal":
        h.fill_diagonal_(0.0)
        return F.l1_loss(h, target, reduction="sum")
    if name == "l1_weighted":
        return F.l1_loss(h, target, weight=target.abs())
    if name == "write_through_view":  # a view of a value computed here: autograd must see the write
        h = h * 1.0
        h[:, 0].zero_()
        h.narrow(1, 1, 1).mul_(0.5)
        return F.mse_loss(h, target)
    if name == "write_through_alias":  # contiguous() / .to() of its own dtype return the tensor itself
        h.contiguous().mul_(2.0)
        h.to(torch.float32).add_(1.0)
        return F.mse_loss(h, target)
    if name == "foreach_in_place":  # a list of targets
        a, b = h * 1.0, h * 2.0
        torch._foreach_mul_([a, b], 0.5)
        return F.mse_loss(a + b, target)
    if name == "shape_in_place":  # DTensor has no rule for unsqueeze_: refused, naming the fix
        return F.mse_loss((h * 1.0).unsqueeze_(0)[0], target)
    if name == "gradient_penalty":  # torch.autograd.grad on the DTensors themselves
        (g,) = torch.autograd.grad(h.square().sum(), h, create_graph=True)
        return F.mse_loss(h, target) + 0.01 * g.square().mean()
    if name in ("dropout", "dropout_rank_seeds"):  # each rank draws the whole mask, as one device
        return F.mse_loss(F.dropout(h, 0.5), target)
    if name in ("plain_noise", "plain_noise_rank_seeds"):  # a plain tensor drawn here: the ranks must draw alike
        return F.mse_loss(h + torch.randn(3), target)
    if name == "write_into_view_across_split":  # h[0] is a copy here (h is split on dim 0): refused
        h[0].zero_()
        return F.mse_loss(h, target)
    if name == "write_into_view_of_view_across_split":  # v[1:] views the copy h[0]: refused too
        v = h[0]
        v[1:].zero_()
        return F.mse_loss(h, target)
    raise ValueError(name)


class _LossOutsideGraphs(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fc = nn.Linear(4, 3)

    def forward(self, x, target, labels):
        return _loss_outside_graphs(self.name, self.fc(x) * 2.0, target, labels, self.fc.weight)


class _SizedByValues(nn.Module):
    """Compiled code with outputs sized by values (a boolean mask, ``torch.nonzero``, ``torch.unique``):
    DTensor has no rule for them, and Dynamo stopped with a sharding error while it captured."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fc = nn.Linear(4, 3)

    def forward(self, x, target, labels):
        h = self.fc(x) * 2.0
        if self.name == "sized_boolean_mask":
            keep = labels >= 0
            return F.mse_loss(h[keep], target[keep])
        if self.name == "sized_nonzero":
            index = torch.nonzero(labels >= 0).squeeze(1)
            return F.mse_loss(h[index], target[index])
        return h[:, torch.unique(labels.clamp(min=0))].square().mean()  # sized_unique


class _CompiledDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(F.dropout(self.a(x), 0.5))


def compiled_dropout_worker(rank: int, world: int, plan_name: str, draw_on_rank0: bool) -> dict:
    """Three calls of a model whose compiled graph draws (dropout), the ranks seeded alike before each, and
    with ``draw_on_rank0`` one more number drawn on rank 0 only before the third: per call, the loss and
    gradients beside one device's over the global batch (seeded alike), or the error."""
    compiled, model, reference = _parallelized_copy(_CompiledDropout, plan_name, world, lower="eager")
    g = torch.Generator().manual_seed(0)
    calls = []
    for call in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        torch.manual_seed(10 + call)
        if draw_on_rank0 and call == 2 and rank == 0:
            torch.rand(1)  # a rank's own draw between calls (a sample for logging)
        model.zero_grad()
        try:
            loss = F.mse_loss(compiled(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
        except Exception:
            calls.append({"error": traceback.format_exc()})
            break
        torch.manual_seed(10 + call)
        reference.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        calls.append({
            "loss": global_loss / world, "ref_loss": ref_loss.detach(),
            "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
        })
    return {"calls": calls}


def short_batch_on_one_rank_worker(rank: int, world: int, plan_name: str) -> dict:
    """Three calls with 4 rows per rank, except that at the third rank 0 alone gets 3 (a short last
    batch on one rank): per call, the error text, if any. Dynamo compiles a new graph on rank 0 only
    there, while rank 1's guards pass and it runs the graph it has."""
    build = lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    compiled, model, _ = _parallelized_copy(build, plan_name, world, timeout=120, lower="eager")
    g = torch.Generator().manual_seed(0)
    calls = []
    for call in range(3):
        x = torch.randn(3 if call == 2 and rank == 0 else 4, 4, generator=g)
        try:
            compiled(x).square().mean().backward()
            calls.append({})
        except Exception:
            calls.append({"error": traceback.format_exc()})
            break
    return {"calls": calls}


def loss_outside_graphs_worker(rank: int, world: int, plan_name: str, name: str) -> dict:
    """:class:`_LossOutsideGraphs` (a global batch of 8, labels ignored unevenly over the ranks):
    loss, gradients and the warnings, beside one device's loss and gradients."""
    build = _SizedByValues if name.startswith("sized_") else _LossOutsideGraphs
    compiled, model, reference = _parallelized_copy(lambda: build(name), plan_name, world, lower="eager")
    g = torch.Generator().manual_seed(0)
    x, target, labels = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    labels[:3] = -100
    shard = lambda t: t.chunk(world)[rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(rank if name.endswith("rank_seeds") else 1)
        loss = compiled(shard(x), shard(target), shard(labels))
        loss.backward()
    torch.manual_seed(1)
    ref_loss = reference(x, target, labels)
    ref_loss.backward()
    return {
        "loss": loss.detach(), "ref_loss": ref_loss.detach(), "warnings": [str(w.message) for w in caught],
        "grads": [p.grad.full_tensor() for p in model.parameters()], "ref_grads": [p.grad for p in reference.parameters()],
    }
