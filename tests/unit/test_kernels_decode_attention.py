"""The decoding attention's kernel (``hf_odc.kernels.decode_attention``): one query token per row over a static KV
cache gives SDPA's values at every split of the cache, grouped-query or not, for left-padded and partly filled rows;
it reads no slot the mask does not hold; ``torch.compile`` keeps it whole; and hf_odc's decoding loop, reading the
cache's whole width through it, decodes what transformers' ``generate`` decodes (in ``test_generation_static.py``).

As for the fused kernels, the ``interpreted`` cases run in one pytest subprocess with ``TRITON_INTERPRET=1``
(:func:`test_kernel_under_the_triton_interpreter`), the ``cuda`` ones on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _interpreted import KERNEL_DEVICES, assert_interpreted_cases_pass

from hf_odc.kernels import decode_attention as attention_module
from hf_odc.kernels.decode_attention import decode_attention, kernel_runs

LOOP_TESTS = str(Path(__file__).with_name("test_generation_static.py"))
"""Where the decoding loop's interpreted case lives, beside the loop's other tests."""


def test_kernel_under_the_triton_interpreter():
    assert_interpreted_cases_pass(__file__, LOOP_TESTS)


def _reference(query, key, value, mask, scale):
    """SDPA in float64 with every key/value head repeated for its query heads."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(group, dim=1) for t in (key, value))
    query = query.double()[:, :, None]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None, None], scale=scale)[:, :, 0]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """``out`` is the float64 ``expected`` to float32's precision, or to bf16's rounding for a bf16 ``out``."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2**-7)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def _cache(batch, heads, kv_heads, head_dim, slots, dtype, device, seed=0):
    """A query, and keys and values as a static cache holds them: a slice of a longer buffer (strided)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, head_dim, generator=g)
    buffer = torch.randn(2, batch, kv_heads, slots + 7, head_dim, generator=g)
    query, buffer = query.to(device, dtype), buffer.to(device, dtype)
    return query, buffer[0, :, :, :slots], buffer[1, :, :, :slots]


def _left_padded(batch, slots, device):
    """Row ``b`` holds slots from ``3 b`` (its prompt's padding before) to a fill that differs per row; the last
    row holds a single slot."""
    mask = torch.zeros(batch, slots, dtype=torch.bool)
    for row in range(batch):
        mask[row, 3 * row : slots - (row * 29) % (slots // 2)] = True
    mask[-1] = False
    mask[-1, slots // 3] = True
    return mask.to(device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "head_dim", "slots"),
    [(3, 6, 2, 64, 150), (2, 7, 1, 80, 70), (2, 4, 4, 32, 200), (5, 12, 2, 128, 300), (1, 28, 4, 128, 1000)],
    ids=["gqa", "odd-group-and-head", "mha", "qwen2.5-1.5b", "qwen2.5-7b-long"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_gives_sdpa_values(device, batch, heads, kv_heads, head_dim, slots, dtype):
    """Every row's output is SDPA's over the slots its mask holds (fp32 closely; bf16 to its rounding)."""
    assert kernel_runs(torch.device(device), head_dim)
    query, key, value = _cache(batch, heads, kv_heads, head_dim, slots, dtype, device)
    mask = _left_padded(batch, slots, device)
    out = decode_attention(query, key, value, mask, 0.7 * head_dim**-0.5)
    expected = _reference(query, key, value, mask, 0.7 * head_dim**-0.5)
    assert out.shape == query.shape and out.dtype == dtype
    _close(out, expected)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_every_split_of_the_cache_gives_the_same_values(device, splits, monkeypatch):
    """One split, a few, or more splits than blocks (most of them holding nothing): the combined softmax is the same."""
    from hf_odc.kernels import _triton_decode

    monkeypatch.setattr(_triton_decode, "_splits", lambda programs, blocks, device: splits)
    query, key, value = _cache(2, 6, 2, 64, 333, torch.float32, device, seed=1)
    mask = _left_padded(2, 333, device)
    _close(decode_attention(query, key, value, mask, 0.125), _reference(query, key, value, mask, 0.125))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_kernel_reads_no_slot_the_mask_does_not_hold(device):
    """NaN keys and values wherever the mask holds nothing (whole blocks and slots beside held ones): had the kernel
    read one, the output would be NaN (as SDPA's is), so a finite output equal to SDPA's over the held slots alone
    shows it read none."""
    query, key, value = _cache(3, 6, 2, 64, 400, torch.float32, device, seed=2)
    mask = _left_padded(3, 400, device)
    expected = _reference(query, key, value, mask, 0.125)
    unheld = ~mask[:, None, :, None]
    key, value = key.masked_fill(unheld, float("nan")), value.masked_fill(unheld, float("nan"))
    out = decode_attention(query, key, value, mask, 0.125)
    assert torch.isfinite(out).all()
    _close(out, expected)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_row_holding_no_slot_gives_zeros(device):
    query, key, value = _cache(2, 4, 2, 32, 90, torch.float32, device)
    mask = torch.ones(2, 90, dtype=torch.bool, device=device)
    mask[1] = False
    out = decode_attention(query, key, value, mask, 0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _close(out[0], _reference(query, key, value, mask, 0.2)[0])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compile_keeps_the_kernel_whole(device):
    """A compiled caller (``fullgraph``) runs the registered operator and gets the eager values."""
    query, key, value = _cache(2, 6, 2, 64, 130, torch.float32, device)
    mask = _left_padded(2, 130, device)
    compiled = torch.compile(decode_attention, backend="aot_eager", fullgraph=True)
    expected = decode_attention(query, key, value, mask, 0.125)
    torch.testing.assert_close(compiled(query, key, value, mask, 0.125), expected)


def test_switched_off_or_on_a_plain_cpu_it_is_grouped_sdpa(monkeypatch):
    """Without the kernel (here a CPU without the interpreter, or :data:`KERNEL` off) the values are SDPA's too."""
    monkeypatch.setattr(attention_module, "KERNEL", False)
    assert not kernel_runs(torch.device("cpu"), 64) and not kernel_runs(torch.device("cuda"), 64)
    query, key, value = _cache(3, 6, 2, 64, 150, torch.float32, "cpu")
    mask = _left_padded(3, 150, "cpu")
    _close(decode_attention(query, key, value, mask, 0.125), _reference(query, key, value, mask, 0.125))
