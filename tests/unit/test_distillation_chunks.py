"""``ODCDistillationTrainer``'s divergence in token chunks (``chunked_generalized_jsd``): the same values, entropies and
gradients as the whole microbatch's at once, for chunk sizes that divide the token count and that do not, with masked
tokens; and its memory bound: no float ``[tokens, vocab]`` tensor of more than a chunk's rows is made, forward or
backward, but the student logits' gradient; and the chunk size's refusals."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hf_odc.trainer import ODCDistillationConfig
from hf_odc.trainer.online.distillation_trainer import chunked_generalized_jsd, generalized_jsd

TOKENS, VOCAB = 12, 50


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = (3 * torch.randn(TOKENS, VOCAB, generator=generator)).requires_grad_()
    teacher = 3 * torch.randn(TOKENS, VOCAB, generator=generator)
    mask = (torch.rand(TOKENS, generator=generator) > 0.3).float()
    mask[-1] = 0.0  # the last chunk's last token masked
    return student, teacher, mask


def _whole(student, teacher, beta, temperature):
    """The unchunked formula the trainer computed before: both log-softmaxes over every token at once."""
    student_logps = torch.log_softmax(student.float() / temperature, dim=-1)
    teacher_logps = torch.log_softmax(teacher.float() / temperature, dim=-1)
    entropy = -(student_logps.exp() * student_logps).sum(-1)
    return generalized_jsd(student_logps, teacher_logps, beta), entropy.detach()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_chunked_divergence_equals_the_whole_microbatchs_values_and_gradients(beta):
    student, teacher, mask = _logits(seed=int(beta * 10))
    temperature = 0.7
    expected, expected_entropy = _whole(student, teacher, beta, temperature)
    (expected_grad,) = torch.autograd.grad((expected * mask).sum() / mask.sum(), student)
    for chunk_size in (1, 4, 5, 7, TOKENS, 100):  # dividing 12 or not, one chunk, larger than the microbatch
        divergence, entropy = chunked_generalized_jsd(student, teacher, beta, temperature, chunk_size)
        (grad,) = torch.autograd.grad((divergence * mask).sum() / mask.sum(), student)
        torch.testing.assert_close(divergence, expected, rtol=1e-5, atol=1e-6, msg=f"chunk {chunk_size}")
        torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-6, msg=f"chunk {chunk_size}")
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7, msg=f"chunk {chunk_size}")
        assert not entropy.requires_grad


class _VocabTensors(TorchDispatchMode):
    """Every new tensor (views of others left out) an operator returns whose last dimension is the vocabulary:
    (operator, rows)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in _pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[-1] == VOCAB:
                self.made.append((func.overloadpacket.__name__, tensor.shape[0]))
        return out


def _vocab_tensors(chunk_size: int) -> list[tuple[str, int]]:
    student, teacher, mask = _logits(seed=1)
    with _VocabTensors() as recorder:
        divergence, _ = chunked_generalized_jsd(student, teacher, 0.5, 0.7, chunk_size)
        (divergence * mask).sum().backward()
    assert student.grad is not None
    return recorder.made


def test_no_vocabulary_wide_tensor_beyond_a_chunk_is_made_but_the_logits_gradient():
    """Forward and backward, at a chunk of 5 of 12 tokens: every ``[*, vocab]`` tensor made has at most 5 rows, but
    one: the student logits' gradient (the size of the logits the model gave, in their dtype)."""
    made = _vocab_tensors(chunk_size=5)
    assert made  # the recorder sees the chunks' tensors
    assert max(rows for _, rows in made if rows <= 5) == 5
    assert [(op, rows) for op, rows in made if rows > 5] == [("empty_like", TOKENS)]
    whole = _vocab_tensors(chunk_size=TOKENS)  # the check detects a whole-microbatch computation
    assert sum(rows == TOKENS for _, rows in whole) > 1


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_a_bad_chunk_size_is_refused_in_one_line(tmp_path, value, error):
    with pytest.raises(error, match="divergence_chunk_size") as raised:
        ODCDistillationConfig(str(tmp_path), divergence_chunk_size=value, report_to="none", use_cpu=True)
    assert "\n" not in str(raised.value)
