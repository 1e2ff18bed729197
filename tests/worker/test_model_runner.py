"""ModelRunner on the CPU: the flat inputs it builds, graph padding, and the tokens it produces.

The CUDA-only parts (graph capture and replay, memory profiling) are in tests/gpu; here the
decode-graph padding is checked through `_prepare_inputs` with a graph table that was never
captured, which is all host-side arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm import ops
from tinyvllm.config import EngineConfig, KernelConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.scheduling.output import NewRequest, ScheduledRequest, SchedulerOutput
from tinyvllm.model.loader import LoadedModel
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.cuda_graph import (DecodeGraphs, GraphKey, PiecewiseGraphs,
                                        decode_batch_sizes, decode_seq_len_tiers,
                                        piecewise_token_sizes)
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.worker.requests import CachedRequest, RequestRecords, apply_scheduler_output

from tests.engine.conftest import run_to_completion

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 7, 199, 12], [9, 8, 7, 6, 5], [100, 200, 150, 10, 11, 12,
                                                                       13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model) -> LoadedModel:
    return tiny_model


def make_runner(loaded, **kwargs) -> ModelRunner:
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                      num_kv_blocks=64, **kwargs)
    return ModelRunner(config, loaded=loaded)


def scheduled(request_id: str, prompt: list[int], output: list[int], num_computed: int,
              block_ids: list[int], num_new: int) -> tuple[NewRequest, list[int], ScheduledRequest]:
    """A request the worker learns of in this step with `output` already sampled (as after a
    preemption), its blocks, and its share of the step."""
    new = NewRequest(request_id, list(prompt), GREEDY)
    share = ScheduledRequest(request_id, num_new, num_computed,
                             completes_sequence=num_computed + num_new >= len(prompt) + len(output),
                             new_block_ids=list(block_ids))
    return new, list(output), share


def step_records(runner, requests):
    """The step of `scheduled(...)` requests and the runner's records of them, each record's
    output ids as the request had them."""
    out = SchedulerOutput(new_requests=[n for n, _, _ in requests],
                          scheduled=[s for _, _, s in requests])
    rows = apply_scheduler_output(runner.requests, out, runner.device)
    for row, (_, output, _) in zip(rows, requests):
        row.output_token_ids.extend(output)
    return out, rows


def prepare(runner: ModelRunner, *requests):
    """The runner's inputs for a step of these `scheduled(...)` requests."""
    out, rows = step_records(runner, requests)
    return runner._prepare_inputs(out, rows)


def make_engine(loaded, **kwargs) -> EngineCore:
    runner = make_runner(loaded, **kwargs)
    return EngineCore(runner.config, UniProcExecutor(runner.config, runner))


def generate(engine: EngineCore, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return run_to_completion(engine, prompts, params)


# --- buckets -------------------------------------------------------------------------------------

def test_decode_batch_sizes():
    assert decode_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    # Above 256 (`--max-num-seqs` 512 / 1024), buckets 64 apart, up to 1024.
    assert decode_batch_sizes(1024) == decode_batch_sizes(256) + list(range(320, 1025, 64))
    assert decode_batch_sizes(1000) == decode_batch_sizes(256) + list(range(320, 961, 64)) + [1000]
    assert decode_batch_sizes(4096) == decode_batch_sizes(1024)
    assert decode_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_batch_sizes(6) == [1, 2, 4, 6]


def test_piecewise_token_sizes():
    # at most half a step of padding, ending at the limit (512 by default)
    assert piecewise_token_sizes(512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert piecewise_token_sizes(100) == [16, 24, 32, 48, 64, 96, 100]
    assert piecewise_token_sizes(16) == [16]
    assert piecewise_token_sizes(0) == []


def test_piecewise_graphs_only_on_cuda(tiny_model):
    """The CPU runs every step eagerly: no piecewise graphs, whatever the limit."""
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32",
                                      max_piecewise_graph_tokens=256)
    assert ModelRunner(config, loaded=tiny_model).piecewise is None


def test_piecewise_pieces_equal_the_forward(tiny_model):
    """PiecewiseGraphs' dataflow without the graphs (on the CPU its pieces run eagerly over the
    static buffers, each layer's attention between them): every step of prompts, chunks and
    decodes gives the forward's hidden states, whatever earlier, larger steps left in the
    padding rows."""
    import torch

    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", max_num_seqs=8,
                                      max_num_batched_tokens=48)
    core = EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=tiny_model)))
    runner = core.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, 48)
    forward = runner._forward
    sizes = []

    def checked(inputs):
        n = inputs.num_tokens
        size = next(t for t in pieces.sizes if t >= n)
        b = runner.buffers
        hidden = pieces.run(size, b.input_ids_device(n), b.positions_device(n),
                            inputs.meta).clone()
        logits, rows = forward(inputs)  # over the same cache: the K/V it wrote again
        torch.testing.assert_close(hidden, rows, atol=1e-4, rtol=1e-4)
        sizes.append(n)
        return logits, rows

    runner._forward = checked
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (40, 7, 70, 12, 3)]
    outputs = run_to_completion(core, prompts, [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 4, 6, 8)])
    assert [len(o) for o in outputs] == [5, 9, 4, 6, 8]
    assert max(sizes) == 48 and min(sizes) < 8 and len(set(sizes)) >= 4


def test_forward_piece_of_no_layers_is_the_final_norm_of_the_embedding(tiny_model):
    """The last piece with num_layers 0 (no residual stream yet) is the final RMSNorm over the
    embedded tokens, all of its rows."""
    import torch

    from tinyvllm.ops.layers import rms_norm_ref

    model = tiny_model.model
    x = model.model.embed_tokens(torch.tensor([3, 17, 99, 4]))
    out, residual = model.forward_piece(0, x, None, num_layers=0)
    assert residual is None and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, model.model.norm, model.arch.rms_norm_eps))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_rows_keep_their_tokens_beside_unseeded_decodes(tiny_model, async_scheduling):
    """A decode step sets the sample offsets (each row's output index) only while a seeded
    request is among the records (`RequestRecords.num_seeded`): a seeded request's tokens are
    the same alone and beside unseeded ones, with its tokens in flight or not."""
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32",
                                      async_scheduling=async_scheduling)
    core = EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=tiny_model)))
    records = core.runner.requests
    sample = core.runner.sampler.sample
    offsets: list[int] = []  # the seeded row's sample offset, step by step (the kernel's Philox)

    def recorded(logits, states):
        offsets.extend(s.sample_index for s in states if s.generator is not None)
        return sample(logits, states)

    core.runner.sampler.sample = recorded

    def run(num_unseeded: int) -> list[int]:
        offsets.clear()
        params = [SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)]
        params += [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
                   for _ in range(num_unseeded)]
        prompts = [[5, 6, 7, 8]] + [[9 + i, 10, 11] for i in range(num_unseeded)]
        tokens = run_to_completion(core, prompts, params)[0]
        assert offsets == list(range(12))
        return tokens

    alone = run(0)
    assert len(alone) == 12 and records.num_seeded == 1
    assert run(5) == alone  # the first run's records went with this run's first step
    assert records.num_seeded == sum(r.sampling.generator is not None for r in records.values())
    assert run(5) == alone


def test_decode_seq_len_tiers():
    assert decode_seq_len_tiers(131072) == [1024, 4096, 8192]
    assert decode_seq_len_tiers(8192) == [1024, 4096, 8192]
    assert decode_seq_len_tiers(2048) == [1024, 2048]
    assert decode_seq_len_tiers(300) == [300]


def test_pick_smallest_graph_that_fits():
    graphs = DecodeGraphs(None, [], None, [1, 2, 4, 8], [64, 200], block_size=16)
    assert graphs.pick(3, 10) == GraphKey(4, 64, 4)
    assert graphs.pick(8, 65) == GraphKey(8, 200, 13)
    assert graphs.pick(9, 10) is None  # batch above the largest bucket: eager
    assert graphs.pick(1, 201) is None  # context above the largest tier: eager


def test_record_block_table_follows_offsets():
    r = CachedRequest(NewRequest("a", [1, 2, 3], GREEDY), "cpu")
    ids = list(range(1, 21))
    r.set_blocks(0, ids[:3])
    assert r.block_table.tolist() == [1, 2, 3]
    r.set_blocks(3, ids[3:])
    assert r.block_table.tolist() == ids  # grown past the first capacity
    r.set_blocks(2, [99])  # a rollback freed blocks 3.. and one was allocated again
    assert r.block_table.tolist() == [1, 2, 99]
    r.set_blocks(0, [7, 8])  # resumed after preemption: a whole new table
    assert r.block_table.tolist() == [7, 8]
    with pytest.raises(RuntimeError, match="block offset 5"):
        r.set_blocks(5, [1])


def test_records_share_one_block_table_array():
    """Each record's table is a row of its RequestRecords' array: rows are reused after a
    finish, the array grows past its first rows and width, and entries past a record's blocks
    are 0 (the null block) after a rollback or a preemption."""
    records = RequestRecords(table_width=4)
    made = [records.add(NewRequest(str(i), [1, 2], GREEDY), "cpu") for i in range(40)]
    assert len({r.row for r in made}) == 40  # grown past the first rows
    for i, r in enumerate(made):
        r.set_blocks(0, [i + 1] * (1 + i % 9))  # width 9 > 4: grown
    for i, r in enumerate(made):
        assert r.block_table.tolist() == [i + 1] * (1 + i % 9)
    r = made[8]
    r.set_blocks(2, [])  # a rollback
    assert records.tables.array[r.row].tolist()[:9] == [9, 9] + [0] * 7
    out = SchedulerOutput(step_id=1, preempted_request_ids=["8"], finished_request_ids=["3"])
    apply_scheduler_output(records, out, "cpu")
    assert r.num_blocks == 0 and not records.tables.array[r.row].any()
    assert "3" not in records
    reused = records.add(NewRequest("new", [1], GREEDY), "cpu")
    assert reused.row == made[3].row and reused.block_table.tolist() == []
    assert not records.tables.array[reused.row].any()


# --- inputs --------------------------------------------------------------------------------------

def test_mixed_batch_inputs(loaded):
    runner = make_runner(loaded)
    # a: decode at position 11 (prompt 11 + 1 output); b: 3-token chunk 2..4 of a 5-token prompt
    # that completes it; c: first chunk of 6 tokens of a 13-token prompt (not sampled).
    inputs = prepare(runner, scheduled("a", PROMPTS[0], [42], 11, [3, 9, 5], 1),
                     scheduled("b", PROMPTS[1], [], 2, [7, 2], 3),
                     scheduled("c", PROMPTS[2], [], 0, [4, 6], 6))
    meta = inputs.meta
    buf = runner.buffers
    assert inputs.graph is None and inputs.num_tokens == 10
    assert buf.input_ids.np[:10].tolist() == [42, 7, 6, 5] + PROMPTS[2][:6]
    assert buf.positions.np[:10].tolist() == [11, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    # slot = block_ids[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0,
                                          16, 17, 18, 19, 24, 25]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 10]
    assert meta.seq_lens.tolist() == [12, 5, 6]
    assert meta.block_tables.tolist() == [[3, 9, 5], [7, 2, 0], [4, 6, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (6, 12)
    assert inputs.logits_indices.tolist() == [0, 3]
    assert [r.request_id for r in inputs.sampled_requests] == ["a", "b"]


def test_decode_padded_to_graph_bucket(loaded):
    runner = make_runner(loaded)
    runner.graphs = DecodeGraphs(None, [], runner.buffers, [1, 2, 4], [16, 32], BLOCK_SIZE)
    inputs = prepare(runner, scheduled("a", PROMPTS[0], [42, 43], 12, [3, 9, 5, 8], 1),
                     scheduled("b", PROMPTS[1], [1], 5, [7, 2], 1),
                     # the last prompt token: also one new token
                     scheduled("c", [1, 2, 3], [], 2, [6], 1))
    buf = runner.buffers
    assert inputs.graph == GraphKey(4, 16, 4) and inputs.meta is None
    assert buf.input_ids.np[:4].tolist() == [43, 1, 3, 0]
    assert buf.positions.np[:4].tolist() == [12, 5, 2, 0]
    assert buf.slot_mapping.np[:4].tolist() == [8 * 4 + 0, 2 * 4 + 1, 6 * 4 + 2, -1]  # -1: no write
    assert buf.query_start_loc.np[:5].tolist() == [0, 1, 2, 3, 4]
    assert buf.seq_lens.np[:4].tolist() == [13, 6, 3, 1]
    assert buf.block_tables.np[:16].reshape(4, 4).tolist() == [
        [3, 9, 5, 8], [7, 2, 0, 0], [6, 0, 0, 0], [0, 0, 0, 0]]  # padding row: null block
    assert inputs.logits_indices.tolist() == [0, 1, 2]


FILLED = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
          "block_tables", "logits_indices", "prev_token_dst", "prev_token_src")


def fill_both_ways(runner, out, rows, width=4):
    """The step's host inputs written by `_fill_host` and by `_fill_host_decodes`, every buffer
    preset to -7 first (what neither path writes stays visible); asserts the buffers equal.
    Each result: sampled request ids, queued rows, logits rows, prompt jobs, the records'
    output indices and the buffers."""
    b, n = runner.buffers, len(rows)

    def fill(method):
        b.begin(n, n, width)
        for name in FILLED:
            getattr(b, name).np[:] = -7
        sampled, num_prev, num_rows, jobs = method(out.scheduled, rows,
                                                   b.block_table_rows(n, width))
        return ([r.request_id for r in sampled], num_prev, num_rows, jobs,
                [r.sampling.output_index for r in rows],
                {name: getattr(b, name).np.copy() for name in FILLED})

    general, fast = fill(runner._fill_host), fill(runner._fill_host_decodes)
    for name in FILLED:
        np.testing.assert_array_equal(fast[5][name], general[5][name], err_msg=name)
    return general, fast


def test_decode_only_steps_fill_what_the_general_path_fills(loaded):
    """`_fill_host_decodes` (steps of decodes only) writes every input the general `_fill_host`
    writes, the in-flight token's fill included, and returns the same counts."""
    import torch

    from tinyvllm.worker.model_runner import _PrevSampled

    runner = make_runner(loaded)
    requests = [scheduled("a", PROMPTS[0], [42, 43], 12, [3, 9, 5, 8], 1),
                scheduled("b", PROMPTS[1], [1], 6, [7, 2], 1),  # its token at 6 is in flight
                scheduled("c", [1, 2, 3], [], 2, [6], 1)]
    out, rows = step_records(runner, requests)
    runner._prev_sampled = _PrevSampled(torch.tensor([7, 77]), {"b": (1, 6)})
    general, fast = fill_both_ways(runner, out, rows)
    assert general[:5] == fast[:5] == (["a", "b", "c"], 1, 3, [], [2, 2, 0])
    assert fast[5]["prev_token_dst"][0] == 1 and fast[5]["prev_token_src"][0] == 1


def test_decode_step_behind_a_plain_step_queues_every_input(loaded, monkeypatch):
    """A step of decodes whose every input is the previous plain step's sample (async
    scheduling's usual step): `_fill_host_decodes` queues each row from the sample's row in
    the previous step (by the records' table rows, in array operations), as `_fill_host` does
    by request id; a row whose token the host knows takes the general way."""
    import torch

    from tinyvllm.worker import model_runner
    from tinyvllm.worker.model_runner import _PrevSampled

    monkeypatch.setattr(model_runner, "_ARRAY_MIN_ROWS", 1)  # the array path at 3 rows
    calls = []
    queue = ModelRunner._queue_in_flight_tokens
    monkeypatch.setattr(ModelRunner, "_queue_in_flight_tokens",
                        lambda self, *args: calls.append(queue(self, *args)) or calls[-1])
    runner = make_runner(loaded)
    requests = [scheduled("a", PROMPTS[0], [42, 43], 13, [3, 9, 5, 8], 1),
                scheduled("b", PROMPTS[1], [1], 6, [7, 2], 1),
                scheduled("c", [1, 2, 3], [], 3, [6], 1)]
    out, rows = step_records(runner, requests)
    a, b_, c = rows
    # The previous step sampled c, a, b (and one that finished since) in its rows 0..3.
    gone = CachedRequest(NewRequest("gone", [5, 5], GREEDY), runner.device)
    runner._prev_sampled = _PrevSampled(torch.tensor([7, 77, 8, 9]), None, [c, gone, a, b_],
                                        [3, 2, 13, 6])
    general, fast = fill_both_ways(runner, out, rows)
    assert general[:5] == fast[:5] == (["a", "b", "c"], 3, 3, [], [3, 2, 1])
    assert fast[5]["prev_token_src"][:3].tolist() == [2, 3, 0]
    assert fast[5]["input_ids"][:3].tolist() == [0, 0, 0] and calls == [3]
    # a's token at 13 now on the host: its id is written, the others still queued.
    a.output_token_ids.append(44)
    general, fast = fill_both_ways(runner, out, rows)
    assert general[:5] == fast[:5] == (["a", "b", "c"], 2, 3, [], [3, 2, 1])
    assert fast[5]["input_ids"][0] == 44 and calls == [3, None]


def test_verification_laid_out_as_decode_rows(loaded):
    """With verification graphs, a step of decodes and verifications becomes one decode row per
    token: row j of a request verifying k drafts has the request's block table and a context
    ending at its own position; the rest pads up to the bucket."""
    runner = make_runner(loaded)
    runner.verify_graphs = DecodeGraphs(None, [], runner.buffers, [1, 2, 8], [16, 32],
                                        BLOCK_SIZE, verify=True)
    new_a, out_a, share_a = scheduled("a", PROMPTS[0], [42], 11, [3, 9, 5, 8], 3)
    share_a.draft_token_ids = [7, 8]  # a verifies two drafts after its last token, 42
    inputs = prepare(runner, (new_a, out_a, share_a),
                     scheduled("b", PROMPTS[1], [1], 5, [7, 2], 1))
    buf = runner.buffers
    assert inputs.graph == GraphKey(8, 16, 4, verify=True) and inputs.meta is None
    assert buf.input_ids.np[:5].tolist() == [42, 7, 8, 1, 0]
    assert buf.positions.np[:5].tolist() == [11, 12, 13, 5, 0]
    assert buf.slot_mapping.np[:5].tolist() == [5 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1, 2 * 4 + 1, -1]
    assert buf.query_start_loc.np[:9].tolist() == list(range(9))
    assert buf.seq_lens.np[:8].tolist() == [12, 13, 14, 6, 1, 1, 1, 1]
    assert buf.block_tables.np[:32].reshape(8, 4).tolist() == (
        [[3, 9, 5, 8]] * 3 + [[7, 2, 0, 0]] + [[0, 0, 0, 0]] * 4)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert inputs.draft_token_ids == [[7, 8], []]


def test_decode_rows_compute_the_verification_logits(loaded):
    """The decode-row layout of a verification (each row attends up to its own position, all
    new keys written first) gives the logits of the usual layout (k + 1 queries of one
    sequence), here with the torch reference attention."""
    def verification_step(runner):
        new_a, out_a, share_a = scheduled("a", PROMPTS[0], [42], 11, [3, 9, 5, 8], 3)
        share_a.draft_token_ids = [7, 8]
        return prepare(runner, (new_a, out_a, share_a),
                       scheduled("b", PROMPTS[1], [1], 5, [7, 2], 1))

    eager = make_runner(loaded)
    inputs = verification_step(eager)
    assert inputs.graph is None and inputs.meta.max_query_len == 3
    expected, _ = eager._forward(inputs)

    rows = make_runner(loaded)
    rows.verify_graphs = DecodeGraphs(None, [], rows.buffers, [4], [16], BLOCK_SIZE, verify=True)
    inputs = verification_step(rows)
    key, buf = inputs.graph, rows.buffers
    meta = buf.metadata(key.batch_size, key.batch_size, key.block_table_width, 1,
                        key.max_seq_len)
    meta.fuse_new_token = False
    hidden = rows.model(buf.input_ids_device(4), buf.positions_device(4), rows.kv_caches, meta)
    np.testing.assert_allclose(rows.model.compute_logits(hidden).numpy(), expected.numpy(),
                               rtol=1e-5, atol=1e-5)


def test_step_too_large_is_refused(loaded):
    runner = make_runner(loaded, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        prepare(runner, scheduled("a", PROMPTS[2], [], 0, [4, 6, 1, 2], 13))


# --- tokens --------------------------------------------------------------------------------------

def test_greedy_decode_equals_full_recompute(loaded):
    """Token k of a greedy run is what a fresh prefill of prompt + tokens[:k] picks."""
    engine = make_engine(loaded)
    outputs = generate(engine, PROMPTS)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for prompt, tokens in zip(PROMPTS, outputs):
        assert len(tokens) == GREEDY.max_tokens
        for k in (1, len(tokens) - 1):
            fresh = make_engine(loaded)
            assert generate(fresh, [prompt + tokens[:k]], one)[0] == [tokens[k]]


@pytest.mark.parametrize("kwargs", [{"max_num_batched_tokens": 5}, {"max_num_seqs": 1},
                                    {"enable_prefix_caching": False}])
def test_batching_and_chunking_do_not_change_tokens(loaded, kwargs):
    alone = [generate(make_engine(loaded), [p])[0]
             for p in PROMPTS]
    engine = make_engine(loaded, **kwargs)
    assert generate(engine, PROMPTS) == alone
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_runner_installs_the_engine_kernel_choices(loaded):
    try:
        unfused = make_engine(loaded, fused_rotary_cache=False)
        assert not ops.kernel_config().fused_rotary_cache
        tokens = generate(unfused, PROMPTS)
        assert generate(make_engine(loaded), PROMPTS) == tokens
        assert ops.kernel_config() == KernelConfig()
    finally:
        ops.configure(KernelConfig())


def test_records_dropped_when_requests_finish(loaded):
    runner = make_runner(loaded)
    engine = EngineCore(runner.config, UniProcExecutor(runner.config, runner))
    generate(engine, PROMPTS)
    # Finished ids reach the runner with the next schedule, i.e. during the next run.
    generate(engine, PROMPTS[:1])
    assert set(runner.requests) <= {"0"}


def test_cpu_buffers_are_the_device_buffers(loaded):
    runner = make_runner(loaded)
    assert runner.graphs is None
    assert np.shares_memory(runner.buffers.input_ids.np, runner.buffers.input_ids.device.numpy())
    assert np.shares_memory(runner.buffers.block_tables.np,
                            runner.buffers.block_tables.device.numpy())


def test_torch_ops_run_on_one_thread_while_the_fused_packed_step_serves():
    """The kernels' pool does a packed CPU step's heavy work: torch's few ops in it run inline, so
    its OpenMP threads do not spin on the pool's cores; torch's count is restored after."""
    import types

    import torch

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner.model = types.SimpleNamespace(packed_decoder=object())
        with runner._torch_ops_inline():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        runner.model = types.SimpleNamespace(packed_decoder=None)  # the torch path keeps them
        with runner._torch_ops_inline():
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
