"""``packed_causal_attention``: each document of a packed row attended on its own, exactly, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

import hf_odc.kernels.attention as kernels
from hf_odc.kernels.attention import (
    ALONE_FROM,
    Piece,
    attention_pieces,
    packed_causal_attention,
    sdpa_length,
    varlen_available,
)

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
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_sdpa_and_auto_equal_each_document_alone_forward_and_backward(lengths, heads, backend):
    """On CPU (and in float64 anywhere) ``auto`` is per-document SDPA."""
    q, k, v = _inputs(sum(lengths), *heads, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, lengths, scale=0.3, backend=backend)
    expected = _reference(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_documents_padded_to_few_lengths_attend_exactly_as_alone(monkeypatch):
    """On a GPU each SDPA document is attended at a rounded length (cuDNN plans each new length once): the result and
    the gradients of the document's own tokens are those of the document alone, and the lengths SDPA meets are the
    rounded ones. Forced here on the CPU."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    seen = []
    real = kernels.F.scaled_dot_product_attention

    def sdpa(query, *args, **kwargs):
        seen.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", sdpa)
    lengths = (17, 1, 30, 70)
    q, k, v = _inputs(sum(lengths), 4, 2, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, lengths, scale=0.3, backend="sdpa")
    assert seen == [64, 64, 64, 128]
    expected = _reference(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_warming_attends_every_rounded_length_once_forward_and_backward(monkeypatch):
    """``warm_sdpa_plans`` runs SDPA at each length documents of ``shortest``..``longest`` tokens are attended at
    (a padded document each, grouped-query, the model's scale), once, and backpropagates it. Forced on the CPU."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    calls, backwards = [], []
    real = kernels.F.scaled_dot_product_attention

    def sdpa(query, key, value, **kwargs):
        calls.append((query.shape[1:], key.shape[1], kwargs["scale"], kwargs["enable_gqa"]))
        out = real(query, key, value, **kwargs)
        out.register_hook(lambda grad: backwards.append(grad.shape[2]))
        return out

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", sdpa)
    lengths = kernels.warm_sdpa_plans(4, 2, 8, 300, torch.device("cpu"), torch.float32, shortest=64)
    assert lengths == [64, 128, 192, 256, 320] == sorted({sdpa_length(n) for n in range(64, 301)})
    assert calls == [((4, n, 8), 2, 8**-0.5, True) for n in lengths]
    assert backwards == lengths


def test_warming_forward_only_attends_each_length_without_autograd(monkeypatch):
    """``backward=False``: the plan a forward-only pass needs (cuDNN keys it apart: no softmax statistics are
    returned), so each length is attended with autograd off and nothing requiring a gradient, and not backpropagated."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    calls = []
    real = kernels.F.scaled_dot_product_attention

    def sdpa(query, key, value, **kwargs):
        calls.append((query.shape[2], torch.is_grad_enabled(), query.requires_grad or key.requires_grad))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", sdpa)
    lengths = kernels.warm_sdpa_plans(4, 2, 8, 300, torch.device("cpu"), torch.float32, 64, backward=False)
    assert lengths == [64, 128, 192, 256, 320] and calls == [(n, False, False) for n in lengths]


def test_warming_draws_nothing_from_the_random_generators(monkeypatch):
    """Warming with it on or off must not change a run: nothing is drawn from the generator that sampling (GRPO's and
    RLOO's completions, dropout) draws from afterwards."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    torch.manual_seed(3)
    before = torch.get_rng_state()
    kernels.warm_sdpa_plans(4, 2, 8, 300, torch.device("cpu"), torch.float32, 64)
    kernels.warm_sdpa_plans(4, 2, 8, 300, torch.device("cpu"), torch.float32, 64, backward=False)
    assert torch.equal(torch.get_rng_state(), before)


def test_warming_for_documents_attends_only_their_rounded_lengths(monkeypatch):
    """``documents=``: the lengths those documents are attended at, each once, not every length up to the longest;
    documents shorter than ``shortest`` (attended in runs, not alone) warm nothing."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    seen = []
    real = kernels.F.scaled_dot_product_attention

    def sdpa(query, key, value, **kwargs):
        seen.append(query.shape[2])
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", sdpa)
    documents = [70, 65, 300, 10, 129, 300]
    lengths = kernels.warm_sdpa_plans(4, 2, 8, 300, torch.device("cpu"), torch.float32, 64, documents)
    assert lengths == seen == [128, 192, 320] == sorted({sdpa_length(n) for n in documents if n >= 64})


def test_warming_by_default_covers_a_short_document_attended_alone(monkeypatch):
    """By default every document's length is warmed, the shortest too: ``"auto"`` attends a short document alone
    where no other short one is beside it (a short reply between two long sequences), and a length met first inside a
    minibatch is planned there while the other ranks wait."""
    monkeypatch.setattr(kernels, "_PADDED_ON", ("cpu",))
    row = [3000, 100, 3000]
    assert [piece.lengths for piece in kernels.attention_pieces(row)] == [(3000,), (100,), (3000,)]
    lengths = kernels.warm_sdpa_plans(4, 2, 8, 3000, torch.device("cpu"), torch.float32, documents=row)
    assert lengths == [sdpa_length(100), sdpa_length(3000)]


def test_sdpa_lengths_are_few_and_close():
    """Up to 64K tokens: under 200 lengths in all, each less than 64 tokens or 1/32 above the document's."""
    rounded = [sdpa_length(n) for n in range(1, 65537)]
    assert len(set(rounded)) < 200
    assert all(n <= m < n + max(64, n // 32) for n, m in zip(range(1, 65537), rounded, strict=True))
    assert sdpa_length(2049) == 2112 and sdpa_length(65536) == 65536


def test_auto_attends_long_documents_alone_and_runs_of_short_ones_in_one_launch():
    n = ALONE_FROM
    lengths = (n, 5, 7, n + 1, 3, n, n, 9, 1, 1)
    pieces = attention_pieces(lengths)
    assert [(p.lengths, p.varlen) for p in pieces] == [
        ((n,), False), ((5, 7), True), ((n + 1,), False), ((3,), False), ((n,), False), ((n,), False),
        ((9, 1, 1), True),
    ]  # fmt: skip
    assert all(p.tokens == sum(p.lengths) for p in pieces)
    assert attention_pieces((n - 1,) * 64) == (Piece((n - 1,) * 64, 64 * (n - 1), True),)
    assert attention_pieces(lengths, "varlen") == (Piece(lengths, sum(lengths), True),)
    assert attention_pieces(lengths, "sdpa") == tuple(Piece((m,), m, False) for m in lengths)


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

CUDA_SPLITS = [(4096,), (2048, 1024, 512, 512), (256,) * 16, (1, 3000, 7, 1088), (3000, 100, 300, 2048, 1, 64, 64, 511)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", CUDA_SPLITS, ids=lambda s: f"{len(s)}docs")
@pytest.mark.parametrize("heads", [(12, 2), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "auto"])
def test_cuda_backends_equal_each_document_alone(lengths, heads, backend, monkeypatch):
    """bf16, 128-dim heads (the 1.5B model's 12 query / 2 key-value heads, and plain multi-head): forward and
    backward within bf16 rounding of a float64 reference, and as close to it as running each document alone
    through SDPA; ``varlen_attn`` launched once per varlen piece of the row, K/V never repeated."""
    q, k, v = _inputs(sum(lengths), *heads, 128, device="cuda", dtype=torch.bfloat16)
    assert varlen_available(q, k), "torch >= 2.11 on CUDA runs varlen_attn"
    launches = []

    def varlen_attn(query, key, *args, **kwargs):
        launches.append(key.shape[1])
        return real(query, key, *args, **kwargs)

    real = kernels._varlen_attn
    monkeypatch.setattr(kernels, "_varlen_attn", varlen_attn)
    out = packed_causal_attention(q, k, v, lengths, backend=backend)
    assert launches == [heads[1]] * sum(p.varlen for p in attention_pieces(lengths, backend))
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
