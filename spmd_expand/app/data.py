"""Character-level corpus, tokenizer and batches for the training demo.

Everything here is deterministic: the default corpus is the installed torch package's own
Python sources in a fixed order, the vocabulary depends only on the text, and a batch depends
only on ``(seed, step)``, so every data-parallel rank can build the same global batch and
:func:`shard` it locally without communicating.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

__all__ = ["default_corpus_files", "load_text", "CharTokenizer", "TextBatches", "shard"]


def _files_under(root: Path, suffix: str = "") -> list[Path]:
    """Regular files below ``root`` whose name ends with ``suffix``, sorted by relative path."""
    files = (p for p in root.rglob(f"*{suffix}") if p.is_file())
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def default_corpus_files() -> list[Path]:
    """The ``.py`` files of the installed torch package, sorted by path relative to it."""
    return _files_under(Path(os.path.dirname(torch.__file__)), ".py")


def _read_text(path: Path) -> str | None:
    """UTF-8 contents of ``path`` (undecodable bytes replaced), or ``None`` for binary files."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def _concat(files: Iterable[Path], max_chars: int) -> str:
    parts: list[str] = []
    n = 0
    for f in files:
        if n >= max_chars:
            break
        text = _read_text(f)
        if text is None:
            continue
        parts.append(text)
        n += len(text)
    return "".join(parts)[:max_chars]


def load_text(path: str | None = None, max_chars: int = 2_000_000) -> str:
    """Load at most ``max_chars`` characters of training text.

    Args:
        path: ``None`` for :func:`default_corpus_files`; a text file; or a folder, whose
            regular files are read recursively in sorted relative-path order, skipping
            binary files (those containing NUL bytes).
        max_chars: the concatenated text is truncated to this many characters.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the result is empty, or ``path`` is a binary file.
    """
    if path is None:
        text = _concat(default_corpus_files(), max_chars)
        source = "the default corpus (torch's .py files)"
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"corpus path does not exist: {path}")
        if p.is_dir():
            text = _concat(_files_under(p), max_chars)
        else:
            full = _read_text(p)
            if full is None:
                raise ValueError(f"corpus file is binary (contains NUL bytes): {path}")
            text = full[:max_chars]
        source = str(path)
    if not text:
        raise ValueError(f"no text found in {source}")
    return text


class CharTokenizer:
    """Character vocabulary built from a text.

    The vocabulary keeps the most frequent characters of the text (ties broken by smaller
    code point), assigns them ids ``1 ..`` in code-point order, and reserves id
    :attr:`UNK_ID` (0) for every other character.

    Args:
        text: the text to build the vocabulary from.
        max_vocab_size: cap on :attr:`vocab_size`, ``<unk>`` included; ``None`` keeps every
            character of ``text``.
    """

    UNK_ID = 0
    UNK_CHAR = "\ufffd"
    """What :meth:`decode` produces for :attr:`UNK_ID`."""

    def __init__(self, text: str, max_vocab_size: int | None = None) -> None:
        if max_vocab_size is not None and max_vocab_size < 1:
            raise ValueError(f"max_vocab_size must be >= 1, got {max_vocab_size}")
        counts = Counter(text)
        by_frequency = sorted(counts, key=lambda c: (-counts[c], ord(c)))
        if max_vocab_size is not None:
            by_frequency = by_frequency[: max_vocab_size - 1]
        chars = sorted(by_frequency)
        self._itos = [self.UNK_CHAR, *chars]
        self._stoi = {c: i for i, c in enumerate(chars, start=1)}
        self.vocab_size = len(self._itos)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text``'s characters: int64 of shape ``(len(text),)``."""
        return torch.tensor([self._stoi.get(c, self.UNK_ID) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Inverse of :meth:`encode`; ``ids`` is a 1-D tensor or a sequence of ints."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self._itos[i] for i in ids)


class TextBatches:
    """Random next-character-prediction windows from a 1-D id sequence.

    Args:
        ids: int64 token ids of shape ``(N,)`` with ``N > block_size``.
        block_size: sequence length ``T`` of each example.
        batch_size: global batch size ``B``.
        seed: together with the step, selects the windows.
    """

    def __init__(self, ids: torch.Tensor, block_size: int, batch_size: int, seed: int = 0) -> None:
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() <= block_size:
            raise ValueError(f"need more than block_size={block_size} ids, got {ids.numel()}")
        self.ids = ids.long()
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch for ``step``, identical on every call and every process.

        Returns:
            ``(x, y)``, both int64 ``(batch_size, block_size)``, where ``y[:, t]`` is the
            character following ``x[:, t]`` (``y`` is ``x`` shifted left by one).
        """
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, self.ids.numel() - self.block_size, (self.batch_size,), generator=g
        )
        windows = self.ids[starts[:, None] + torch.arange(self.block_size + 1)]
        # Contiguous so callers can flatten them with .view (the model does for targets).
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """The local batch a data-parallel rank passes in.

    Returns ``rank``'s contiguous chunk of ``x`` along ``dim`` (the ``rank``-th element of
    ``torch.chunk(x, world_size, dim)``); concatenating all ranks' shards gives the global
    batch. ``x.size(dim)`` must be divisible by ``world_size``: with uneven shards the mean
    of the per-rank mean losses would no longer equal the global mean loss.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    size = x.size(dim)
    if size % world_size != 0:
        raise ValueError(f"size {size} along dim {dim} is not divisible by world_size {world_size}")
    local = size // world_size
    return x.narrow(dim, rank * local, local)
