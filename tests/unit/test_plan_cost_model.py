"""The planner's formulas against hand-computed cases, and its memory arithmetic."""

import dataclasses
import math

import pytest

from replicator.plan.cost_model import Cluster, predict
from replicator.plan.devices import get_device, parse_link
from replicator.plan.formulas import (
    allreduce_traffic_bytes,
    fsdp_traffic_bytes,
    ps_step_seconds,
    ring_allreduce_seconds,
)
from replicator.plan.planner import make_plan
from replicator.plan.profiles import AlphaBeta, MachineProfile, ModelProfile


def test_ring_allreduce_hand_computed():
    # 2(n-1)/n * S/B + 2(n-1) alpha = 1.5 ms + 60 us
    assert ring_allreduce_seconds(1e6, 4, 1e9, 1e-5) == pytest.approx(1.56e-3)
    assert ring_allreduce_seconds(8e6, 2, 1e9, 0.0) == pytest.approx(8e-3)
    assert ring_allreduce_seconds(1e9, 1, 1e9, 1.0) == 0.0



def test_fsdp_pays_per_block_it_shards_not_per_weight_tensor():
    """A transformer layer holds four weight matrices but is one FSDP block: the blocks the
    probe saw sharded (``fsdp_units``) set FSDP's fixed cost; a profile without them (0)
    falls back to one block per weight tensor."""
    machine = MachineProfile.nominal()
    machine.fsdp_unit = {2: 2e-3}
    machine.fsdp_wide_sgd = {2: 4e-3}
    machine.fsdp_wide_bytes = 1_000_288.0
    cpu = Cluster(get_device("cpu"), parse_link("10gbit", 25e-6), machine, 2)
    m = ModelProfile(name="attn", params=10**5, global_batch=8, param_bytes=4e5,
                     grad_bytes=4e5, weight_tensors=10, measured=False, flops_per_sample=1e3)
    per_tensor = predict("fsdp", 2, m, cpu).breakdown["communication"]
    per_block = predict("fsdp", 2, dataclasses.replace(m, fsdp_units=4), cpu
                        ).breakdown["communication"]
    assert per_tensor - per_block == pytest.approx((10 - 4) * 2e-3, rel=1e-6)



@pytest.mark.parametrize("n", [2, 8, 64])
def test_fsdp_moves_one_and_a_half_times_the_bytes_of_allreduce(n):
    assert allreduce_traffic_bytes(1e9, n) == pytest.approx(2 * (n - 1) / n * 1e9)
    assert fsdp_traffic_bytes(1e9, n) == pytest.approx(1.5 * allreduce_traffic_bytes(1e9, n))
    # gloo's reduce-scatter sends an all-reduce's bytes: 4(n-1)/n, twice an all-reduce
    assert fsdp_traffic_bytes(1e9, n, gloo=True) == pytest.approx(
        2 * allreduce_traffic_bytes(1e9, n))


def test_fsdp_across_cpu_hosts_pays_the_slower_of_its_bytes_and_its_blocks_own_cost():
    """CPU hosts over a link: the bytes at gloo's 4(n-1)/n, or, where the link is fast, the
    blocks' own cost measured on one host (with a host's processes, at least 2), whichever is
    slower; so 2 hosts of 2 are never predicted faster than FSDP's blocks cost on one."""
    machine = MachineProfile.nominal()
    machine.fsdp_unit = {2: 2e-3, 3: 3e-3, 4: 4e-3}
    machine.fsdp_wide_sgd = {2: 4e-3, 3: 6e-3, 4: 8e-3}
    machine.fsdp_wide_bytes = 1_000_288.0
    m = ModelProfile(name="m", params=10**6, global_batch=8, param_bytes=4e6, grad_bytes=4e6,
                     optimizer_state_bytes=0.0, activation_bytes_per_sample=100,
                     largest_tensor_bytes=2e6, weight_tensors=3, measured=False,
                     flops_per_sample=1e3)
    alpha = 25e-6
    slow = Cluster(get_device("cpu"), parse_link("200mbit", alpha), machine, 2)
    got = predict("fsdp", 4, m, slow).breakdown["communication"]
    wire = 4 * 3 / 4 * 4e6 / 25e6  # 0.48 s: slower than 3 blocks x 2 ms
    assert got == pytest.approx(wire + 3 * 3 * 3 * alpha, rel=1e-6)
    fast = Cluster(get_device("cpu"), parse_link("400gbit", alpha), machine, 2)
    got = predict("fsdp", 4, m, fast).breakdown["communication"]
    assert got == pytest.approx(3 * 2e-3 + 3 * 3 * 3 * alpha, rel=1e-6)  # blocks at 2 a host
    three_apart = Cluster(get_device("cpu"), parse_link("400gbit", alpha), machine, 1)
    got = predict("fsdp", 3, m, three_apart).breakdown["communication"]
    assert got == pytest.approx(3 * 2e-3 + 3 * 3 * 2 * alpha, rel=1e-6)  # one a host: at 2


def test_parameter_server_push_pull_and_server_bound():
    # worker: 0.1 + 2 * 1e-4 + (1e6 + 1e6) / 1e9; servers: 4 * 2e6 / (1 * 1e9) is less
    assert ps_step_seconds(0.1, 1e6, 1e6, 4, 1, 1e9, 1e-4) == pytest.approx(0.1022)
    # 100 workers on one server: the server's link bounds the step, 100 * 2e6 / 1e9
    assert ps_step_seconds(0.1, 1e6, 1e6, 100, 1, 1e9, 1e-4) == pytest.approx(0.2)
    assert ps_step_seconds(0.1, 1e6, 1e6, 100, 4, 1e9, 1e-4) == pytest.approx(0.1022)


@pytest.mark.parametrize("call", [
    lambda: ring_allreduce_seconds(1e6, 0, 1e9, 0.0),
    lambda: ring_allreduce_seconds(1e6, 2, -1e9, 0.0),
    lambda: ps_step_seconds(0.1, 1, 1, 0, 1, 1e9, 0.0),
    lambda: ps_step_seconds(0.1, 1, 1, 2, 1, 0.0, 0.0),
])
def test_nonsense_is_a_clear_error(call):
    with pytest.raises(ValueError, match="positive"):
        call()


def _cluster(device="cpu", link="25gbit", per_host=None):
    return Cluster(get_device(device), parse_link(link), MachineProfile.nominal(), per_host)


def test_memory_per_rank_is_the_sum_of_its_parts():
    m = ModelProfile(name="m", params=1000, global_batch=10, param_bytes=4000, grad_bytes=4000,
                     optimizer_state_bytes=8000, activation_bytes_per_sample=100,
                     largest_tensor_bytes=400, weight_tensors=2, measured=False,
                     flops_per_sample=1e6)
    c = _cluster()
    base = c.machine.process_rss_bytes
    assert predict("mirrored", 2, m, c).memory_per_rank == pytest.approx(16000 + 500 + base)
    # FSDP: the state divided by 2, plus two gathered largest tensors
    assert predict("fsdp", 2, m, c).memory_per_rank == pytest.approx(
        8000 + 800 + 500 + base)
    # a parameter-server worker keeps no optimizer state
    assert predict("parameter_server", 2, m, c).memory_per_rank == pytest.approx(
        8000 + 500 + base)


def test_a_trillion_parameters_on_8_cpus_does_not_fit():
    model = ModelProfile.from_parameter_count(1e12)
    plan = make_plan(model, _cluster(), [8])
    assert plan.recommended is None
    assert not any(p.fits for p in plan.predictions)
    assert plan.reason.startswith("does not fit")
    # the arithmetic: 1e12 x (4 weights + 4 gradients + 8 Adam) bytes, against the RAM per rank
    assert "4000.0 GB weights + 4000.0 GB gradients + 8000.0 GB optimizer state" in plan.reason
    mirrored = next(p for p in plan.predictions if p.setting == "mirrored x8")
    assert mirrored.memory_per_rank > 16e12
    assert "of 8.0 GB" in mirrored.memory_detail  # 16 GB of RAM shared by 2 ranks per host


def test_global_batch_smaller_than_workers_cannot_run():
    model = ModelProfile.from_parameter_count(1e6, global_batch=4)
    p = predict("mirrored", 8, model, _cluster())
    assert not p.feasible and "global batch of 4" in p.why_not


def test_gpu_compute_comes_from_flops_and_the_datasheet():
    model = ModelProfile.from_parameter_count(1e9, global_batch=64)
    h100 = get_device("h100")
    p = predict("one_device", 1, model, _cluster("h100"))
    assert p.breakdown["compute"] == pytest.approx(6e9 * 64 / (h100.peak_flops * h100.mfu))


def test_more_bandwidth_never_makes_data_parallel_slower():
    model = ModelProfile.from_parameter_count(1e8, global_batch=512)
    slow = predict("mirrored", 64, model, _cluster("a100", "10gbit"))
    fast = predict("mirrored", 64, model, _cluster("a100", "400gbit"))
    assert fast.step_seconds < slow.step_seconds
    assert math.isfinite(fast.samples_per_second)


def test_alpha_beta_fit_recovers_a_line():
    sizes = [4e3, 6.4e4, 1e6, 1.6e7]
    fit = AlphaBeta.fit(sizes, [2e-4 + s / 1e9 for s in sizes])
    assert fit.a == pytest.approx(2e-4, rel=1e-6)
    assert fit.b == pytest.approx(1e-9, rel=1e-6)


def test_alpha_beta_fit_leaves_out_a_time_of_zero():
    # a round trip measured as a difference of two timings came out 0 at 1 kB beside four
    # busy processes: weighted by its relative error it made the whole fit 0 s at every size
    sizes = [1e3, 1e6, 4e6, 8e6]
    fit = AlphaBeta.fit(sizes, [0.0, 1e-3 + 1e6 / 1e9, 1e-3 + 4e6 / 1e9, 1e-3 + 8e6 / 1e9])
    assert fit.a == pytest.approx(1e-3, rel=1e-6) and fit.b == pytest.approx(1e-9, rel=1e-6)
    assert AlphaBeta.fit([1e3, 1e6], [0.0, 2e-3]) == AlphaBeta(2e-3, 0.0)
    assert AlphaBeta.fit([1e3, 1e6], [0.0, -1e-4]) == AlphaBeta(0.0, 0.0)


def test_alpha_beta_fit_refits_the_other_term_when_one_would_be_negative():
    """A free fit with a negative fixed cost becomes the best line through the origin (its
    relative error no worse than the free slope with the fixed cost cut off); a slope that
    would be negative is none: the larger size's time."""
    sizes, seconds = [1e3, 1e6, 4e6, 8e6], [0.2e-6, 0.5e-3, 3.0e-3, 8.0e-3]

    def relative_error(a, b):
        return sum(((a + b * x) - y) ** 2 / y ** 2 for x, y in zip(sizes, seconds))

    w = [1 / y ** 2 for y in seconds]
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sum(w)
    my = sum(wi * y for wi, y in zip(w, seconds)) / sum(w)
    free_b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / \
        sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    assert my - free_b * mx < 0  # the case: the free fit's fixed cost is negative
    fit = AlphaBeta.fit(sizes, seconds)
    assert fit.a == 0.0 and fit.b > 0
    assert relative_error(fit.a, fit.b) < relative_error(0.0, free_b)
    flat = AlphaBeta.fit([1e3, 1e6], [2e-3, 1e-3])
    assert flat == AlphaBeta(1e-3, 0.0)


def test_alpha_beta_fit_keeps_the_cost_per_byte_when_a_neighbour_slowed_a_middle_size():
    """A round trip timed at 1, 4 and 8 MB while a busy neighbour slowed the 1 MB one past the
    4 MB one: the least-relative-error line through those points slopes down, and a fit that
    took them as they came found no cost per byte at all; moving more bytes never costs less,
    so the slowed point counts at the 4 MB time, and the slope of the other two survives."""
    sizes = [1e6, 4e6, 8e6]
    fit = AlphaBeta.fit(sizes, [3.965e-3, 1.747e-3, 12.64e-3])
    assert fit.b > 1e-10
    assert fit.seconds(8e6) > 2 * fit.seconds(1e6)


def test_machine_profile_round_trips_through_json():
    m = MachineProfile.nominal()
    again = MachineProfile.from_json(m.to_json())
    assert again.allreduce_seconds("shared_memory", 1e6, 2) == \
        pytest.approx(m.allreduce_seconds("shared_memory", 1e6, 2))
    assert again.slowdown == m.slowdown


def test_pipeline_stages_divide_the_workers():
    from replicator.plan.cost_model import pipeline_stages

    assert pipeline_stages(64, 33) == 32  # 32 stages x 2 data-parallel replicas
    assert pipeline_stages(4, 3) == 2 and pipeline_stages(3, 3) == 3
    assert pipeline_stages(7, 4) == 1  # no divisor fits: a single stage
    model = ModelProfile(name="m", params=1000, global_batch=64, param_bytes=3200,
                         grad_bytes=3200, optimizer_state_bytes=6400,
                         activation_bytes_per_sample=100, weight_tensors=2, measured=False,
                         flops_per_sample=1e6)
    c = _cluster()
    p = predict("pipeline", 2, model, c)
    # each of the 2 stages holds half the state and half the activations of the batch
    assert p.memory_per_rank == pytest.approx(6400 + 3200 + c.machine.process_rss_bytes)


def test_fsdp_cost_is_per_block_plus_per_byte_fitted_through_narrow_and_wide_blocks():
    machine = MachineProfile.nominal()
    machine.fsdp_unit = {2: 2e-3}
    machine.fsdp_wide_sgd = {2: 4e-3}
    machine.fsdp_wide_adam = {2: 8e-3}
    machine.fsdp_wide_bytes = 1_000_288.0  # 1 MB more than the narrow block's 288 bytes
    # SGD: (4 - 2) ms over 1 MB; Adam (2 bytes of state per weight byte): (8 - 2) ms
    assert machine.fsdp_block_seconds(2, 0.0) == pytest.approx((2e-3, 2e-9))
    assert machine.fsdp_block_seconds(2, 2.0) == pytest.approx((2e-3, 6e-9))
    assert machine.fsdp_block_seconds(2, 1.0) == pytest.approx((2e-3, 4e-9))  # momentum
    again = MachineProfile.from_json(machine.to_json())
    assert again.fsdp_block_seconds(2, 2.0) == pytest.approx((2e-3, 6e-9))
    # a model of 3 blocks, 4 MB of weights, Adam: 3 x 2 ms + 4e6 x 6e-9 s of FSDP's own cost
    m = ModelProfile(name="m", params=10**6, global_batch=8, param_bytes=4e6, grad_bytes=4e6,
                     optimizer_state_bytes=8e6, activation_bytes_per_sample=100,
                     largest_tensor_bytes=2e6, weight_tensors=3, measured=False,
                     flops_per_sample=1e3)
    c = Cluster(get_device("cpu"), parse_link("25gbit"), machine, None)
    assert predict("fsdp", 2, m, c).breakdown["communication"] == pytest.approx(
        3 * 2e-3 + 4e6 * 6e-9, rel=1e-6)
    # without the wide measurements (an older profile): the previous formula, unchanged
    assert MachineProfile.nominal().fsdp_block_seconds(2, 2.0) is None


def test_fsdp_per_block_cost_moves_towards_the_narrow_adam_measurement():
    """A sharded Adam step is a fixed cost per block (DTensor updates) that the narrow chain
    measured with SGD does not see: with the narrow Adam figure, the per-block part moves
    towards it with the optimizer's state, and the per-byte part is what is left."""
    machine = MachineProfile.nominal()
    machine.fsdp_unit, machine.fsdp_unit_adam = {2: 2e-3}, {2: 3e-3}
    machine.fsdp_wide_sgd, machine.fsdp_wide_adam = {2: 4e-3}, {2: 9e-3}
    machine.fsdp_wide_bytes = 1_000_288.0
    assert machine.fsdp_block_seconds(2, 0.0) == pytest.approx((2e-3, 2e-9))  # SGD: as before
    assert machine.fsdp_block_seconds(2, 2.0) == pytest.approx((3e-3, 6e-9))  # (9 - 3) ms / MB
    assert machine.fsdp_block_seconds(2, 1.0) == pytest.approx((2.5e-3, 4e-9))
    assert MachineProfile.from_json(machine.to_json()).fsdp_block_seconds(2, 2.0) == \
        pytest.approx((3e-3, 6e-9))


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_central_storage_waits_at_more_collectives_than_mirrored(device):
    """Gradients reduced onto one rank (an all-reduce's bytes) and parameters broadcast back:
    on a CPU host a check and a broadcast through shared memory (two small collectives while
    the ranks fit the cores, one beyond: the wait for an unscheduled rank covers the other)
    and two copies of every parameter byte; elsewhere one tiny all-reduce's wait."""
    machine = MachineProfile.nominal()
    machine.small_collective = {2: 3e-4, 4: 9e-4}
    machine.slowdown = {1: 1.0, 2: 1.1, 4: 2.0}
    c = Cluster(get_device(device), parse_link("25gbit"), machine, 4)  # one host
    m = ModelProfile(name="m", params=10**5, global_batch=64, param_bytes=4e5, grad_bytes=4e5,
                     optimizer_state_bytes=0, activation_bytes_per_sample=100,
                     largest_tensor_bytes=2e5, weight_tensors=2, measured=False,
                     flops_per_sample=1e6)
    for n in (2, 4):
        mirrored = predict("mirrored", n, m, c).breakdown["communication"]
        central = predict("central_storage", n, m, c).breakdown["communication"]
        if device == "cpu":
            waits = 2 if n <= machine.cores else 1
            extra = waits * machine.small_collective[n] + \
                2 * 4e5 / machine.memory_bandwidth * machine.slowdown[n]
        else:
            extra = ring_allreduce_seconds(8, n, c.device.intra_bandwidth, c.device.intra_alpha)
        assert central - mirrored == pytest.approx(extra, rel=1e-6)


def test_a_short_synchronous_step_waits_as_the_reference_loop_did():
    """A short synchronous step waits what the measured reference loop waited beyond its
    work (with more busy processes than cores, for a rank the scheduler has not run), when
    that is more than the compute-proportional straggler wait (one per step, not one per
    collective), at every process count; none for FSDP (its measured per-block cost holds
    it), nor for one rank."""
    machine = MachineProfile.nominal()
    assert machine.cores == 2
    machine.straggle = {1: 1.0, 2: 1.1, 3: 1.3, 4: 1.2}
    machine.sync_wait = {2: 2e-4, 3: 2e-3, 4: 1e-3}
    assert machine.sync_wait_for(1) == 0.0
    assert machine.sync_wait_for(3) == 2e-3
    assert machine.sync_wait_for(8) == 1e-3  # beyond the measured counts: the nearest
    assert MachineProfile.from_json(machine.to_json()).sync_wait == machine.sync_wait
    without = MachineProfile.nominal()
    without.straggle = machine.straggle

    def comm(m: ModelProfile, prof: MachineProfile, strategy: str = "mirrored") -> float:
        c = Cluster(get_device("cpu"), parse_link("25gbit"), prof, 4)  # 3 processes on a host
        return predict(strategy, 3, m, c).breakdown["communication"]

    short = ModelProfile(name="s", params=1000, global_batch=96, param_bytes=4e3, grad_bytes=4e3,
                         optimizer_state_bytes=8e3, activation_bytes_per_sample=10,
                         largest_tensor_bytes=4e3, weight_tensors=2, measured=False,
                         flops_per_sample=1e3)
    assert comm(short, machine) - comm(short, without) == pytest.approx(
        2e-3 - 0.3 * _compute_seconds(short, machine), rel=1e-6)
    # a long step: its straggler wait (30% of its compute) is already more than 2 ms
    long = ModelProfile(name="l", params=1000, global_batch=96, param_bytes=4e3, grad_bytes=4e3,
                        optimizer_state_bytes=8e3, activation_bytes_per_sample=10,
                        largest_tensor_bytes=4e3, weight_tensors=2, measured=False,
                        flops_per_sample=1e10)
    assert comm(long, machine) == pytest.approx(comm(long, without))
    assert comm(short, machine, "fsdp") == pytest.approx(comm(short, without, "fsdp"))
    two = Cluster(get_device("cpu"), parse_link("25gbit"), machine, 4)
    two_without = Cluster(get_device("cpu"), parse_link("25gbit"), without, 4)
    at_two = predict("mirrored", 2, short, two).breakdown
    # 2 processes on 2 cores: the loop's 0.2 ms, beyond the straggler share of the compute
    assert at_two["communication"] - predict("mirrored", 2, short, two_without).breakdown[
        "communication"] == pytest.approx(2e-4 - 0.1 * at_two["compute"], rel=1e-6)
    assert predict("one_device", 1, short, two).step_seconds == pytest.approx(
        predict("one_device", 1, short, two_without).step_seconds)


def _compute_seconds(m: ModelProfile, machine: MachineProfile) -> float:
    c = Cluster(get_device("cpu"), parse_link("25gbit"), machine, 4)
    return predict("mirrored", 3, m, c).breakdown["compute"]


def test_an_fp32_model_on_a_gpu_runs_at_the_fp32_or_tf32_rate_not_the_half_precision_one():
    # measured on an H100: a float32 MLP's step ran at ~50 TFLOP/s, a twentieth of the bf16 peak
    h100 = get_device("h100")
    half = ModelProfile.from_parameter_count(1e9, global_batch=64)
    fp32 = dataclasses.replace(half, compute_precision="fp32", tf32_fraction=0.0)
    conv = dataclasses.replace(fp32, tf32_fraction=0.5)
    t = {m.compute_precision + str(m.tf32_fraction):
         predict("one_device", 1, m, _cluster("h100")).breakdown["compute"]
         for m in (half, fp32, conv)}
    assert t["half0.0"] == pytest.approx(6e9 * 64 / (989e12 * h100.mfu))
    assert t["fp320.0"] == pytest.approx(6e9 * 64 / (67e12 * h100.mfu))
    # half the FLOPs at 494 TFLOP/s, half at 67: the times add, not the rates
    assert t["fp320.5"] == pytest.approx(6e9 * 64 * (0.5 / 494e12 + 0.5 / 67e12) / h100.mfu)


def test_a_pipeline_slot_is_its_busiest_stage_as_the_default_cut_makes_it():
    # on an accelerator compute is FLOPs over the rate, so the slot's share shows exactly
    even = ModelProfile.from_parameter_count(1e8, global_batch=64)
    uneven = dataclasses.replace(even, pipeline_stage_shares={"2": 0.7})
    c = _cluster("h100")
    a = predict("pipeline", 2, even, c, microbatches=4)
    b = predict("pipeline", 2, uneven, c, microbatches=4)
    one = predict("one_device", 1, even, c).breakdown["compute"]
    slots = 4 + 2 - 1
    # 3 microbatches after the first add their gradients into the stage's .grad
    acc = 3 * 2 * max(even.param_bytes / 2, even.largest_tensor_bytes) / c.device.memory_bandwidth
    # model(x) then backward adds the busiest stage's forward of the batch (its share of a
    # third of the forward-and-backward, without a measured forward fraction)
    assert a.breakdown["compute"] == pytest.approx(slots * one / 4 * 0.5 + one / 3 * 0.5 + acc)
    assert b.breakdown["compute"] == pytest.approx(slots * one / 4 * 0.7 + one / 3 * 0.7 + acc)
    # a measured forward fraction (a CNN's forward was 60% of its forward and backward)
    measured = dataclasses.replace(uneven, forward_fraction=0.6)
    assert predict("pipeline", 2, measured, c, microbatches=4).breakdown["compute"] \
        == pytest.approx(slots * one / 4 * 0.7 + one * 0.6 * 0.7 + acc)
    # strategy.forward_backward runs no second forward
    fb = dataclasses.replace(measured, pipeline_forward_backward=True)
    assert predict("pipeline", 2, fb, c, microbatches=4).breakdown["compute"] \
        == pytest.approx(slots * one / 4 * 0.7 + acc)
    # a share below an even split (a profile of another cut) never makes a stage faster
    odd = dataclasses.replace(even, pipeline_stage_shares={"2": 0.3})
    assert predict("pipeline", 2, odd, c, microbatches=4).breakdown["compute"] \
        == pytest.approx(a.breakdown["compute"])


def test_each_microbatch_after_the_first_adds_its_stage_gradients_per_byte():
    """A 12.8 MB embedding sits whole in one stage: each of the 3 microbatches after the first
    writes its gradient and adds it into ``.grad`` (two copies of it at the machine's
    bandwidth), however few FLOPs it has; a model of many small tensors pays its even share."""
    machine = MachineProfile.nominal()
    cpu = Cluster(get_device("cpu"), parse_link("10gbit", 25e-6), machine, 2)
    small = ModelProfile(name="bag", params=3_200_000, global_batch=256, param_bytes=12.8e6,
                         grad_bytes=12.8e6, weight_tensors=2, measured=False,
                         flops_per_sample=2e3, largest_tensor_bytes=1e5)
    whole = dataclasses.replace(small, largest_tensor_bytes=12.8e6)

    def compute(m: ModelProfile, microbatches: int) -> float:
        return predict("pipeline", 2, m, cpu, microbatches=microbatches).breakdown["compute"]

    assert compute(whole, 4) - compute(small, 4) == pytest.approx(
        3 * 2 * (12.8e6 - 6.4e6) / machine.memory_bandwidth)
    assert compute(whole, 8) - compute(small, 8) == pytest.approx(
        7 * 2 * (12.8e6 - 6.4e6) / machine.memory_bandwidth)


def test_ps_queue_wait_solves_half_a_push_at_the_servers_utilisation():
    from replicator.plan.formulas import ps_queue_wait

    t, n, s = 0.025, 3, 0.0075
    w = ps_queue_wait(t, n, s)
    rho = n * s / (t + 2 * w)
    assert w == pytest.approx(rho * s / 2)  # the fixed point
    assert 0 < rho < 1
    assert ps_queue_wait(t, 1, s) == 0.0 and ps_queue_wait(t, 4, 0.0) == 0.0
    assert ps_queue_wait(t, 4, s) > w  # more workers, a busier server


def test_parameter_server_workers_wait_for_a_server_busy_with_the_others():
    model = ModelProfile.from_parameter_count(1e6, global_batch=480)
    c = _cluster(per_host=4)
    one, three = (predict("parameter_server", n, model, c) for n in (1, 3))
    # a lone worker pays the claim's round trip; three also wait behind each other's pushes
    assert three.breakdown["input"] > one.breakdown["input"] > 0
    assert three.breakdown["communication"] > one.breakdown["communication"]
    assert three.step_seconds == pytest.approx(sum(three.breakdown.values()))
    # never faster than the server's share of every worker's traffic
    slow_link = _cluster(link="100mbit")
    for n in (8, 64):
        p = predict("parameter_server", n, model, slow_link)
        assert p.step_seconds >= n * (model.grad_bytes + model.param_bytes) / 12.5e6 * 0.999


def test_fsdp_waits_for_its_slowest_rank_at_every_blocks_collectives():
    """Mirrored stops once a step; FSDP at 3 collectives per block: with independent drifts
    between stops its straggler wait is sqrt(3 x blocks) times one stop's."""
    machine = MachineProfile.nominal()
    machine.straggle = {1: 1.0, 2: 1.1}
    even = MachineProfile.nominal()
    even.straggle = {1: 1.0, 2: 1.0}
    model = ModelProfile(name="c", params=1000, global_batch=96, param_bytes=4e3,
                         grad_bytes=4e3, optimizer_state_bytes=8e3,
                         activation_bytes_per_sample=10, largest_tensor_bytes=4e3,
                         weight_tensors=4, measured=False, flops_per_sample=1e8)

    def wait(strategy: str) -> float:
        def comm(prof: MachineProfile) -> float:
            c = Cluster(get_device("cpu"), parse_link("25gbit"), prof, 2)
            return predict(strategy, 2, model, c).breakdown["communication"]
        return comm(machine) - comm(even)

    compute = predict("mirrored", 2, model,
                      Cluster(get_device("cpu"), parse_link("25gbit"), machine, 2)
                      ).breakdown["compute"]
    assert wait("mirrored") == pytest.approx(0.1 * compute, rel=1e-6)
    assert wait("fsdp") == pytest.approx(0.1 * compute * math.sqrt(12), rel=1e-6)


@pytest.mark.parametrize("fit", [(2e-3, 0.0), (0.0, 1e-4), (1e-3, 5e-5)])
def test_a_pipeline_stage_takes_a_flop_share_of_per_sample_work_and_even_share_of_fixed(
        fit):
    # a measured CPU profile: compute = c0 + c1 * batch; the default cut gives one stage 80%
    # of the FLOPs, but a forward and backward's fixed cost follows the layers, evenly
    base = ModelProfile(name="m", params=1000, global_batch=64, param_bytes=4000,
                        grad_bytes=4000, step_seconds=0.01, compute_seconds=0.008,
                        optimizer_seconds=1e-4, input_seconds=1e-4, compute_fit=fit,
                        collectives_per_step=1.0, weight_tensors=4,
                        pipeline_forward_backward=True)  # the slots alone
    c = _cluster()

    def compute(share: float) -> float:
        m = dataclasses.replace(base, pipeline_stage_shares={"2": share})
        return predict("pipeline", 2, m, c, microbatches=4).breakdown["compute"]

    even, uneven, whole = compute(0.5), compute(0.8), compute(1.0)
    if fit[1] == 0.0:  # all fixed: the uneven cut costs nothing more
        assert uneven == pytest.approx(even) and whole == pytest.approx(even)
    else:  # the per-sample part grows with the share, linearly
        assert uneven - even == pytest.approx((whole - even) * 0.6)
        assert uneven > even


def test_a_pipeline_slot_repeats_the_stage_layer_calls_not_the_step_fixed_cost():
    # 2 ms of a step's forward and backward do not grow with the samples; with the layer
    # calls measured (10 calls of 20 us), a slot repeats its stage's 5 calls (100 us) and its
    # weights' traffic (3 x 2 kB of 4 kB read or written at 5 GB/s: 1.2 us), not half of the
    # 2 ms (the loss, the engine and the run are the schedule's, in its slot cost)
    base = ModelProfile(name="m", params=1000, global_batch=64, param_bytes=4000,
                        grad_bytes=4000, step_seconds=0.01, compute_seconds=0.008,
                        optimizer_seconds=1e-4, input_seconds=1e-4, compute_fit=(2e-3, 0.0),
                        collectives_per_step=1.0, weight_tensors=4)
    machine = dataclasses.replace(MachineProfile.nominal(), layer_call=20e-6,
                                  slowdown={1: 1.0, 2: 1.0})
    c = Cluster(get_device("cpu"), parse_link("25gbit"), machine, None)

    def compute(m: ModelProfile) -> float:
        return predict("pipeline", 2, m, c, microbatches=4).breakdown["compute"]

    unmeasured = compute(base)
    measured = compute(dataclasses.replace(base, layer_calls=10))
    slots = 4 + 2 - 1
    assert machine.memory_bandwidth == 5e9
    assert unmeasured - measured == pytest.approx(slots * (1e-3 - 100e-6 - 1.2e-6))
    # never more than the fixed cost itself: 1,000 calls of 20 us cap at the 2 ms
    capped = compute(dataclasses.replace(base, layer_calls=1000))
    assert capped == pytest.approx(unmeasured)


def test_a_replicas_input_keeps_the_occasional_gaps_and_shares_the_samples_part():
    """Every replica starts every epoch (the global batches per epoch do not change with
    the replicas): the occasional part of the input is not divided by the replicas, the
    steady part is, above the pipeline's fixed cost per batch."""
    machine = MachineProfile.nominal()
    machine.input_fixed = 5e-5
    c = Cluster(get_device("cpu"), parse_link("25gbit"), machine, 4)

    def model(occasional: float) -> ModelProfile:
        return ModelProfile(name="m", params=1000, global_batch=96, param_bytes=4e3,
                            grad_bytes=4e3, largest_tensor_bytes=4e3, measured=True,
                            compute_fit=(1e-4, 1e-5), input_seconds=1e-3,
                            input_seconds_1thread=1e-3, optimizer_seconds_1thread=1e-4,
                            input_occasional_seconds=occasional)

    slow = machine.slowdown_for(2)
    without = predict("mirrored", 2, model(0.0), c).breakdown["input"]
    assert without == pytest.approx((5e-5 + (1e-3 - 5e-5) / 2) * slow)
    with_gaps = predict("mirrored", 2, model(4e-4), c).breakdown["input"]
    assert with_gaps == pytest.approx((4e-4 + 5e-5 + (6e-4 - 5e-5) / 2) * slow)
    # one process pays its whole input either way
    assert predict("one_device", 1, model(4e-4), c).breakdown["input"] == pytest.approx(1e-3)


def test_replicas_of_a_model_whose_threads_scale_are_slowed_no_more_than_its_threads_imply():
    """A compute-bound CNN ran 1.5x faster on the process's two threads than on one: two
    one-thread replicas share the cores at least as well, so each is at most 2 / 1.5 = 1.33x
    slower than one alone, even where the machine's matmuls measured 1.6x (a held-out CNN's
    settings were all predicted 20-60% high). A model its threads do not speed up keeps the
    machine's figure."""
    from replicator.plan.cost_model import slowdown

    machine = MachineProfile.nominal()
    machine.slowdown = {1: 1.0, 2: 1.6, 3: 2.4, 4: 3.2}
    cnn = ModelProfile(name="cnn", params=10**5, global_batch=64, param_bytes=4e5,
                       grad_bytes=4e5, compute_seconds=0.46, compute_fit=(0.01, 0.0106),
                       optimizer_seconds=1e-3, optimizer_seconds_1thread=1e-3, threads=2)
    assert cnn.thread_speedup() == pytest.approx(0.6884 / 0.46)
    assert slowdown(cnn, machine, 2) == pytest.approx(2 * 0.46 / 0.6884)
    assert slowdown(cnn, machine, 3) == pytest.approx(3 * 0.46 / 0.6884)
    assert slowdown(cnn, machine, 1) == 1.0
    cluster = Cluster(get_device("cpu"), parse_link("25gbit"), machine, ranks_per_host=4)
    p = predict("mirrored", 2, cnn, cluster)
    assert p.breakdown["compute"] == pytest.approx(cnn.compute_1thread(32) * 2 * 0.46 / 0.6884)
    # threads that do not help (a small model: 2 threads slower than one) change nothing
    small = dataclasses.replace(cnn, compute_seconds=0.9)
    assert small.thread_speedup() < 1 and slowdown(small, machine, 2) == 1.6
    one_thread = dataclasses.replace(cnn, threads=1)
    assert one_thread.thread_speedup() == 1.0 and slowdown(one_thread, machine, 2) == 1.6
