"""Replay buffer, n-step transitions, rate limiter and trajectory queue, in one process."""

from __future__ import annotations

import threading

import pytest
import torch

from replicator.rl import (
    NStepAccumulator,
    RateLimiterTimeoutError,
    ReplayBuffer,
    SampleToInsertRatio,
    TrajectoryQueue,
)

pytestmark = pytest.mark.timeout(60)


def _items(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return {"obs": ids[:, None].repeat(1, 3), "action": ids[:, None], "reward": ids,
            "discount": torch.ones(n), "next_obs": ids[:, None].repeat(1, 3) + 1}


def test_n_step_sums_discounted_rewards_and_cuts_at_termination():
    acc = NStepAccumulator(n_step=3, discount=0.5)
    out = []
    rewards = [1.0, 2.0, 4.0, 8.0]
    for t, r in enumerate(rewards):
        term = torch.tensor([t == 3])
        got = acc.step(torch.tensor([[float(t)]]), torch.tensor([[0.0]]), torch.tensor([r]),
                       torch.tensor([[float(t + 1)]]), term, torch.tensor([False]))
        if got is not None:
            out.append(got)
    batch = {k: torch.cat([o[k] for o in out]) for k in out[0]}
    # t=0: 1 + .5*2 + .25*4 = 3, bootstrap from obs 3 with .125
    assert batch["reward"][0].item() == pytest.approx(3.0)
    assert batch["discount"][0].item() == pytest.approx(0.125)
    assert batch["next_obs"][0].item() == 3.0
    # the termination at t=3 flushes t=1..3 with discount 0
    assert batch["reward"].tolist() == pytest.approx([3.0, 2 + 2 + 2, 4 + 4, 8])
    assert batch["discount"][1:].tolist() == [0.0, 0.0, 0.0]


def test_truncation_still_bootstraps():
    acc = NStepAccumulator(n_step=5, discount=0.9)
    acc.step(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
             torch.tensor([False]), torch.tensor([False]))
    got = acc.step(torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1), torch.full((1, 1), 2.0),
                   torch.tensor([False]), torch.tensor([True]))
    assert got["discount"].tolist() == pytest.approx([0.81, 0.9])


def test_uniform_sampling_is_seeded_and_ring_overwrites():
    a, b = ReplayBuffer(10, seed=3), ReplayBuffer(10, seed=3)
    for buf in (a, b):
        buf.add(_items(15))
    assert len(a) == 10
    assert sorted(a.state_dict()["storage"]["reward"].tolist()) == list(range(5, 15))
    assert torch.equal(a.sample(8)["reward"], b.sample(8)["reward"])


def test_a_batch_that_wraps_the_ring_lands_in_order_and_a_bad_one_changes_nothing():
    buf = ReplayBuffer(10, seed=0)
    buf.add(_items(7))
    buf.add(_items(6, start=7))  # slots 7, 8, 9, then 0, 1, 2
    rewards = buf.state_dict()["storage"]["reward"].tolist()
    assert rewards == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    bad = _items(4, start=20)
    bad["next_obs"] = torch.zeros(4, 5)  # the replay holds 3 per item
    with pytest.raises(ValueError, match="next_obs"):
        buf.add(bad)
    assert buf.state_dict()["storage"]["reward"].tolist() == rewards
    assert len(buf) == 10


def test_prioritized_sampling_follows_priorities():
    buf = ReplayBuffer(100, prioritized=True, alpha=1.0, seed=0)
    buf.add(_items(4))
    buf.update_priorities(torch.arange(4), torch.tensor([0.0, 0.0, 0.0, 100.0]))
    out = buf.sample(64)
    assert (out["reward"] == 3).float().mean() > 0.9
    assert out["weights"].max().item() == pytest.approx(1.0)


def test_state_dict_resumes_exactly():
    buf = ReplayBuffer(20, prioritized=True, n_step=2, samples_per_insert=2.0,
                       min_size_to_sample=4, error_buffer=20, seed=1)
    buf.add(_items(12))
    buf.sample(6)
    state = buf.state_dict()
    again = ReplayBuffer(20, prioritized=True, n_step=2, samples_per_insert=2.0,
                         min_size_to_sample=4, error_buffer=20, seed=99)
    again.load_state_dict(state)
    for _ in range(3):
        x, y = buf.sample(4), again.sample(4)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert again.limiter.sampled == buf.limiter.sampled == 18


def test_rate_limiter_times_out_instead_of_waiting_forever():
    buf = ReplayBuffer(100, samples_per_insert=1.0, min_size_to_sample=4, error_buffer=4)
    buf.add(_items(4))
    buf.sample(4)
    with pytest.raises(RateLimiterTimeoutError, match="HINT"):
        buf.sample(4, timeout_seconds=0.3)


def test_rate_limiter_holds_samples_per_insert_under_threads():
    spi = 4.0
    buf = ReplayBuffer(1000, samples_per_insert=spi, min_size_to_sample=8, error_buffer=16)

    def insert():
        for k in range(100):
            buf.add(_items(2, 2 * k))

    t = threading.Thread(target=insert)
    t.start()
    while True:  # sample until the inserts are over and the limiter holds samples back
        try:
            buf.sample(8, timeout_seconds=0.5)
        except RateLimiterTimeoutError:
            if not t.is_alive():
                break
    t.join()
    assert buf.limiter.inserted == 200
    ratio = buf.limiter.sampled / buf.limiter.inserted
    assert abs(ratio - spi) / spi < 0.05


def test_rate_limiter_refuses_a_sample_wider_than_its_window():
    limiter = SampleToInsertRatio(1.0, min_size_to_sample=10, error_buffer=2)
    with pytest.raises(ValueError, match="error_buffer"):
        limiter.check_sample_size(8)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match="n_step"):
        ReplayBuffer(10, n_step=0)
    with pytest.raises(ValueError, match="samples_per_insert"):
        ReplayBuffer(10, samples_per_insert=-1)
    buf = ReplayBuffer(10)
    buf.add(_items(2))
    bad = _items(2)
    bad["obs"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="same spaces"):
        buf.add(bad)


def test_trajectory_queue_is_fifo_drops_oldest_and_resumes():
    q = TrajectoryQueue(length=3, capacity=4)
    traj = {"obs": torch.arange(6.0)[:, None, None].expand(6, 4, 2).clone(),
            "action": torch.arange(6)[:, None].expand(6, 3).clone()}
    q.add(traj)
    assert q.dropped == 2 and len(q) == 4
    state = q.state_dict()
    first = q.get(2)
    assert first["action"][:, 0].tolist() == [2, 3]
    other = TrajectoryQueue(length=3, capacity=4)
    other.load_state_dict(state)
    assert torch.equal(other.get(2)["obs"], first["obs"])
    with pytest.raises(RateLimiterTimeoutError):
        q.get(3, timeout_seconds=0.2)
    with pytest.raises(ValueError, match="length"):
        q.add({"obs": torch.zeros(1, 3, 2), "action": torch.zeros(1, 2)})


def test_vtrace_on_policy_gives_discounted_returns():
    from replicator.rl import vtrace

    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.1, -0.2, 4.0]])
    discounts = torch.tensor([[0.9, 0.9, 0.0]])  # the episode ends after the third step
    logp = torch.zeros(1, 3)
    vs, adv = vtrace(logp, logp, rewards, values, discounts)
    expected = [1 + 0.9 * (2 + 0.9 * 3), 2 + 0.9 * 3, 3.0]
    assert vs[0].tolist() == pytest.approx(expected)
    assert adv[0, 2].item() == pytest.approx(3.0 - (-0.2))
    # off-policy: the importance ratio is clipped at 1
    vs_off, _ = vtrace(logp - 5.0, logp, rewards, values, discounts)
    assert vs_off[0].tolist() == pytest.approx(expected)


def test_one_step_transitions_match_the_windowed_rule():
    fast, slow = NStepAccumulator(1, 0.9), NStepAccumulator(2, 0.9)
    obs, nxt = torch.randn(3, 2), torch.randn(3, 2)
    term, trunc = torch.tensor([True, False, False]), torch.tensor([False, True, False])
    got = fast.step(obs, torch.zeros(3, 1), torch.ones(3), nxt, term, trunc)
    assert got["discount"].tolist() == pytest.approx([0.0, 0.9, 0.9])
    assert torch.equal(got["next_obs"], nxt) and torch.equal(got["obs"], obs)
    # a window of 2 that ends at once (both done) gives the same discounts for done envs
    ended = slow.step(obs, torch.zeros(3, 1), torch.ones(3), nxt, term, trunc)
    assert ended["discount"].tolist() == pytest.approx([0.0, 0.9])
