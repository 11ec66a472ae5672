"""``packed_causal_attention``: each document of a packed row attended on its own, exactly, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

from hf_odc.kernels.attention import packed_causal_attention, varlen_available

SPLITS = [(40,), (17, 1, 30, 16), (5,) * 12, (1, 1, 62)]


def _reference(query, key, value, lengths, scale=None):
    """Each document alone, in float64, written out: softmax(q k^T * scale + causal) v, K/V heads repeated."""
    q, k, v = (t.double() for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outputs, start = [], 0
    for n in lengths:
        qi, ki, vi = (t[start : start + n].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        scores = qi @ ki.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1).to(scores.device), float("-inf"))
        outputs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        start += n
    return torch.cat(outputs)


def _inputs(tokens, heads=4, kv_heads=2, dim=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(tokens, h, dim, device=device, dtype=dtype, generator=g).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]


@pytest.mark.parametrize("lengths", SPLITS, ids=lambda s: f"{len(s)}docs")
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_sdpa_backend_equals_each_document_alone_forward_and_backward(lengths, heads):
    q, k, v = _inputs(sum(lengths), *heads, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, lengths, scale=0.3, backend="sdpa")
    expected = _reference(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_bad_input_is_refused_with_what_to_change():
    q, k, v = _inputs(10)
    with pytest.raises(ValueError, match="sum to the row's 10 tokens"):
        packed_causal_attention(q, k, v, (4, 5))
    with pytest.raises(ValueError, match="backend must be one of"):
        packed_causal_attention(q, k, v, (10,), backend="dense")
    if not varlen_available(q, k):
        with pytest.raises(ValueError, match="use backend='sdpa'"):
            packed_causal_attention(q, k, v, (10,), backend="varlen")
    with pytest.raises(ValueError, match="cannot share"):
        packed_causal_attention(*_inputs(10, heads=3, kv_heads=2), (10,))


# -- CUDA ---------------------------------------------------------------------------------------------------------

CUDA_SPLITS = [(4096,), (2048, 1024, 512, 512), (256,) * 16, (1, 3000, 7, 1088)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", CUDA_SPLITS, ids=lambda s: f"{len(s)}docs")
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_cuda_backends_equal_each_document_alone(lengths, backend):
    """bf16, the 1.5B model's head layout (12 query heads, 2 key/value heads, 128 dims): forward and backward within
    bf16 rounding of a float64 reference, and as close to it as running each document alone through sdpa."""
    q, k, v = _inputs(sum(lengths), 12, 2, 128, device="cuda", dtype=torch.bfloat16)
    if backend == "varlen" and not varlen_available(q, k):
        pytest.skip("this torch has no varlen_attn for these inputs")
    out = packed_causal_attention(q, k, v, lengths, backend=backend)
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    expected = _reference(q, k, v, lengths)
    want = (expected, *torch.autograd.grad(expected, (q, k, v), grad.double()))
    alone = [
        packed_causal_attention(*(t[s : s + n] for t in (q, k, v)), (n,), backend="sdpa") for s, n in _starts(lengths)
    ]
    alone_out = torch.cat(alone)
    alone_error = ((alone_out.double() - expected).norm() / expected.norm()).item()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < 1e-2, (name, error)
    assert ((out.double() - expected).norm() / expected.norm()).item() <= 1.5 * alone_error + 1e-3


def _starts(lengths):
    start = 0
    for n in lengths:
        yield start, n
        start += n
