"""Q8_0 / Q4_1 dequantization: llmu's torch code and Triton kernel equal the gguf package bit for bit.

Blocks are made (and the torch path and gguf's numpy reference run) on the CPU; the Triton kernel
gets them on ``kernel_device()`` (cpu in the interpreter, cuda when compiled). Bit patterns are
compared on the CPU.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401  (sets the Triton mode first)
from llmu.models import kernels, quants
from llmu.models.gguf_file import GGUFFile
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()


def bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns: equality here is bit-for-bit (it tells -0.0 from 0.0)."""
    return x.contiguous().view(torch.int32).cpu()


def gguf_reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    out = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1)


def random_blocks(n_blocks: int, qtype: int, seed: int) -> torch.Tensor:
    """Random bytes as blocks, with finite float16 scales (a random pair of bytes may be a NaN or inf)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_block = quants.BLOCK[qtype][1]
    raw = torch.randint(0, 256, (n_blocks, per_block), generator=g, dtype=torch.uint8, device="cpu")
    n_halves = 2 if qtype == quants.Q4_1 else 1
    halves = (torch.randn(n_blocks, n_halves, generator=g, device="cpu") * 0.05).to(torch.float16)
    raw[:, : 2 * n_halves] = halves.view(torch.uint8).reshape(n_blocks, 2 * n_halves)
    return raw


@pytest.fixture(scope="module")
def gguf_file():
    f = GGUFFile()
    yield f
    f.close()


# the embeddings (the one Q8_0 tensor), matrices of every shape in a block, two layers apart
REAL = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.ffn_down.weight",
        "blk.29.ffn_gate.weight"]


@pytest.mark.parametrize("name", REAL)
def test_torch_dequant_equals_gguf_on_real_tensors(gguf_file, name):
    t = gguf_file.tensor(name)
    ours = t.dequantize()
    assert ours.dtype == torch.float32 and ours.shape == t.shape
    assert torch.equal(bits(ours.reshape(-1)), bits(gguf_reference(t.raw, t.qtype)))


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_k.weight", "blk.7.ffn_down.weight"])
def test_triton_dequant_equals_gguf_on_real_tensors(gguf_file, name):
    t = gguf_file.tensor(name)
    ours = kernels.dequantize_blocks(t.raw.contiguous().to(KDEV), t.qtype)
    assert torch.equal(bits(ours), bits(gguf_reference(t.raw, t.qtype)))


def test_real_file_types(gguf_file):
    types = {}
    for row in gguf_file.tensor_info():
        types[row["type"]] = types.get(row["type"], 0) + 1
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    t = gguf_file.tensor("blk.0.ffn_gate.weight")
    assert t.shape == (1536, 576) and t.type_name == "Q4_1"
    assert t.bits_per_value == pytest.approx(5.0)  # 20 bytes per 32 values


# block counts that are not multiples of the kernel's tile (64 blocks on a GPU, 4096 in the
# interpreter), a single block, and small tiles so that several programs each end ragged
@pytest.mark.parametrize("qtype", [quants.Q8_0, quants.Q4_1])
@pytest.mark.parametrize("n_blocks,tile", [(1, None), (3, 2), (37, 8), (64, 64), (1000, None), (4097, None)])
def test_random_blocks_torch_and_triton(qtype, n_blocks, tile):
    raw = random_blocks(n_blocks, qtype, seed=n_blocks)
    ref = gguf_reference(raw, qtype)
    assert torch.equal(bits(quants.dequantize(raw, qtype).reshape(-1)), bits(ref))
    assert torch.equal(bits(kernels.dequantize_blocks(raw.to(KDEV), qtype, blocks_per_program=tile)), bits(ref))


@settings(max_examples=8, deadline=None)
@given(n_blocks=st.integers(1, 300), seed=st.integers(0, 2**31 - 1), q4=st.booleans())
def test_random_blocks_hypothesis(n_blocks, seed, q4):
    qtype = quants.Q4_1 if q4 else quants.Q8_0
    raw = random_blocks(n_blocks, qtype, seed)
    ref = gguf_reference(raw, qtype)
    assert torch.equal(bits(kernels.dequantize_blocks(raw.to(KDEV), qtype, blocks_per_program=16)), bits(ref))
    assert torch.equal(bits(quants.dequantize(raw, qtype).reshape(-1)), bits(ref))


def test_q4_1_nibble_order():
    """Element j is the low nibble of byte j, element j + 16 its high nibble: value = d * q + m."""
    block = torch.zeros(1, 20, dtype=torch.uint8, device="cpu")
    block[0, 0:2] = torch.tensor([2.0], dtype=torch.float16, device="cpu").view(torch.uint8)  # d = 2
    block[0, 2:4] = torch.tensor([-1.0], dtype=torch.float16, device="cpu").view(torch.uint8)  # m = -1
    block[0, 4] = 0x93  # element 0 -> 3, element 16 -> 9
    values = quants.dequantize_q4_1(block)
    assert values[0] == 2 * 3 - 1 and values[16] == 2 * 9 - 1
    assert values[1] == -1  # code 0 is the block minimum
    assert torch.equal(kernels.dequantize_blocks(block.to(KDEV), quants.Q4_1).cpu(), values)


@pytest.mark.parametrize("qtype,err", [(quants.Q8_0, 1 / 127), (quants.Q4_1, 1 / 15)])
def test_quantize_round_trip(qtype, err):
    """quantize -> dequantize stays within half a step (plus float16 rounding of the scale)."""
    x = torch.randn(64, 32, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    blocks = quants.quantize_q8_0(x) if qtype == quants.Q8_0 else quants.quantize_q4_1(x)
    back = quants.dequantize(blocks, qtype).reshape(64, 32)
    span = (x.abs().amax(1, keepdim=True) * 2) if qtype == quants.Q8_0 else (x.amax(1, keepdim=True) - x.amin(1, keepdim=True))
    # half a quantization step, plus 1% for the float16 scale and minimum
    assert ((back - x).abs() <= span * err * 0.51 + span * 0.01).all()
    assert torch.equal(bits(kernels.dequantize_blocks(blocks.to(KDEV), qtype)), bits(back.reshape(-1)))


def test_kernel_rejects_bad_input(kdev, off_device):
    raw_cpu = random_blocks(4, quants.Q4_1, 0)
    raw = raw_cpu.to(kdev)
    with pytest.raises(ValueError, match=f"raw must be on {kdev.type}, got {off_device.type}"):
        kernels.dequantize_blocks(raw.to(off_device), quants.Q4_1)
    with pytest.raises(TypeError, match="raw must have dtype uint8"):
        kernels.dequantize_blocks(raw.float(), quants.Q4_1)
    with pytest.raises(ValueError, match="raw must hold whole Q4_1 blocks"):
        kernels.dequantize_blocks(raw.reshape(-1)[:50], quants.Q4_1)
    with pytest.raises(ValueError, match="raw must be contiguous"):
        kernels.dequantize_blocks(raw.t(), quants.Q4_1)
    with pytest.raises(ValueError, match="qtype must be Q8_0"):
        kernels.dequantize_blocks(raw, 2)
    with pytest.raises(ValueError, match="blocks_per_program must be a power of two"):
        kernels.dequantize_blocks(raw, quants.Q4_1, blocks_per_program=3)
    with pytest.raises(ValueError, match="raw holds 50 bytes"):
        quants.dequantize(raw_cpu.reshape(-1)[:50], quants.Q4_1)
    with pytest.raises(NotImplementedError, match="Q8_0 and Q4_1"):
        quants.dequantize(raw_cpu, 12)


def test_dense_types_pass_through():
    x = torch.randn(8, 4, device="cpu")  # plain torch on the CPU (numpy input), no kernel
    assert torch.equal(quants.dequantize(x.numpy(), quants.F32), x)
    h = x.to(torch.float16)
    assert torch.equal(quants.dequantize(h.view(torch.uint8), quants.F16).reshape(8, 4), h.float())
