"""Checkpoints resume on any number of processes, and a save cut off midway is never resumed from.

``examples/sft.py`` (fp32, CPU) trains 5 steps on one process, saving a checkpoint after every step: the
uninterrupted run. Each resume below starts from a checkpoint written by a different number of processes and must
continue that run's loss, gradient norm (rtol 1e-5) and learning rate; two resumed steps at least, since the loss of
the first depends on the weights alone, and only the second shows the optimizer state (a fresh Adam moves differently).
The chain of runs: 1 process -> 2 (from step 2) -> 1 (from step 3); 2 -> a save killed at step 4 -> 3 (from step 3).
"""

from __future__ import annotations

import shutil

import pytest
from _trainer_launch import SFT_FLAGS, SFT_STEPS, SUPPORT, assert_same_steps, logged_steps, run

from hf_odc.trainer.core._checkpoint_format import COMPLETE_MARKER, STATE_DIR, check_resumable, last_complete_checkpoint

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 processes
WORKERS = str(SUPPORT / "_checkpoint_workers.py")


def train(output_dir, *args: str, processes: int, env: dict | None = None, preimported: bool = True) -> str:
    """Run ``tests/support/_checkpoint_workers.py`` (``examples/sft.py``) with a checkpoint after every step and
    planning by token counts (the same plan in every run); return its output. One thread per process: one process
    with several spends most of its time waiting on them when other tests load the CPU. ``preimported``: the ranks
    forked by the test zygote (``_zygote.py``), in the environment ``accelerate launch`` gives them; the killed save
    (:func:`killed`), where the launcher ends the ranks, is launched as a user launches it."""
    batch = str(GLOBAL_BATCH // processes)
    return run(WORKERS, *SFT_FLAGS, "--per_device_train_batch_size", batch, "--output_dir", str(output_dir),
               "--cost_model", "tokens", "--save_strategy", "steps", "--save_steps", "1", *args,
               processes=processes, env={"OMP_NUM_THREADS": "1", **(env or {})}, preimported=preimported)  # fmt: skip


def assert_continues(resumed: dict[int, dict], reference: dict[int, dict], first_step: int) -> None:
    assert_same_steps(resumed, reference, steps=range(first_step, SFT_STEPS + 1), rel=1e-5)
    for step in range(first_step, SFT_STEPS + 1):
        assert resumed[step]["learning_rate"] == pytest.approx(reference[step]["learning_rate"]), f"lr at {step}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The uninterrupted run, on one process."""
    directory = tmp_path_factory.mktemp("single")
    train(directory, processes=1)
    return directory, logged_steps(directory)


@pytest.fixture(scope="module")
def on_two(single, tmp_path_factory):
    """The single process's checkpoint of step 2, resumed on 2 processes."""
    directory = tmp_path_factory.mktemp("on_two")
    output = train(directory, "--resume_from_checkpoint", str(single[0] / "checkpoint-2"), processes=2)
    return directory, logged_steps(directory), output


@pytest.fixture(scope="module")
def killed(on_two, tmp_path_factory):
    """An output directory holding the 2-process checkpoint of step 3, resumed (``True``) on 2 processes with
    ``save_total_limit=1`` and killed when its save of step 4 was about to be marked complete."""
    directory = tmp_path_factory.mktemp("killed")
    shutil.copytree(on_two[0] / "checkpoint-3", directory / "checkpoint-3")
    with pytest.raises(AssertionError, match="exited with"):
        train(directory, "--resume_from_checkpoint", "True", "--save_total_limit", "1", processes=2,
              env={"HF_ODC_TEST_KILL_BEFORE_MARKING": "4"}, preimported=False)  # fmt: skip
    return directory


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two(single, on_two):
    directory, reference = single
    # One process writes what several do: the DCP state (no optimizer.pt), the scheduler, the marker last.
    checkpoint = directory / "checkpoint-2"
    assert (checkpoint / STATE_DIR / ".metadata").is_file() and not (checkpoint / "optimizer.pt").exists()
    marker = f"2\nglobal_batch_size {GLOBAL_BATCH}\n"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / COMPLETE_MARKER).read_text() == marker
    assert_continues(on_two[1], reference, first_step=3)
    # 6 samples per process where the checkpoint's run had 12, the same global minibatch: nothing to warn about
    assert "per_device_train_batch_size" not in on_two[2], on_two[2][-3000:]


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one(single, on_two, tmp_path):
    train(tmp_path, "--resume_from_checkpoint", str(on_two[0] / "checkpoint-3"), processes=1)
    assert_continues(logged_steps(tmp_path), single[1], first_step=4)


@pytest.mark.slow
def test_resume_true_passes_over_a_killed_save_and_resumes_on_three(single, killed, tmp_path):
    directory = tmp_path / "out"
    shutil.copytree(killed, directory)
    partial, previous = directory / "checkpoint-4", directory / "checkpoint-3"
    # Everything of the killed save is on disk but its marker; the rotation (save_total_limit=1) waits for the marker.
    assert (partial / STATE_DIR / ".metadata").is_file() and (partial / "trainer_state.json").is_file()
    assert not (partial / COMPLETE_MARKER).exists() and (previous / COMPLETE_MARKER).exists()
    output = train(directory, "--resume_from_checkpoint", "True", processes=3)
    assert f"passing over ['{partial}']" in output and f"resuming from {previous}" in output
    assert_continues(logged_steps(directory), single[1], first_step=4)
    assert (partial / COMPLETE_MARKER).read_text().startswith("4\n")  # saved again, completely this time


@pytest.mark.slow
def test_resuming_a_killed_save_explicitly_is_refused(killed):
    partial = killed / "checkpoint-4"
    with pytest.raises(AssertionError) as failure:
        train(killed / "unused", "--resume_from_checkpoint", str(partial), processes=1)
    message = str(failure.value)
    assert f"Cannot resume from {partial}: it is not a complete checkpoint (it has no {COMPLETE_MARKER}" in message
    assert "'loss'" not in message, "refused before any step ran"


@pytest.mark.slow
def test_a_damaged_state_file_is_named_with_its_checkpoint(single, tmp_path):
    """A shard file truncated after its save completed is refused before anything is loaded, one corrupted inside
    when DCP fails to read it: either way one error naming the file, the checkpoint and what to do. (Corrupted tensor
    bytes that torch reads without noticing are beyond reach: DCP keeps no checksum it checks on load.)"""
    truncated, corrupted = tmp_path / "truncated", tmp_path / "corrupted"
    for copy in (truncated, corrupted):
        shutil.copytree(single[0] / "checkpoint-2", copy)
    shard = f"{STATE_DIR}/__0_0.distcp"
    with open(truncated / shard, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(ValueError, match=rf"Cannot resume from {truncated}: {shard} is truncated \(\d+ of its \d+ "
                                         r"bytes\)\. .*restore the checkpoint from a good copy"):  # fmt: skip
        check_resumable(str(truncated))
    with open(corrupted / shard, "r+b") as f:
        f.write(bytes(64))  # zeroes over the header of its first item
    with pytest.raises(AssertionError) as failure:
        train(tmp_path / "out", "--resume_from_checkpoint", str(corrupted), processes=1)
    message = str(failure.value)
    assert f"ValueError: Cannot resume from {corrupted}: {shard} is corrupted (its item at byte 0 " in message, message
    assert "The above exception was the direct cause" not in message and "'loss'" not in message


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    """What ``save_only_model=True`` saves: complete, but nothing to resume the optimizer from."""
    (tmp_path / COMPLETE_MARKER).write_text("3\n")
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"lacks {STATE_DIR}/\.metadata \(the model and optimizer state\), "
                                         r"scheduler\.pt .*from_pretrained"):  # fmt: skip
        check_resumable(str(tmp_path))


def test_resume_true_needs_a_complete_checkpoint(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(ValueError, match=r"found no complete checkpoint .*checkpoint-1"):
        last_complete_checkpoint(str(tmp_path))
