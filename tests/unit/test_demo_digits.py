"""The demo's digits, read from the file scikit-learn ships, equal scikit-learn's own loader."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from sklearn.datasets import load_digits

from replicator.demo.digits import load_digits_split


@pytest.mark.parametrize("seed", [0, 7])
def test_the_split_is_scikit_learns_digits_in_a_seeded_order(seed):
    train, test = load_digits_split(seed=seed)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(seed))
    n_test = int(1797 * 0.2)
    for part, rows in ((test, order[:n_test]), (train, order[n_test:])):
        assert torch.equal(part.tensors[0], images[rows])
        assert torch.equal(part.tensors[1], labels[rows])


@pytest.mark.timeout(60)
def test_loading_the_digits_does_not_import_scikit_learn():
    code = ("import sys; from replicator.demo.digits import load_digits_split; "
            "load_digits_split(); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.strip() == "False", out.stderr
