"""Tiny models, data and a training loop shared by the model-parallel tests (module level, so
worker processes can import them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

STEPS = 10
GLOBAL_BATCH = 16
VOCAB, DIM, SEQ = 32, 16, 8
TIED_VOCAB, TIED_DIM, TIED_SEQ = 256, 64, 32  # the tied GPT-2's shapes


def make_mlp(seed: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int = 8) -> None:
        super().__init__()
        self.head_dim = head_dim
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a constant),
        # so Adam would amplify rounding noise into visible differences between layouts
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), \
            nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # -1: local heads under tensor parallel
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                             heads(self.v(x)), is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def make_transformer(seed: int = 1, blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), *[Block(DIM) for _ in range(blocks)], Head())


def make_gpt2(seed: int = 1) -> nn.Module:
    """A tiny Hugging Face GPT-2 language model, random init, nothing downloaded; untied
    output head (the tied one is :func:`make_tied_gpt2`), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def make_tied_gpt2(seed: int = 1) -> nn.Module:
    """A tiny Hugging Face GPT-2 language model with its default tied output head
    (``lm_head.weight`` is ``transformer.wte.weight``): a pipeline's first and last stage
    both use it. Random init, nothing downloaded, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=TIED_VOCAB, n_positions=TIED_SEQ, n_embd=TIED_DIM,
                        n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


MODELS = {"mlp": make_mlp, "transformer": make_transformer, "gpt2": make_gpt2,
          "gpt2_tied": make_tied_gpt2}


def mlp_data(n: int = 320) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def token_data(n: int = 320, vocab: int = VOCAB, seq: int = SEQ) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return TensorDataset(x, (x * 3 + 1) % vocab)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def full_state(strategy: rp.Strategy, model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) values of the parameters this rank holds; pipeline ranks leave out
    the stages they do not own (freed, empty)."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        if v.numel():
            out[k] = v.detach().clone()
    return out


def train(strategy: rp.Strategy, model_name: str, opt_name: str, steps: int = STEPS,
          batch: int = GLOBAL_BATCH, single_pass: bool = False,
          inspect: Callable[[nn.Module], Any] | None = None) -> dict:
    """``steps`` steps of the given model and optimizer; the full parameters held and the
    losses reported by ``strategy.reduce``. ``single_pass``: the pipeline's
    ``forward_backward`` instead of ``loss_fn(model(x), y).backward()``. ``inspect``: called
    with the trained model, its result returned as ``"inspected"``."""
    with strategy.scope():
        model = MODELS[model_name]()
        params = model.parameters()
        # AdamW's eps=1e-6: GPT-2's attention key bias has a zero gradient in exact
        # arithmetic; with eps=1e-8 Adam turns the rounding noise of another summation order
        # (microbatches) into updates of about 4e-4 in 10 steps
        optimizer = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if opt_name == "sgd"
                     else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6)
                     if opt_name == "adamw" else torch.optim.Adam(params, lr=0.01))

    def step(b):
        x, y = b
        if single_pass:
            loss = strategy.forward_backward(model, x, y, loss_of)
            optimizer.step()
            optimizer.zero_grad()
            return loss
        out = model(x)
        loss = loss_of(out.logits if hasattr(out, "logits") else out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = (mlp_data() if model_name == "mlp" else token_data(vocab=TIED_VOCAB, seq=TIED_SEQ)
            if model_name == "gpt2_tied" else token_data())
    it = iter(strategy.distribute_dataset(DataLoader(data, batch_size=batch, shuffle=True),
                                          seed=3))
    losses = []
    for _ in range(steps):
        losses.append(float(strategy.reduce("mean", strategy.run(step, args=(next(it),)))))
    out = {"state": full_state(strategy, model), "losses": losses,
           "sharded": sorted(n for n, p in model.named_parameters()
                             if hasattr(p, "to_local") and p.to_local().numel() < p.numel())}
    if inspect is not None:
        out["inspected"] = inspect(model)
    if hasattr(strategy, "memory_report"):
        out["memory"] = strategy.memory_report().as_dict()
    return out


def train_all(strategy: rp.Strategy, configs: tuple = (("mlp", "sgd"), ("mlp", "adam"),
                                                       ("transformer", "sgd"),
                                                       ("transformer", "adam"))) -> dict:
    """Each (model, optimizer) config, keyed ``"model_opt"``."""
    return {f"{m}_{o}": train(strategy, m, o) for m, o in configs}


def one_device(configs: tuple) -> dict:
    return train_all(rp.OneDeviceStrategy("cpu"), configs)


def merge_ranks(results: list[dict], ranks: list[int]) -> dict:
    """Join the parameters held by ``ranks`` (the stages of one replica) per config."""
    merged: dict = {}
    for key in results[ranks[0]]:
        state: dict = {}
        for r in ranks:
            state.update(results[r][key]["state"])
        merged[key] = {"state": state, "losses": results[ranks[0]][key]["losses"]}
    return merged
