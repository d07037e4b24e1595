"""Training text shipped inside the package (written for zerofast; nothing is downloaded), as bytes,
and the batches each rank draws from it."""

from __future__ import annotations

import torch

CORPUS = """\
ZeRO removes the redundancy of data parallel training. Every rank computes on its own batch, but no
rank needs to keep the whole training state. Stage one shards the optimizer state: the fp32 master
copy, the first moment and the second moment. Stage two also shards the gradients: each gradient is
reduced to the rank that owns it, and the other ranks drop it. Stage three also shards the
parameters: a layer is gathered just before it runs and released right after, in forward and again
in backward. The communication stays close to that of plain data parallel training: a reduce and a
broadcast, two times the model size per step, or three times when the parameters are gathered twice.
With mixed precision and Adam, a model of phi parameters needs sixteen phi bytes per rank without
ZeRO: two for the parameters, two for the gradients and twelve for the optimizer state. Stage one
brings that to four phi plus twelve phi over N, stage two to two phi plus fourteen phi over N, and
stage three to sixteen phi over N, where N is the number of ranks.
The owner of a parameter can be chosen round robin, one whole tensor per rank in turn, or greedily,
largest first to the least loaded rank, or the flat way: every bucket is one contiguous buffer cut
into N equal slices, so that every rank owns the same number of elements, and the reduce becomes a
reduce scatter and the broadcast an all gather.
"""


def corpus_tokens() -> torch.Tensor:
    """The corpus as byte tokens (vocabulary 256)."""
    return torch.tensor(list(CORPUS.encode("utf-8")), dtype=torch.long)


def text_batch(tokens: torch.Tensor, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of `seq` tokens and their next-token targets, reproducible from seed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    windows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
