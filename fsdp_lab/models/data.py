"""Synthetic token batches: deterministic, learnable, never downloaded.

Tokens follow a fixed random first-order Markov chain: every token has ``SUCCESSORS`` possible
next tokens with probabilities ``SUCCESSOR_PROBS``. The chain depends on ``seed`` only; which
tokens a batch holds depends on (seed, rank, step). A model can learn the chain, so its loss
falls from ln(vocab_size) towards the chain's entropy (at most 0.91 nats).

For parity tests, build one ``global_batch`` and give rank r ``shard_batch(batch, r, world_size)``:
the shards concatenated along the batch dimension are exactly the global batch.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from fsdp_lab.checks import check_positive_int

SUCCESSOR_PROBS = (0.7, 0.15, 0.1, 0.05)  # probability of each of a token's possible next tokens
SUCCESSORS = len(SUCCESSOR_PROBS)


@dataclass
class Batch:
    """Token ids and next-token labels, both (batch, seq) int64; ``len(batch)`` is the batch size."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self):
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.labels.shape:
            raise ValueError(f"input_ids and labels must be 2-D (batch, seq) of one shape, got "
                             f"{tuple(self.input_ids.shape)} and {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Number of label tokens (batch * seq)."""
        return self.labels.numel()

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy of the batch on ``device``."""
        return Batch(self.input_ids.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking))

    def split(self, microbatch_size: int) -> list["Batch"]:
        """Microbatches of ``microbatch_size`` rows (the last may be smaller), like ``Tensor.split``.

        Raises ValueError if ``microbatch_size`` is not a positive int.
        """
        check_positive_int("microbatch_size", microbatch_size)
        return [Batch(i, l) for i, l in zip(self.input_ids.split(microbatch_size),
                                            self.labels.split(microbatch_size))]

    def chunk(self, num_microbatches: int) -> list["Batch"]:
        """``num_microbatches`` equal microbatches, like ``Tensor.chunk`` but refusing uneven splits.

        Raises ValueError if the batch size is not divisible by ``num_microbatches``.
        """
        if not isinstance(num_microbatches, int) or num_microbatches <= 0 or len(self) % num_microbatches:
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {num_microbatches!r} equal "
                             f"microbatches; use a divisor of {len(self)}")
        return self.split(len(self) // num_microbatches)


def _seed_for(*parts) -> int:
    """A 63-bit generator seed from a tuple of ints/strings; nearby tuples give unrelated seeds."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@functools.lru_cache(maxsize=8)
def markov_chain(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The successor table (vocab_size, SUCCESSORS) of the chain for ``seed``: row t lists the
    tokens that may follow token t, most likely first. Raises ValueError for vocab_size < 2."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    generator = torch.Generator().manual_seed(_seed_for("chain", seed))
    # Successors are drawn Zipf-like (weight 1/(i+1) for the i-th token of a random order), so a few
    # tokens are common, as in text: a model first learns token frequencies, then the transitions.
    order = torch.randperm(vocab_size, generator=generator)
    weights = torch.zeros(vocab_size).index_put_((order,), 1.0 / torch.arange(1, vocab_size + 1))
    table = torch.multinomial(weights, vocab_size * SUCCESSORS, replacement=True, generator=generator)
    table = table.view(vocab_size, SUCCESSORS)
    return table


def synthetic_batch(vocab_size: int, batch_size: int, seq_len: int, *, seed: int = 0, step: int = 0,
                    rank: int = 0) -> Batch:
    """A batch of Markov-chain token sequences, the same for the same (seed, rank, step).

    Uses a local ``torch.Generator`` (the global RNG is neither used nor advanced). Labels are the
    inputs shifted by one: ``labels[:, t]`` is the token after ``input_ids[:, t]``. Returns CPU
    tensors. Raises ValueError for non-positive sizes.
    """
    for label, value in (("vocab_size", vocab_size), ("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(label, value)
    table = markov_chain(vocab_size, seed)
    generator = torch.Generator().manual_seed(_seed_for("batch", seed, rank, step))
    first = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    choices = torch.multinomial(torch.tensor(SUCCESSOR_PROBS), batch_size * seq_len, replacement=True,
                                generator=generator).view(batch_size, seq_len)
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = first
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choices[:, t]]
    return Batch(input_ids=tokens[:, :-1].clone(), labels=tokens[:, 1:].clone())


def global_batch(vocab_size: int, global_batch_size: int, seq_len: int, *, seed: int = 0,
                 step: int = 0) -> Batch:
    """The whole batch of one step across all ranks (split it with ``shard_batch``).

    Equal to ``synthetic_batch(vocab_size, global_batch_size, seq_len, seed=seed, step=step, rank=0)``.
    """
    return synthetic_batch(vocab_size, global_batch_size, seq_len, seed=seed, step=step, rank=0)


def shard_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous slice of ``batch`` along the batch dimension.

    Raises ValueError if the batch size is not divisible by ``world_size`` or rank is out of range.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if len(batch) % world_size:
        raise ValueError(f"batch size {len(batch)} is not divisible by world_size {world_size}; "
                         f"use a global batch size that is a multiple of {world_size}")
    rows = len(batch) // world_size
    return Batch(batch.input_ids[rank * rows:(rank + 1) * rows].clone(),
                 batch.labels[rank * rows:(rank + 1) * rows].clone())
