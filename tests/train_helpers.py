"""Digits data and a small model for the Trainer tests (module level for the workers)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


def digits(n_train: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    from replicator.demo.digits import load_digits_split

    train, test = load_digits_split()
    if n_train is not None:
        train = TensorDataset(*train[:n_train])
    return train, test


def model_fn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def make_trainer(strategy: rp.Strategy) -> rp.Trainer:
    return rp.Trainer(strategy, model_fn, lambda p: torch.optim.Adam(p, lr=3e-3),
                      nn.CrossEntropyLoss(), metrics=["accuracy"])


def loader(dataset, batch: int = 32, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=shuffle)
