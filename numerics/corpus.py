"""The step's token batches as the run's config specifies them, built here from the config values
(the trainer's seeded corpus, written again: lognormal document lengths with the given mean and
spread, clipped to [1, doc_len_max], Zipf(1.1) unigram tokens that skip eos, each document closed by
eos, the stream cut into rows of seq_len + 1 tokens; numpy's ``default_rng([seed, step])``).

The trainer records a hash of every micro-batch it trained on (``data_hashes`` in its state dump);
``batch_hash`` is that hash, so the check compares the data each rank really used with these
batches instead of trusting that both sides generate the same thing.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from numerics.run_config import RunConfig


def _documents(rng: np.random.Generator, need: int, c: RunConfig) -> list[int]:
    mu = np.log(c.doc_len_mean) - c.doc_len_sigma ** 2 / 2  # E[length] = mean before clipping
    lengths, covered = [], 0
    while covered < need:
        n = int(np.clip(np.round(rng.lognormal(mu, c.doc_len_sigma)), 1, c.doc_len_max))
        lengths.append(n)
        covered += n + 1
    return lengths


def global_batch(c: RunConfig, step: int) -> torch.Tensor:
    """[dp * micro_batches * micro_batch_size, seq_len + 1] token ids of ``step``."""
    rows, width = c.dp * c.micro_batches * c.micro_batch_size, c.seq_len + 1
    rng = np.random.default_rng([c.seed, step])
    lengths = _documents(rng, rows * width, c)
    weights = np.arange(1, c.vocab_size, dtype=np.float64) ** -1.1
    weights /= weights.sum()
    pieces = []
    for n in lengths:
        ids = rng.choice(c.vocab_size - 1, size=n, p=weights)
        pieces += [ids + (ids >= c.eos_id), np.array([c.eos_id])]
    stream = np.concatenate(pieces).astype(np.int64)[:rows * width]
    return torch.from_numpy(stream.reshape(rows, width).copy())


def replica_micro_batches(c: RunConfig, batch: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """DP replica ``dp``'s micro-batches of a global batch, each [micro_batch_size, seq_len + 1]."""
    per = c.micro_batches * c.micro_batch_size
    return list(batch[dp * per:(dp + 1) * per].split(c.micro_batch_size, 0))


def batch_hash(tokens: torch.Tensor) -> str:
    """sha256 of a micro-batch's int64 token ids, row-major (the trainer's ``data_hashes`` value)."""
    return hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


# Keys of a state dump's records (docs/numerics.md, "state dump"): the trainer writes them, the
# reference reads them by these formats.
def shard_key(point: str, dp: int, cp: int, tp: int, mb: int) -> str:
    return f"{point}/dp{dp}/cp{cp}/tp{tp}/mb{mb}"


def positions_key(dp: int, cp: int, mb: int) -> str:
    return f"dp{dp}/cp{cp}/mb{mb}"


def data_hash_key(dp: int, cp: int, tp: int, pp: int, mb: int) -> str:
    return f"dp{dp}/cp{cp}/tp{tp}/pp{pp}/mb{mb}"


LAYER_POINTS = (("attention.heads", "last"), ("attention", "seq"), ("mlp", "seq"), ("", "seq"))


def activation_points(c: RunConfig) -> list[tuple[str, str]]:
    """(point, shard layout) of every forward recording point, in forward order."""
    out = [("embed", "seq")]
    for i in range(c.n_layers):
        out += [(f"layers.{i}" + (f".{p}" if p else ""), kind) for p, kind in LAYER_POINTS]
    return out + [("norm", "seq"), ("logits", "last"), ("token_loss", "tokens")]
