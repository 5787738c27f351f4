"""Block quantisation of outer updates: int8 and int4 with a scale per block, error feedback."""

from __future__ import annotations

import pytest
import torch

from replicator.comm.block_quantize import (
    BlockQuantizer,
    dequantize,
    payload_bytes,
    quantize,
)


@pytest.mark.parametrize("bits,level", [(8, 127), (4, 7)])
def test_round_trip_error_is_at_most_half_a_step_of_each_block(bits, level):
    x = torch.randn(1000) * torch.linspace(0.01, 10, 1000)  # blocks of very different scale
    payload = quantize(x, bits, 64)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(1000, bits, 64)
    y = dequantize(payload, 1000, bits, 64)
    for block in range(0, 1000, 64):
        part = slice(block, block + 64)
        step = x[part].abs().max() / level
        assert (x[part] - y[part]).abs().max() <= step / 2 + 1e-6


def test_payload_sizes_are_a_quarter_and_an_eighth_plus_scales():
    assert payload_bytes(4096, 8, 256) == 4096 + 16 * 4
    assert payload_bytes(4096, 4, 256) == 2048 + 16 * 4
    assert payload_bytes(1, 4, 256) == 128 + 4  # a short tail is padded to a block


def test_zeros_and_exact_levels_survive():
    x = torch.zeros(10)
    assert torch.equal(dequantize(quantize(x, 4, 8), 10, 4, 8), x)
    x = torch.tensor([-7.0, -3.0, 0.0, 1.0, 7.0, 2.0])
    assert torch.equal(dequantize(quantize(x, 4, 6), 6, 4, 6), x)


def test_error_feedback_keeps_the_accumulated_error_bounded():
    x = torch.randn(512) * 3
    plain, fed = BlockQuantizer(4), BlockQuantizer(4, error_feedback=True)
    sum_plain = sum(plain.decode(plain.encode(x), 512) for _ in range(40))
    sum_fed = sum(fed.decode(fed.encode(x, "k"), 512) for _ in range(40))
    exact = 40 * x
    assert (sum_fed - exact).abs().max() < (sum_plain - exact).abs().max() / 5
    state = fed.state_dict()
    other = BlockQuantizer(4, error_feedback=True)
    other.load_state_dict(state)
    assert torch.equal(other.encode(x, "k"), fed.encode(x, "k"))


def test_bad_settings_and_mismatched_payloads_are_refused():
    with pytest.raises(ValueError, match="bits=8 or bits=4"):
        quantize(torch.ones(3), 2)
    with pytest.raises(ValueError, match="block_size"):
        BlockQuantizer(8, block_size=3)
    with pytest.raises(ValueError, match="HINT"):
        dequantize(quantize(torch.ones(10), 8), 300, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_gpu_payload_equals_cpu_payload():
    x = torch.randn(1000)
    for bits in (8, 4):
        assert torch.equal(quantize(x.cuda(), bits).cpu(), quantize(x, bits))


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_sum_adds_the_payloads_in_the_order_given_and_a_zero_payload_adds_nothing(bits):
    q = BlockQuantizer(bits, 64)
    parts = [q.encode(torch.randn(300, generator=torch.Generator().manual_seed(s)))
             for s in range(3)]
    expected = torch.zeros(300)
    for part in parts:
        expected.add_(q.decode(part, 300))
    assert torch.equal(q.decode_sum(parts, 300), expected)
    silent = torch.zeros_like(parts[0])  # a member that sits out a round sends zeros
    assert torch.equal(q.decode_sum([*parts, silent], 300), expected)
    with pytest.raises(ValueError, match="at least one payload.*HINT"):
        q.decode_sum([], 300)
