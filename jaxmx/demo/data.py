"""Byte-level text that ships with Python: the pydoc topic help (``pydoc_data.topics``).

Example:
    >>> from jaxmx.demo import data
    >>> train, val = data.load_splits()
    >>> train.dtype, len(train) > 10 * len(val) // 2
    (dtype('uint8'), True)
"""

from __future__ import annotations

import numpy as np

VOCAB = 256  # bytes


def load_text() -> bytes:
    """All pydoc topics, in sorted key order, UTF-8 encoded (about 470 kB)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_splits(val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) byte arrays: the last ``val_fraction`` of the text is validation."""
    data = np.frombuffer(load_text(), dtype=np.uint8)
    n_val = int(len(data) * val_fraction)
    return data[:-n_val], data[-n_val:]


def unigram_entropy(data: np.ndarray) -> float:
    """Entropy (nats) of the byte frequencies of ``data``: the best context-free model's loss."""
    counts = np.bincount(data, minlength=VOCAB)
    p = counts[counts > 0] / len(data)
    return float(-(p * np.log(p)).sum())


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
    """Endless (inputs, targets) int32 batches [batch, seq_len] at random offsets, fixed by seed."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        yield _windows(data, starts, seq_len)


def eval_batches(data: np.ndarray, batch: int, seq_len: int, max_batches: int | None = None):
    """Consecutive non-overlapping windows covering ``data`` (the last partial batch dropped)."""
    n_windows = (len(data) - 1) // seq_len
    n_batches = n_windows // batch
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches == 0:
        raise ValueError(f"validation data too short for batch {batch} x seq_len {seq_len}")
    starts = np.arange(n_batches * batch).reshape(n_batches, batch) * seq_len
    return [_windows(data, s, seq_len) for s in starts]


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int):
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = data[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]
