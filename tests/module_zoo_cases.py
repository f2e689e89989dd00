"""torch.nn's own layers under data parallelism: each small model's gradients on 2 ranks vs one device.

Convolutions (1-D/2-D/3-D, transposed, padding modes), Group/Instance/Batch/Layer/RMS norm, pooling
(max, average, adaptive), upsampling, PixelShuffle, MultiheadAttention, TransformerEncoder,
Transformer, GRU, LSTM, embeddings (EmbeddingBag, frequency-scaled gradients), Bilinear, activations,
custom autograd.Functions.
A form with no sharding rule (EmbeddingBag's 1-D input with offsets) must be refused with
UnsupportedOpError, never run wrong.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd

B, CLASSES = 8, 4


def _conv2d():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), nn.GroupNorm(2, 8), nn.SiLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, CLASSES),
    )


def _conv1d():
    return nn.Sequential(
        nn.Conv1d(3, 8, 5, padding=2, padding_mode="circular"), nn.InstanceNorm1d(8, affine=True), nn.ReLU(),
        nn.AvgPool1d(2), nn.Flatten(), nn.Linear(8 * 8, CLASSES),
    )


def _conv3d():
    return nn.Sequential(
        nn.Conv3d(3, 4, 3, padding=1), nn.LeakyReLU(), nn.AvgPool3d(2), nn.AdaptiveMaxPool3d(1), nn.Flatten(),
        nn.Linear(4, CLASSES),
    )


def _conv_transpose():
    return nn.Sequential(
        nn.ConvTranspose2d(3, 4, 2, stride=2), nn.BatchNorm2d(4), nn.Hardswish(), nn.AdaptiveMaxPool2d(4),
        nn.Flatten(), nn.Linear(4 * 16, CLASSES),
    )


def _upsample():
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2, mode="bilinear"), nn.PixelShuffle(2), nn.Flatten(),
        nn.Linear(32 * 32, CLASSES),
    )


def _misc():
    return nn.Sequential(
        nn.Linear(6, 16), nn.LayerNorm(16), nn.Mish(), nn.Linear(16, 16), nn.RMSNorm(16), nn.GELU(approximate="tanh"),
        nn.Linear(16, CLASSES), nn.LogSoftmax(-1),
    )


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(self.mha(x, x, x, need_weights=False)[0].mean(1))


class _AttentionWeights(nn.Module):
    """``nn.MultiheadAttention``'s default ``need_weights=True`` path (explicit softmax, averaged weights
    returned), with key/value of another width (``kdim``/``vdim``), a key padding mask and a causal mask.
    Its output projection's ``(T * B, E) -> (T, B, E)`` reshape stopped DTensor when T (5) is not a
    multiple of the mesh size."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True, kdim=8, vdim=8)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        kv = x[..., :8]
        padding = torch.zeros(x.size(0), x.size(1), dtype=torch.bool)
        padding[:, -1] = True
        causal = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), 1)
        out, weights = self.mha(x, kv, kv, key_padding_mask=padding, attn_mask=causal)
        return self.out(out.mean(1)) + weights.sum((1, 2))[:, None]


class _SpatialTransformer(nn.Module):
    """torch's spatial transformer tutorial: ``affine_grid`` from a predicted ``theta``, then
    ``grid_sample`` (the backward of ATen's ``affine_grid_generator`` needs a concrete batch size)."""

    def __init__(self):
        super().__init__()
        self.localization = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 6))
        self.out = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, CLASSES))

    def forward(self, x):
        theta = self.localization(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size())
        return self.out(F.grid_sample(x, grid, align_corners=False))


class _CheckpointedForms(nn.Module):
    """EmbeddingBag, Swin's token pool and Bilinear inside ``torch.utils.checkpoint``: the forward re-run
    in backward must record the same forms as the first run (checkpoint compares the saved tensors)."""

    def __init__(self):
        super().__init__()
        self.bag, self.emb = nn.EmbeddingBag(20, 8, padding_idx=0), nn.Embedding(20, 8)
        self.pool, self.mix = nn.AdaptiveAvgPool1d(1), nn.Bilinear(8, 8, CLASSES)

    def block(self, ids):
        return self.mix(self.bag(ids), self.pool(self.emb(ids).transpose(1, 2)).flatten(1))

    def forward(self, ids):
        return torch.utils.checkpoint.checkpoint(self.block, ids, use_reentrant=False)


def _pads():
    return nn.Sequential(
        nn.ReplicationPad2d(1), nn.Conv2d(3, 4, 3), nn.Flatten(2), nn.ReplicationPad1d(2), nn.ReflectionPad1d(1),
        nn.CircularPad1d(1), nn.Flatten(), nn.Linear(4 * 72, CLASSES),
    )


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(self.enc(x).mean(1))


class _Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(self.t(x, x[:, :3]).mean(1))


class _SequenceFirst(nn.Module):
    """Sequence-first modules (``batch_first=False``, torch's default for ``nn.LSTM`` and
    ``nn.Transformer*``) fed batch-first data transposed in forward: the plan splits dim 0 of the
    step's batch, dim 1 of the modules' inputs."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "lstm":
            self.body = nn.LSTM(16, 16, num_layers=2)
        else:
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0), 2, enable_nested_tensor=False)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        h = self.body(x.transpose(0, 1))
        return self.out((h[0] if isinstance(h, tuple) else h).mean(0))


class _SequenceFirstLM(nn.Module):
    """A language model on ``(seq, batch)`` tokens, as torch's word_language_model example batches
    them: a sequence-first Transformer layer and LSTM, logits as ``(seq, vocab, batch)`` for
    ``cross_entropy`` against ``(seq, batch)`` targets. Trained with the plan's ``batch_dim=1``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CLASSES, 16)
        self.attn = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
        self.rnn = nn.LSTM(16, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, tokens):
        h, _ = self.rnn(self.attn(self.emb(tokens)))
        return self.out(h).permute(0, 2, 1)


def _tokens(g):
    return torch.randint(0, CLASSES, (5, B), generator=g)


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(3, 8, batch_first=True)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


class _Pair(nn.Module):
    """``Bilinear(x, x.flip(-1))`` as a one-input model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, x.flip(-1))


class _Embedding(nn.Module):
    """``nn.Embedding(scale_grad_by_freq=True)``: each row's gradient is divided by how often its index
    occurs in the whole batch (DTensor's rule counted each rank's part: gradients silently too large)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, scale_grad_by_freq=True)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


class _EmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` over fixed-size bags (a 2-D input, as DLRM's sparse features);
    ``weighted``: per-sample weights computed from the indices (mode "sum" only)."""

    def __init__(self, weighted: bool = False, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, **options)
        self.weighted = weighted
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        weights = (x.float() + 1).reciprocal() if self.weighted else None
        return self.out(self.bag(x, per_sample_weights=weights))


class _EmbeddingBagOffsets(_EmbeddingBag):
    """The 1-D form: flattened indices and bag offsets (refused: the offsets index the global batch)."""

    def forward(self, x):
        return self.out(self.bag(x.flatten(), torch.arange(0, x.numel(), x.size(1))))


def _bags(g):
    """Indices of 8 bags of 6; index 0 (the padding index where one is set) fills bag 1 alone."""
    x = torch.randint(0, 20, (B, 6), generator=g)
    x[1] = 0
    return x


class _WeightNormConv(nn.Module):
    """``weight_norm`` on a convolution (audio vocoders, wav2vec2's positional conv) and
    ``spectral_norm`` on a linear layer (GAN discriminators), both as parametrizations."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 6, 3, padding=1))
        self.out = nn.utils.parametrizations.spectral_norm(nn.Linear(6, CLASSES))

    def forward(self, x):
        return self.out(F.gelu(self.conv(x)).mean(-1))


class _TokenPool(nn.Module):
    """Tokens pooled over the sequence by ``AdaptiveAvgPool1d(1)`` on ``(batch, channels, tokens)``
    (Swin's and several vision transformers' pooler). On the transposed input, ATen's adaptive average
    pool to size 1 is a mean followed by ``as_strided_`` restoring the channels-last strides."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(torch.flatten(self.pool(self.proj(x).transpose(1, 2)), 1))


class _UnfoldPatches(nn.Module):
    """Image patches cut with ``Tensor.unfold`` (height, then width), flattened into tokens and
    embedded (a vision transformer's patch embedding written without a strided convolution), after a
    1x1 convolution so that the windows' gradient (``unfold_backward``) is computed too."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(3, 3, 1)
        self.embed = nn.Linear(3 * 4 * 4, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        patches = self.mix(x).unfold(2, 4, 4).unfold(3, 4, 4)  # (B, 3, 2, 2, 4, 4)
        tokens = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # (B, 4, 48)
        return self.out(F.gelu(self.embed(tokens)).mean(1))


def _channels_last_cnn():
    """A CNN in channels-last memory format (``model.to(memory_format=torch.channels_last)``, a common
    speed-up for vision training), global-average-pooled by ``AdaptiveAvgPool2d(1)``."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES),
    ).to(memory_format=torch.channels_last)


def _images(g):
    return torch.randn(B, 3, 8, 8, generator=g)


def _sequences(g):
    return torch.randn(B, 5, 16, generator=g)


class _GradientReversal(torch.autograd.Function):
    """Domain-adversarial training's layer (Ganin & Lempitsky 2015): identity forward, -alpha * grad back."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class _StraightThroughRound(torch.autograd.Function):
    """Quantization-aware training's estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _LinearFunction(torch.autograd.Function):
    """torch's "Extending PyTorch" example: handed the parameter itself, saves it for backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _CustomFunctions(nn.Module):
    """Custom ``autograd.Function``s. A parameter handed straight to one made the trace deadlock (autograd
    asks it for its device while holding its lock, and marking that read took the lock again)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = h + _GradientReversal.apply(h, 0.5) + _StraightThroughRound.apply(3 * h) / 3
        return self.head(_LinearFunction.apply(h, self.weight))


# name -> (model, input)
MODELS = {
    "conv2d_groupnorm_pools": (_conv2d, _images),
    "conv1d_instancenorm_avgpool": (_conv1d, lambda g: torch.randn(B, 3, 16, generator=g)),
    "conv3d_pools": (_conv3d, lambda g: torch.randn(B, 3, 4, 4, 4, generator=g)),
    "conv_transpose_batchnorm": (_conv_transpose, _images),
    "upsample_pixelshuffle": (_upsample, _images),
    "norms_activations": (_misc, lambda g: torch.randn(B, 6, generator=g)),
    "multihead_attention": (_Attention, _sequences),
    "multihead_attention_weights_masks_kdim": (_AttentionWeights, _sequences),
    "spatial_transformer": (_SpatialTransformer, _images),
    "replication_reflection_circular_pads": (_pads, _images),
    "checkpointed_forms": (_CheckpointedForms, _bags),
    "token_pool_adaptive_avg_pool1d": (_TokenPool, _sequences),
    "unfold_patches": (_UnfoldPatches, _images),
    "channels_last_cnn": (_channels_last_cnn, lambda g: _images(g).to(memory_format=torch.channels_last)),
    "transformer_encoder": (_Encoder, _sequences),
    "transformer": (_Transformer, _sequences),
    "gru": (lambda: _Recurrent(nn.GRU), lambda g: torch.randn(B, 5, 3, generator=g)),
    # Two layers, traced as torch's LSTM decomposition (its CPU oneDNN kernel has no rule).
    "lstm": (lambda: _Recurrent(lambda i, h, batch_first: nn.LSTM(i, h, num_layers=2, batch_first=batch_first)), lambda g: torch.randn(B, 5, 3, generator=g)),
    "lstm_sequence_first": (lambda: _SequenceFirst("lstm"), _sequences),
    "transformer_encoder_sequence_first": (lambda: _SequenceFirst("transformer"), _sequences),
    "sequence_first_lm_batch_dim_1": (_SequenceFirstLM, _tokens),
    "weight_norm_spectral_norm": (_WeightNormConv, lambda g: torch.randn(B, 3, 16, generator=g)),
    "embedding_scale_grad_by_freq": (_Embedding, _bags),
    # Traced as the embedding and a per-bag reduction (ATen's fused kernel has no sharding rule).
    "embedding_bag_mean_padding": (lambda: _EmbeddingBag(mode="mean", padding_idx=0), _bags),
    "embedding_bag_max_padding": (lambda: _EmbeddingBag(mode="max", padding_idx=0), _bags),
    "embedding_bag_sum_weighted": (lambda: _EmbeddingBag(weighted=True, mode="sum"), _bags),
    # Traced as an einsum (ATen's _trilinear has no sharding rule); one input: Bilinear(x, x.flip(-1)).
    "bilinear": (lambda: _Pair(nn.Bilinear(6, 6, CLASSES)), lambda g: torch.randn(B, 6, generator=g)),
    "custom_autograd_functions": (_CustomFunctions, lambda g: torch.randn(B, 6, generator=g)),
}
# Models whose batch tensors (inputs and targets) hold the samples on dim 1; default 0.
BATCH_DIM = {"sequence_first_lm_batch_dim_1": 1}
# Targets other than one class per sample.
TARGETS = {"sequence_first_lm_batch_dim_1": _tokens}
# name -> ((model, batch), the op named, what the fix says)
REFUSED = {
    "embedding_bag_offsets": ((lambda: _EmbeddingBagOffsets(mode="sum"), _bags), "_embedding_bag", "2-D (bags, bag_size) input"),
}


def step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    return loss, grads


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_models(rank: int, world: int, plan: str, names: list[str]) -> dict:
    """Worker: per model, (loss, grads) compiled and on one device; or the error it raised."""
    import traceback

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        build, batch = REFUSED[name][0] if name in REFUSED else MODELS[name]
        try:
            torch.manual_seed(0)
            model = build()
            reference = copy.deepcopy(model)
            g = torch.Generator().manual_seed(1)
            x = batch(g)
            y = TARGETS[name](g) if name in TARGETS else torch.randint(0, CLASSES, (B,), generator=g)
            dim = BATCH_DIM.get(name, 0)
            style = spmd.FSDP(batch_dim=dim) if plan == "fsdp" else spmd.DDP(batch_dim=dim)
            compiled = spmd.compile(mesh=mesh, plan=style, lower="eager")(step)
            ref_loss, ref_grads = step(reference, x, y)
            loss, grads = compiled(model, x.chunk(world, dim)[rank], y.chunk(world, dim)[rank])
            results[name] = {
                "loss": loss.detach(), "ref_loss": ref_loss.detach(),
                "grads": [_full(t) for t in grads], "ref_grads": [t.clone() for t in ref_grads],
            }
        except spmd.UnsupportedOpError as e:
            results[name] = {"refused": str(e)}
        except Exception:  # noqa: BLE001 - reported per model by the test
            results[name] = {"error": traceback.format_exc()}
    return results


# ------------------------------------------------------------------ TransformerEncoder's nested fast path
def _encoder(mask_check: bool = True) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), mask_check=mask_check)
    with torch.no_grad():
        encoder.norm.bias.normal_()  # norm(0) at a padded position is the bias: not zero
    return encoder


class _Distillation(nn.Module):
    """A student trained against a frozen encoder (a teacher) over every position."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(16, 16)
        self.teacher = _encoder().requires_grad_(False)


def distillation_step(model, optimizer, x, pad):
    model.teacher.eval()
    with torch.no_grad():
        target = model.teacher(x, src_key_padding_mask=pad)
    loss = F.mse_loss(model.student(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def unmasked_pooling(model, x, pad):
    return model(x, src_key_padding_mask=pad).square().mean()


def encoder_fast_path_worker(rank: int, world: int, plan: str) -> dict:
    """Worker: an eval-mode ``nn.TransformerEncoder`` with a padding mask, where one device runs torch's
    nested-tensor path (zeros before ``norm`` at padded positions): a distillation step against it as a
    frozen teacher, and an evaluation step called under ``no_grad`` (nested path), with gradients on
    (regular path: a graph of its own), under ``no_grad`` again (the first graph), with left padding (the
    mask check fails: regular path), with torch's MHA fast path off (regular path: a graph of its own),
    and for an encoder without the mask check. Losses compiled and on
    one device, and how many graphs the evaluation step compiled."""
    import warnings

    mesh = init_device_mesh("cpu", (world,))
    style = spmd.FSDP() if plan == "fsdp" else spmd.DDP()
    part = lambda t: t.chunk(world)[rank]  # noqa: E731
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 16, generator=g)
    lengths = torch.tensor([6, 4, 3, 5])
    right = torch.arange(6)[None] >= lengths[:, None]  # tokens first, then padding
    left = right.flip(1)
    out: dict = {}

    torch.manual_seed(0)
    model = _Distillation()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.student.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=style, lower="eager")(distillation_step)
    out["distillation"] = (
        [step(model, opt, part(x), part(right)).item() for _ in range(3)],
        [distillation_step(reference, ref_opt, x, right).item() for _ in range(3)],
    )
    out["student"] = (_full(model.student.weight), reference.student.weight.detach().clone())

    for name, mask_check in (("checked", True), ("unchecked", False)):
        torch.manual_seed(0)
        encoder = _encoder(mask_check).eval()
        reference = copy.deepcopy(encoder)
        evaluate = spmd.compile(mesh=mesh, plan=style, lower="eager")(unmasked_pooling)
        # The last call turns torch's MHA fast path off: one device takes the regular path there.
        calls = [("no_grad", right), ("grad", right), ("no_grad", right), ("no_grad", left), ("no_fast_path", right)]
        got, want = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for mode, pad in calls:
                context = torch.no_grad() if mode != "grad" else contextlib.nullcontext()
                torch.backends.mha.set_fastpath_enabled(mode != "no_fast_path")
                try:
                    with context:
                        got.append(evaluate(encoder, part(x), part(pad)).item())
                        want.append(unmasked_pooling(reference, x, pad).item())
                finally:
                    torch.backends.mha.set_fastpath_enabled(True)
        recompiles = [str(w.message) for w in caught if "compiling unmasked_pooling again" in str(w.message)]
        out[name] = (got, want, recompiles)
    return out
