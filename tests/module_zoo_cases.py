"""torch.nn's own layers under data parallelism: each small model's gradients on 2 ranks vs one device.

Convolutions (1-D/2-D/3-D, transposed, padding modes), Group/Instance/Batch/Layer/RMS norm, pooling
(max, average, adaptive), upsampling, PixelShuffle, MultiheadAttention, TransformerEncoder,
Transformer, GRU, LSTM, embeddings, activations. Layers with no DTensor rule (EmbeddingBag, Bilinear)
must be refused with UnsupportedOpError, never run wrong.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
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


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(3, 8, batch_first=True)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


class _EmbeddingBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean")
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(self.bag(x))


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


# name -> (model, input)
MODELS = {
    "conv2d_groupnorm_pools": (_conv2d, _images),
    "conv1d_instancenorm_avgpool": (_conv1d, lambda g: torch.randn(B, 3, 16, generator=g)),
    "conv3d_pools": (_conv3d, lambda g: torch.randn(B, 3, 4, 4, 4, generator=g)),
    "conv_transpose_batchnorm": (_conv_transpose, _images),
    "upsample_pixelshuffle": (_upsample, _images),
    "norms_activations": (_misc, lambda g: torch.randn(B, 6, generator=g)),
    "multihead_attention": (_Attention, _sequences),
    "token_pool_adaptive_avg_pool1d": (_TokenPool, _sequences),
    "channels_last_cnn": (_channels_last_cnn, lambda g: _images(g).to(memory_format=torch.channels_last)),
    "transformer_encoder": (_Encoder, _sequences),
    "transformer": (_Transformer, _sequences),
    "gru": (lambda: _Recurrent(nn.GRU), lambda g: torch.randn(B, 5, 3, generator=g)),
    # Two layers, traced as torch's LSTM decomposition (its CPU oneDNN kernel has no rule).
    "lstm": (lambda: _Recurrent(lambda i, h, batch_first: nn.LSTM(i, h, num_layers=2, batch_first=batch_first)), lambda g: torch.randn(B, 5, 3, generator=g)),
    "weight_norm_spectral_norm": (_WeightNormConv, lambda g: torch.randn(B, 3, 16, generator=g)),
}
REFUSED = {
    "embedding_bag": ((_EmbeddingBag, lambda g: torch.randint(0, 20, (B, 6), generator=g)), "_embedding_bag"),
    "bilinear": ((lambda: nn.Bilinear(6, 6, CLASSES), None), "_trilinear"),
}


class _Pair(nn.Module):
    """``Bilinear(x, x.flip(-1))`` as a one-input model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, x.flip(-1))


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
        (build, batch), _ = REFUSED[name] if name in REFUSED else (MODELS[name], None)
        try:
            torch.manual_seed(0)
            model = build()
            if name == "bilinear":
                model, batch = _Pair(model), (lambda g: torch.randn(B, 6, generator=g))
            reference = copy.deepcopy(model)
            g = torch.Generator().manual_seed(1)
            x, y = batch(g), torch.randint(0, CLASSES, (B,), generator=g)
            compiled = spmd.compile(mesh=mesh, plan=spmd.FSDP() if plan == "fsdp" else spmd.DDP(), lower="eager")(step)
            ref_loss, ref_grads = step(reference, x, y)
            loss, grads = compiled(model, x.chunk(world)[rank], y.chunk(world)[rank])
            results[name] = {
                "loss": loss.detach(), "ref_loss": ref_loss.detach(),
                "grads": [_full(t) for t in grads], "ref_grads": [t.clone() for t in ref_grads],
            }
        except spmd.UnsupportedOpError as e:
            results[name] = {"refused": str(e)}
        except Exception:  # noqa: BLE001 - reported per model by the test
            results[name] = {"error": traceback.format_exc()}
    return results
