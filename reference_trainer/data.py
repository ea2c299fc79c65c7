"""Seeded synthetic corpus: heavy-tailed document lengths packed into fixed-length sequences.

The global batch of a step depends only on (seed, step, data parameters, global batch shape), never
on the parallel layout, so every layout and the single-process reference see the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import TrainConfig


def document_lengths(rng: np.random.Generator, n_tokens: int, mean: float, sigma: float,
                     max_len: int) -> list[int]:
    """Lognormal lengths (heavy right tail) with the given mean, clipped to [1, max_len],
    enough of them to cover ``n_tokens``."""
    mu = np.log(mean) - sigma * sigma / 2  # so that E[len] = mean before clipping
    out: list[int] = []
    total = 0
    while total < n_tokens:
        n = int(np.clip(np.round(rng.lognormal(mu, sigma)), 1, max_len))
        out.append(n)
        total += n + 1  # + eos
    return out


def pack_documents(rng: np.random.Generator, n_seqs: int, seq_tokens: int, vocab: int, eos: int,
                   mean: float, sigma: float, max_len: int) -> torch.Tensor:
    """``n_seqs`` rows of ``seq_tokens`` tokens: documents of random non-eos tokens, each followed
    by ``eos``, concatenated and cut at row boundaries (a document may continue in the next row)."""
    need = n_seqs * seq_tokens
    lengths = document_lengths(rng, need, mean, sigma, max_len)
    # Zipf-like unigram frequencies, so the model has something to learn (loss falls below ln V)
    freq = 1.0 / np.arange(1, vocab) ** 1.1
    freq /= freq.sum()
    stream = np.empty(sum(lengths) + len(lengths), dtype=np.int64)
    pos = 0
    for n in lengths:
        toks = rng.choice(vocab - 1, size=n, p=freq)
        toks = toks + (toks >= eos)  # skip the eos id
        stream[pos:pos + n] = toks
        stream[pos + n] = eos
        pos += n + 1
    return torch.from_numpy(stream[:need].reshape(n_seqs, seq_tokens).copy())


class Corpus:
    """Per-step global batches: [dp * micro_batches * micro_batch_size, seq_len + 1] token ids."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def global_batch(self, step: int) -> torch.Tensor:
        c = self.cfg
        n_seqs = c.dp * c.micro_batches * c.micro_batch_size
        rng = np.random.default_rng([c.seed, step])
        return pack_documents(rng, n_seqs, c.seq_len + 1, c.vocab_size, c.eos_id, c.doc_len_mean,
                              c.doc_len_sigma, c.doc_len_max)

    def micro_batches(self, step: int, dp_rank: int) -> list[torch.Tensor]:
        """This DP replica's micro-batches, each [micro_batch_size, seq_len + 1]."""
        c = self.cfg
        batch = self.global_batch(step)
        per_replica = c.micro_batches * c.micro_batch_size
        mine = batch[dp_rank * per_replica:(dp_rank + 1) * per_replica]
        return list(mine.split(c.micro_batch_size, 0))


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Document index of every position of [b, s] inputs: a document ends at (and includes) eos."""
    ends = (tokens == eos).long()
    starts = torch.cumsum(ends, dim=-1) - ends  # eos belongs to the document it closes
    return starts
