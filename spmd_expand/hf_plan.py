"""The tensor-parallel plan a HuggingFace ``transformers`` model declares, as torch's TP styles.

A ``transformers`` model names its plan with style strings over module FQN globs, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", ...}``. Where the plan lives depends on the version:

* transformers 5.x: ``model.tp_plan`` (a property over ``model._tp_plan``) is the merged plan: the
  model class's own ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``), the base model's
  ``config.base_model_tp_plan`` prefixed with the base model's attribute name (``"model."``), the
  vocab-parallel input embedding that ``init_parallel_plans`` adds, and the children's plans;
* transformers 4.x: the same merge in ``model._tp_plan``;
* otherwise it is built here the same way from ``type(model)._tp_plan`` and
  ``model.config.base_model_tp_plan``, prefixed with ``model.base_model_prefix``.

:data:`HF_STYLES` maps each string with a torch equivalent; the layouts are those of transformers'
own classes (``transformers/distributed/tensor_parallel.py``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch.nn as nn
from torch.distributed.tensor import Replicate

from .errors import PlanError

__all__ = ["HF_STYLES", "huggingface_tp_plan"]


def _colwise(**kw) -> Callable[[], object]:
    def make():
        from torch.distributed.tensor.parallel import ColwiseParallel

        return ColwiseParallel(**kw)

    return make


def _rowwise(**kw) -> Callable[[], object]:
    def make():
        from torch.distributed.tensor.parallel import RowwiseParallel

        return RowwiseParallel(**kw)

    return make


def _sequence_parallel() -> object:
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel()


HF_STYLES: dict[str, Optional[Callable[[], object]]] = {
    "colwise": _colwise(),  # input replicated, output sharded on the last dim
    "rowwise": _rowwise(),  # input sharded on the last dim, output all-reduced
    "colwise_rep": _colwise(output_layouts=Replicate()),  # output gathered
    "colwise_gather_output": _colwise(output_layouts=Replicate()),
    "rowwise_rep": _rowwise(input_layouts=Replicate()),  # replicated input split locally
    "rowwise_split_input": _rowwise(input_layouts=Replicate()),
    "embedding_rowwise": _rowwise(input_layouts=Replicate()),  # vocab-parallel embedding
    "embedding_colwise": _colwise(output_layouts=Replicate()),  # hidden-dim shards, gathered
    "sequence_parallel": _sequence_parallel,
    # transformers 4.x: the same layouts computed on local tensors.
    "local_colwise": _colwise(),
    "local_rowwise": _rowwise(),
    # Parameters kept whole. A replicated parameter that meets sharded activations gets a partial
    # gradient, which the gradient reduction of the whole-step graph sums anyway.
    "replicate": None,
    "replicated_with_grad_allreduce": None,
}
"""HF style string -> factory of the torch style (None: the module keeps replicated parameters and
needs no entry). Strings not listed (packed, MoE, expert-parallel, MLA, local-parameter styles)
compute on local tensors in ways no torch style describes, and are refused."""


def _declared_plan(model: nn.Module) -> dict[str, str]:
    # transformers 5.x: the `tp_plan` property; 4.x: `_tp_plan` merged onto the instance by
    # post_init (a class-level `_tp_plan` is only the model class's own entries).
    for plan in (getattr(model, "tp_plan", None), vars(model).get("_tp_plan")):
        if isinstance(plan, Mapping) and plan:
            return dict(plan)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    # The base model is a submodule (e.g. `model` of LlamaForCausalLM) or the model itself.
    if prefix and isinstance(getattr(model, prefix, None), nn.Module) and getattr(model, prefix) is not model:
        plan.update({f"{prefix}.{k}": v for k, v in base.items()})
    else:
        plan.update(base)
    return plan


def huggingface_tp_plan(model: nn.Module, overrides: Optional[Mapping[str, Union[str, object, None]]] = None) -> dict[str, object]:
    """``{module glob: torch TP style}`` for ``model`` from its own HF TP plan (see the module doc).

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (or any module with ``tp_plan`` / ``_tp_plan`` /
            ``config.base_model_tp_plan``).
        overrides: glob (full FQN, e.g. ``"lm_head"``) -> HF style string, torch style, or None to
            drop the entry; applied on top of the declared plan.

    Entries whose glob matches no submodule of ``model`` (generic per-architecture plans name modules
    some configurations lack) are left out; entries that map to no style (``"replicate"``) too.

    Raises:
        PlanError: the model declares no plan; a string has no torch equivalent (all such entries are
            named); or an entry names a parameter rather than a module.
    """
    from .plans import fqn_matches

    declared = _declared_plan(model)
    if not declared and not overrides:
        raise PlanError(
            f"{type(model).__name__} declares no tensor-parallel plan (tp_plan, _tp_plan or "
            f"config.base_model_tp_plan); write one: spmd.TensorParallel({{glob: torch style}})"
        )
    merged: dict[str, object] = {**declared, **dict(overrides or {})}
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    plan: dict[str, object] = {}
    refused: dict[str, str] = {}  # glob -> why
    for glob, style in merged.items():
        if style is None:
            continue
        if not any(fqn_matches(glob, m) for m in modules):
            if any(fqn_matches(glob, p) for p in params):
                refused[glob] = f"{glob!r}: {style!r} (names a parameter; torch's styles apply to modules)"
            continue
        if not isinstance(style, str):
            plan[glob] = style
        elif style not in HF_STYLES:
            refused[glob] = f"{glob!r}: {style!r}"
        elif HF_STYLES[style] is not None:
            plan[glob] = HF_STYLES[style]()
    if refused:
        raise PlanError(
            f"{type(model).__name__}'s tensor-parallel plan uses styles with no torch equivalent: "
            f"{', '.join(refused.values())}; spmd_expand maps {', '.join(sorted(HF_STYLES))}. Pass overrides= "
            f"with a torch style (or None to leave the module replicated) for these entries"
            + f", e.g. overrides={ dict.fromkeys(refused) }"
            + (" (the experts of a mixture of experts stay replicated, attention and the other MLPs are still "
               "sharded)" if any("moe" in str(merged[glob]) for glob in refused) else "")
        )
    return plan
