"""The integer-group weight layout (ops/quant_linear.py): packing and the torch reference."""

import pytest
import torch

from tinyvllm.ops import quant_linear as ql


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (5, 64), generator=g, dtype=torch.int32)
    packed = ql.pack(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 64 * bits // 32)
    assert torch.equal(ql.unpack(packed, bits), values)


def test_value_j_of_a_word_sits_in_bits_j_times_bits():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.int32)
    word = int(ql.pack(values, 4)[0, 0]) & 0xFFFFFFFF
    assert word == 0xF7654321


@pytest.mark.parametrize("group_size", [16, 64])
def test_reference_is_x_permuted_times_the_dequantized_weight(group_size):
    g = torch.Generator().manual_seed(0)
    n, k, bits = 12, 64, 4
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // group_size, generator=g) + 0.5
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).float()
    perm = torch.randperm(k, generator=g)
    x = torch.randn(3, k, generator=g)
    bias = torch.randn(n, generator=g)
    w = (q.float() - zeros.repeat_interleave(group_size, 1)) * scales.repeat_interleave(group_size, 1)
    want = x[:, perm] @ w.T + bias
    got = ql.quant_linear(x, ql.pack(q, bits), scales, zeros, bits, group_size, perm, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_layouts_name_the_tensor():
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="group_size"):
        ql.check_layout(qweight, torch.ones(4, 2), torch.ones(4, 2), 4, 48)
    with pytest.raises(ValueError, match="scales"):
        ql.check_layout(qweight, torch.ones(4, 3), torch.ones(4, 2), 4, 32)
    with pytest.raises(ValueError, match="bits"):
        ql.check_layout(qweight, torch.ones(4, 2), torch.ones(4, 2), 3, 32)
