"""Bad inputs to the example scripts, run as a user runs them (issue #35): each ends the run with one line from the
first process naming the input, what is wrong and what to do, no traceback, and a non-zero exit status; the other
process exits quietly.

Every input is checked while the command line is parsed, before the training config joins the process group and
before any model is built (:meth:`hf_odc.demo.ExampleParser.check_inputs`), so most cases take an interpreter's start;
data that truncation leaves with nothing to learn from is refused by the trainer, once it has tokenized it. The cases
whose path differs on two processes (an input check, a trainer's refusal after the process group started, the
Accelerate config) run on two; the others on one, where they take the same path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _bad_inputs import data_file, empty_saved_dataset, model_without_tokenizer, offload_config, truncated_scheduler
from _machine import Concurrently
from _trainer_launch import launch

WORKER_FRAME = re.compile(r'File ".*(hf_odc|examples|trl|transformers|datasets|huggingface_hub)/')
"""A worker's traceback frame (under ``accelerate launch``, the launcher's own report is torch's and Accelerate's)."""


# (id, script, processes, flags or a function of tmp_path making them, the error line's text)
CASES = [
    ("missing data file", "sft.py", 2, ["--dataset_name", "/nonexistent/chats.jsonl"],
     "--dataset_name /nonexistent/chats.jsonl: no such file or directory"),
    ("truncated scheduler.pt", "sft.py", 2, truncated_scheduler,
     "scheduler.pt is not a sound torch.save archive (truncated or corrupted)"),
    ("max_length drops every pair", "dpo.py", 2, ["--max_length", "4", "--num_pairs", "32"],
     "max_length=4 leaves 32 of the 32 preference pairs with nothing to prefer"),
    ("CPU offload", "sft.py", 2, [], "fsdp_offload_params: true in the Accelerate config"),
    ("JSONL of one blank line", "sft.py", 1, data_file("blank.jsonl", "\n"), "the file is empty"),
    ("JSON []", "sft.py", 1, data_file("empty.json", "[]"), "it holds no rows"),
    ("empty save_to_disk", "sft.py", 1, empty_saved_dataset, "the saved dataset holds no rows"),
    ("model path that does not exist", "dpo.py", 1, ["--model_name_or_path", "/nonexistent/model"],
     "--model_name_or_path /nonexistent/model: no such directory"),
    ("Hub name offline", "grpo.py", 1, ["--model_name_or_path", "hf-odc-tests/not-cached"],
     "the Hub model is not in the cache"),
    ("model without tokenizer", "sft.py", 1, model_without_tokenizer,
     "the directory holds no tokenizer (tokenizer.json or tokenizer_config.json)"),
    ("max_length drops every sample", "sft.py", 1,
     ["--max_length", "4", "--assistant_only_loss", "true", "--num_samples", "32"],
     "max_length=4 cuts 32 of the 32 training samples: 32 lose every token carrying a loss"),
    ("flag prefix", "sft.py", 1, ["--max_step", "3"], "unrecognized arguments: --max_step 3"),
]  # fmt: skip


def _launch(
    background: Concurrently, directory: Path, script: str, processes: int, flags, says: str
) -> tuple[int, str]:
    """A case's launch in its own ``directory``: the exit status and the output."""
    flags = flags(directory) if callable(flags) else flags
    config = offload_config(directory) if says.startswith("fsdp_offload_params") else None
    if "--output_dir" not in flags:
        flags = [*flags, "--output_dir", str(directory / "out")]
    env = {"HF_HUB_OFFLINE": "1"}  # never the network, whatever the case
    return launch(script, *flags, processes=processes, env=env, timeout=120, config=config, background=background)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every selected case's launch, two at a time while the tests go on (:class:`~_machine.Concurrently`): most
    cases are one process that stops once its command line is parsed, which leaves the other core idle."""
    jobs = {"test_a_bad_input_ends_the_run_in_one_line_from_the_first_process": _launch}
    with Concurrently.of_tests(request, tmp_path_factory, jobs) as launches:
        yield launches


@pytest.mark.slow
@pytest.mark.parametrize(("script", "processes", "flags", "says"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_a_bad_input_ends_the_run_in_one_line_from_the_first_process(request, launched, script, processes, flags, says):
    returncode, output = launched.result(request.node.nodeid)
    errors = [line for line in output.splitlines() if ": error: " in line]
    assert returncode != 0, output[-4000:]
    assert len(errors) == 1 and errors[0].startswith(f"{script}: error: ") and says in errors[0], output[-4000:]
    assert not [line for line in output.splitlines() if WORKER_FRAME.search(line)], output[-4000:]
    if processes > 1:  # the launcher exits 1; torchrun's report gives the worker's own status (docs/troubleshooting.md)
        assert re.search(r"exitcode\s*:\s*2\b", output), output[-4000:]
