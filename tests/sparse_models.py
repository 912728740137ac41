"""Workloads whose embedding tables get sparse gradients (`sparse=True`), for tests/test_sparse.py, loaded like a
user's `--model package.module:function`:

- `bag_recommender`: a recommendation model's shape: an `nn.EmbeddingBag(mode="sum", sparse=True)` pools each
  sample's bag of item ids, a dense MLP on top scores it (the DLRM pattern: sparse tables, dense tower);
- `sparse_embedding`: an `nn.Embedding(sparse=True)` over token ids, mean-pooled, and a linear head.

Each table is larger than the ids a batch reads, so a step's gradient touches some of its rows only (a sparse
gradient with repeated indices where a batch reads a row twice). Not a test module (no `test_` prefix).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dpcompare.run.workloads import Workload

ITEMS = 200
"""Rows of each embedding table."""
BAG = 6
"""Ids per sample."""
CLASSES = 5


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def _ids_and_labels(seed: int, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids drawn from the first half of the table's rows (the other half never gets a gradient) and a label that
    a hidden score of the ids decides, so the model learns."""
    g = _generator(seed, step)
    ids = torch.randint(0, ITEMS // 2, (global_batch, BAG), generator=g)
    score = torch.randn(ITEMS, CLASSES, generator=_generator(seed, -1))
    return ids, score[ids].sum(dim=1).argmax(dim=1)


class BagRecommender(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(ITEMS, dim, mode="sum", sparse=True)
        self.tower = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tower(self.bag(ids))


class SparseEmbedding(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(ITEMS, dim, sparse=True)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


def bag_recommender(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("bag-recommender", BagRecommender(), lambda step, n: _ids_and_labels(seed, step, n),
                    F.cross_entropy)


def sparse_embedding(seed: int) -> Workload:
    torch.manual_seed(seed)
    return Workload("sparse-embedding", SparseEmbedding(), lambda step, n: _ids_and_labels(seed, step, n),
                    F.cross_entropy)
