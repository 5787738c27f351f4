"""TF-Replicator's GAN workload: a generator and a discriminator, two optimizers in one step_fn.

    python examples/gan.py                               # one replica
    replicator run --nproc 2 examples/gan.py             # two CPU workers, the same numbers
    replicator run --nproc 2 examples/gan.py --strategy central_storage

A small GAN learns scikit-learn's 8x8 handwritten digits (1,797 images shipped with the
package). Each step updates the discriminator on real and generated images, then the generator
through the updated discriminator (the non-saturating loss), as the paper's GAN step does. The
noise is part of the input (drawn with the images, then split across replicas like them), so a
run on N replicas takes the same steps as one device with the same global batch, to float
rounding. A GAN's training amplifies rounding (a ReLU whose input sits at zero switches one
way or the other): 1 and 2 replicas agree to 1e-7 for the first 56 steps, then drift apart
(6e-3 at step 100), so the final scores differ in their second digit; the same runs in float64
agree to 1e-13 after 400 steps.

At the end it prints a digit score of the generated images: a logistic-regression classifier
fitted on real digits labels 1,000 of them, and the score is the Inception Score formula over
its labels (exp of the mean KL divergence between each image's label distribution and the
marginal): 1 for noise or a single digit, 10 for sharp images of all ten digits equally often.
The same score of held-out real digits is printed beside it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

NOISE = 16
GLOBAL_BATCH = 64


def load_images() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and held-out digits (scaled to [-1, 1], flattened) and their labels."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:300], order[300:]
    return x[train], y[train], x[test], y[test]


def build() -> tuple[nn.Module, nn.Module]:
    generator = nn.Sequential(nn.Linear(NOISE, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 64), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128),
                                  nn.LeakyReLU(0.2), nn.Linear(128, 1))
    return generator, discriminator


def digit_score(classifier: LogisticRegression, images: torch.Tensor) -> float:
    """The Inception Score formula over ``classifier``'s labels of ``images``."""
    p = torch.tensor(classifier.predict_proba(images.numpy()), dtype=torch.float64)
    marginal = p.mean(0, keepdim=True)
    kl = (p * (p.clamp_min(1e-12).log() - marginal.clamp_min(1e-12).log())).sum(1)
    return float(kl.mean().exp())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="mirrored",
                        help="any synchronous strategy's name (mirrored, central_storage, ...)")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps")
    parser.add_argument("--save", default=None,
                        help="write both networks' weights there at the end (torch.save)")
    args = parser.parse_args()

    strategy = rp.get_strategy(args.strategy)          # the one line that changes
    x_train, y_train, x_test, y_test = load_images()
    noise = torch.randn(len(x_train), NOISE, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x_train, noise), batch_size=GLOBAL_BATCH, shuffle=True,
                        drop_last=True)

    with strategy.scope():
        torch.manual_seed(0)
        generator, discriminator = build()
        g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        d_opt = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        real, z = batch
        fake = generator(z)
        real_logits, fake_logits = discriminator(real), discriminator(fake.detach())
        d_per_example = (
            F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits),
                                               reduction="none")
            + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits),
                                                 reduction="none"))
        d_loss = rp.compute_average_loss(d_per_example)
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        logits = discriminator(fake)
        g_per_example = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits),
                                                           reduction="none")
        g_loss = rp.compute_average_loss(g_per_example)
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
        return d_loss.detach(), g_loss.detach()

    dataset = strategy.distribute_dataset(loader, seed=2)
    step = 0
    for epoch in range(args.epochs):
        for batch in dataset:
            d_loss, g_loss = strategy.run(step_fn, args=(batch,))
            step += 1
            if args.steps is not None and step >= args.steps:
                break
        if (epoch + 1) % 10 == 0:  # the global means: each replica's share, summed
            d_mean, g_mean = (float(strategy.reduce("sum", v)) for v in (d_loss, g_loss))
            if strategy.is_chief:
                print(f"epoch {epoch + 1}: discriminator loss {d_mean:.3f}, generator loss "
                      f"{g_mean:.3f}", flush=True)
        if args.steps is not None and step >= args.steps:
            break

    with torch.no_grad():
        z = torch.randn(1000, NOISE, generator=torch.Generator().manual_seed(3))
        samples = generator(z.to(strategy.device))
    if strategy.is_chief and args.save:
        torch.save({"generator": generator.state_dict(),
                    "discriminator": discriminator.state_dict()}, args.save)
    if strategy.is_chief:
        classifier = LogisticRegression(max_iter=2000).fit(x_train.numpy(), y_train.numpy())
        accuracy = classifier.score(x_test.numpy(), y_test.numpy())
        print(f"digit score of generated images {digit_score(classifier, samples.cpu()):.2f} "
              f"(held-out real digits {digit_score(classifier, x_test):.2f}, classifier "
              f"accuracy on them {accuracy:.3f}; replicas {strategy.num_replicas_in_sync}, "
              f"steps {step})", flush=True)


if __name__ == "__main__":
    main()
