"""Stack traces of traced nodes, recorded once per torch call of the user's code instead of once per node.

``make_fx(..., record_stack_traces=True)`` gives every node the stack of the Python frames that were
running when it was recorded (``node.meta["stack_trace"]``): errors name the user's line with it
(:func:`spmd_expand.errors.user_source_line`). torch's tracer takes it in ``TracerBase.create_node``:
``CapturedTraceback.extract().summary()`` symbolizes every frame of the stack and reads its source
line, about 50 frames per node, then keeps the frames of ``forward`` methods and of registered anchors
(the step function, ``torch.fx.proxy._register_stack_trace_anchor``) outside torch's own files
(``torch.fx.experimental.symbolic_shapes.uninteresting_files``). That was ~15% of tracing the GPT
step (8 layers, 4,573 nodes: 0.6-0.7 s of a 4.1 s first call on the fake process group).

:class:`RecordStackTraces`, a torch function mode active while ``make_fx`` runs the step, does the same
selection once per torch call the user's code makes, walking the frames without reading any source
line, and formats a stack it has not seen before (the same lines repeat in every layer); it hands the
text to the tracer through ``torch.fx.traceback.current_meta``, which the tracer copies onto every node
it records (needs ``fx_traceback.preserve_node_meta()``) and then skips its own extraction; a stack
already there (an ``fx.Interpreter`` replaying a Dynamo graph sets each node's) is kept. The nodes
of a call that records none (a metadata read such as ``x.shape``, whose result may still make a node:
``x.T``) and the nodes nothing sets a stack for keep torch's extraction. ``loss.backward()`` (and
``torch.autograd.backward`` / ``grad``) gives its stack to the nodes backward records, as torch's
extraction does for them (backward runs with every torch function mode off, so the frames there are
the same up to that call), unless the step checkpoints activations (``torch.utils.checkpoint``): the
forward that backward recomputes has frames of its own, so there every backward node's stack is left
to the tracer.

The text is torch's, from the same frames, except frames below the user's call: a ``forward`` inside
torch's own code that the call runs (``torch/_library/autograd.py`` for a custom op) is not listed.
Measured on that GPT step (DDP, 2 runs each): the trace 2.55-2.67 s -> 2.12-2.16 s, the first call
3.9-4.2 s -> 3.6-3.7 s; every node's text equal to torch's once torch's own frames are left out
(there, the GPT, a tiny Llama and an MLP, with and without activation checkpointing).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Optional

import torch
import torch.fx.proxy as fx_proxy
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint
from torch.fx.experimental.symbolic_shapes import uninteresting_files
from torch.overrides import TorchFunctionMode

__all__ = ["BACKWARD_CALLS", "RecordStackTraces"]

# The torch calls that run autograd's backward (also what trace._StepMode treats as backward).
BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
# Torch calls that read metadata: most of the calls a traced step makes, and few make nodes. They record
# no stack (the tracer extracts one for a node they make).
_METADATA_CALLS = frozenset(
    {
        "__get__", "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size", "storage_offset",
        "is_contiguous", "_is_view", "untyped_storage", "is_inference", "is_conj", "is_neg", "is_complex",
        "is_floating_point", "device", "get_device", "data_ptr", "__len__",
    }
)
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_KEY = "stack_trace"


class RecordStackTraces(TorchFunctionMode):
    """While tracing, sets ``fx_traceback.current_meta["stack_trace"]`` for the nodes of each torch call
    to the stack torch's tracer would record for them (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._uninteresting = uninteresting_files()
        self._texts: dict[tuple, Optional[str]] = {}
        self._checkpoints = False  # a call was made under torch.utils.checkpoint

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        meta = fx_traceback.current_meta  # read on every call: torch rebinds it
        if _KEY in meta or getattr(func, "__name__", None) in _METADATA_CALLS:
            # A stack set by someone else stays the nodes' stack, as in the tracer: an fx.Interpreter
            # replaying a graph (the backend's Dynamo graph) sets each node's, the user's line.
            return func(*args, **kwargs)
        text = self._text(sys._getframe(1))
        if text is None or (self._checkpoints and func in BACKWARD_CALLS):
            return func(*args, **kwargs)
        meta[_KEY] = text
        try:
            return func(*args, **kwargs)
        finally:
            meta.pop(_KEY, None)

    def _text(self, frame: Any) -> Optional[str]:
        """The stack text of the frames from ``frame`` outwards: those torch's tracer keeps (the
        ``forward`` methods and registered anchors outside torch's own files), outermost first."""
        anchors = fx_proxy._STACK_TRACE_ANCHORS
        uninteresting = self._uninteresting
        kept = []
        while frame is not None:
            code = frame.f_code
            name, filename = code.co_name, code.co_filename
            if (name == "forward" or (filename, name) in anchors) and filename not in uninteresting:
                kept.append((filename, frame.f_lineno, name))
            if filename == _CHECKPOINT_FILE:
                self._checkpoints = True
            frame = frame.f_back
        key = tuple(kept)
        if key not in self._texts:
            frames = [traceback.FrameSummary(f, line, n) for f, line, n in reversed(kept)]
            self._texts[key] = "".join(traceback.StackSummary.from_list(frames).format()).strip() or None
        return self._texts[key]
