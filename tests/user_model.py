"""A user's own small model, for `meshlib plan --model package.module:build` (tests copy this file
into a package of their own: tests/test_cli.py, and tests/test_readme.py for the README's line)."""
import torch
from torch import nn

from meshlib import P


class Net(nn.Module):
    def __init__(self, vocab=64, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        x = x + self.down(torch.relu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build():
    return Net()


def rules(mesh):
    tp = "tp" if "tp" in mesh else None
    return {"up.weight": P(tp, None), "up.bias": P(tp), "down.weight": P(None, tp), "emb.weight": P(),
            "down.bias": P(), "head.weight": P()}


def example_inputs(batch, seq):
    return {"ids": torch.zeros(batch, seq, dtype=torch.long), "targets": torch.zeros(batch, seq, dtype=torch.long)}
