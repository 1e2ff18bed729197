"""`bench latency --profile-kernels`: the marginal-time accounting over overlapping kernels, the
names it reports, and the flag's checks (the recording itself needs a GPU)."""

from __future__ import annotations

import pytest

from tinyvllm.bench.kernel_profile import marginal_times, short_name
from tinyvllm.entrypoints.cli import main


def test_marginal_times_charge_each_kernel_its_end_past_the_previous_end():
    # Two steps of: a (0-10) overlapped by b (5-12, launched early as under PDL), a copy ending
    # inside b's span (6-8: charged nothing), an idle gap, then c (15-20).
    step = [(0, 10, "a"), (5, 12, "b"), (6, 8, "copy"), (15, 20, "c")]
    events = step + [(s + 20, e + 20, n) for s, e, n in step]
    p = marginal_times(events, num_steps=2)
    by_name = {k.name: k for k in p.kernels}
    assert [k.name for k in p.kernels] == ["a", "c", "b", "copy"]  # by marginal time
    assert by_name["a"].marginal_us == 10 and by_name["b"].marginal_us == 2
    assert by_name["c"].marginal_us == 5 and by_name["copy"].marginal_us == 0
    assert by_name["b"].busy_us == 7 and by_name["copy"].calls_per_step == 1
    assert p.span_us == 20 and p.idle_us == 3  # 40 us over 2 steps; gaps 12-15 and 32-35
    assert sum(k.marginal_us for k in p.kernels) + p.idle_us == p.span_us


def test_an_empty_recording_is_an_empty_profile():
    p = marginal_times([], num_steps=4)
    assert p.kernels == [] and p.span_us == 0 and p.num_steps == 4


def test_short_names_keep_template_arguments_and_drop_parameters():
    assert short_name("void tinyvllm::quant_tile_gemv_kernel<__nv_bfloat16, 1, 1, true, 2, 4, "
                      "3>(__nv_bfloat16*, uint4 const*, int)") == (
        "tinyvllm::quant_tile_gemv_kernel<__nv_bfloat16, 1, 1, true, 2, 4, 3>")
    assert short_name("void at::native::(anonymous namespace)::indexSelectSmallIndex<float, "
                      "long>(at::cuda::detail::TensorInfo<float, unsigned int>, long)") == (
        "at::native::(anonymous namespace)::indexSelectSmallIndex<float, long>")
    assert short_name("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"


@pytest.mark.parametrize("steps", ["4", "-1"])
def test_the_flag_needs_a_cuda_device_and_a_positive_count(steps, capsys):
    # It fails before anything loads, naming the flag.
    assert main(["bench", "latency", "--device", "cpu", "--no-baseline", "--profile-kernels",
                 steps]) == 2
    assert "--profile-kernels" in capsys.readouterr().err


def test_the_profiled_request_runs_to_its_end(tiny_model):
    # On the CPU (CPU activity: no kernel is counted) the request is driven as on a GPU: its
    # first tokens unrecorded, the recorded steps, then to its end.
    from torch.profiler import ProfilerActivity

    from tests.engine.conftest import make_engine
    from tinyvllm.bench.kernel_profile import profile_decode

    engine = make_engine(tiny_model, num_kv_blocks=64)
    p = profile_decode(engine, [1, 2, 3], num_steps=3, sync=lambda: None,
                       activity=ProfilerActivity.CPU)
    assert p.num_steps == 3 and p.kernels == []
    assert not engine.has_unfinished_requests()


def test_a_repeated_block_of_launches_is_reported_launch_by_launch():
    # Two steps of: embed, three "layers" of (qkv, attn, o, down) where o and down are one
    # instantiation (gemv) with different times, then the head. The block is the layer, in
    # launch order, each launch's time averaged over its 6 occurrences.
    def step(t0):
        ev, t = [(t0, t0 + 1, "embed")], t0 + 1
        for layer in range(3):
            for name, dur in (("qkv", 2), ("attn", 3), ("gemv", 1), ("gemv", 4 + layer)):
                ev.append((t, t + dur, name))
                t += dur
        return ev + [(t, t + 5, "head")]
    events = step(0) + step(100)
    p = marginal_times(events, num_steps=2)
    block = p.block
    assert block is not None and block.repeats == 3
    assert [s.name for s in block.slots] == ["qkv", "attn", "gemv", "gemv"]
    assert [s.marginal_us for s in block.slots] == [2, 3, 1, 5]  # down: (4 + 5 + 6) / 3
    assert block.marginal_us == 11
    gemv = next(k for k in p.kernels if k.name == "gemv")
    assert gemv.calls_per_step == 6 and gemv.marginal_us == 18


def test_no_block_where_the_steps_differ_or_nothing_repeats():
    assert marginal_times([(0, 1, "a"), (1, 2, "b"), (2, 3, "c")], num_steps=1).block is None
    two_steps = [(0, 1, "a"), (1, 2, "a"), (10, 11, "a"), (11, 12, "b")]
    assert marginal_times(two_steps, num_steps=2).block is None
