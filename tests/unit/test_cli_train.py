"""``hf-odc sft|dpo|grpo|rloo|kto|reward|distill`` and ``hf-odc env`` (issue #49).

A bad input ends the command in the launching process, with one line on standard error and exit status 2, before any
worker starts: these run ``hf_odc.cli.main`` in this process with the launch replaced by a recorder, which must stay
empty (:data:`BAD_INPUTS`: the earlier trials' inputs the command line names, and the new ones). Good inputs reach the
launch with what the workers need (the launch options, a recipe's launch keys, an Accelerate config's ODC keys).

The slow tests share one pool of launches (:func:`runs`), two at a time: README's first command (``hf-odc sft``, its
defaults, from a fresh folder), each other command on 2 CPU processes for two steps with the built-in tiny model and
data (one through a recipe, one through an Accelerate config holding an ODC key), which are also the tests of the
examples as they run by default (``examples/dpo.py`` and its siblings: ``hf-odc dpo`` is ``accelerate launch`` of it
with ``examples/odc_cpu.yaml``), and a refusal of the tokenized data (KTO's: an example longer than a microbatch): one
line, exit status 2, no worker started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import yaml
from _bad_inputs import (
    accelerate_config,
    data_file,
    empty_saved_dataset,
    model_without_tokenizer,
    moe_config_without_router_coefficient,
    offload_config,
    truncated_scheduler,
)
from _machine import run_process, scaled
from _slow import require_slow
from _trainer_launch import ROOT, logged_steps

from hf_odc.cli import launch as launching
from hf_odc.cli import main, train
from hf_odc.demo.script import LAUNCH_KEYS

HF_ODC = shutil.which("hf-odc", path=str(Path(sys.executable).parent)) or shutil.which("hf-odc")
UNPAIRED = json.dumps({"prompt": "w1 w2", "completion": "w2 w1", "label": True})


def _accelerate_flags(change):
    return lambda tmp_path: ["--accelerate_config", str(accelerate_config(tmp_path, change))]


def _with(flags, *more: str):
    return lambda tmp_path: [*flags(tmp_path), *more]


LONG_TEXT = json.dumps({"text": "w1 w2"}) + "\n" + json.dumps({"text": " ".join(f"w{i}" for i in range(30))}) + "\n"


def _example(prompt: str, completion: str, label: bool) -> str:
    return json.dumps({"prompt": prompt, "completion": f" {completion}", "label": label}) + "\n"


WORDS = " ".join(f"w{i}" for i in range(1, 21))
KL_EXAMPLES = "".join(
    _example(*example)
    for example in ((WORDS, "w1", True), ("w2", "w2", False), ("w3", "w3", True), ("w4", WORDS, False))
)
"""Four KTO examples, the first with a long prompt and the last with a long completion: in global batches of 2 (one
process) the long completion is the third example's mismatched one (its longest example: 44 tokens); in one global
batch of 4 (two processes) the first example's (63 tokens)."""

LONG_PAIRS = "".join(
    json.dumps({"chosen": text, "rejected": f"{text} w1"}) + "\n" for text in ("w1", WORDS, WORDS, WORDS)
)
"""Four preference pairs, three of them longer than 16 tokens."""


def _recipe(text: str):
    def make(tmp_path: Path) -> list[str]:
        (tmp_path / "recipe.yaml").write_text(text)
        return ["--config", str(tmp_path / "recipe.yaml")]

    return make


# (id, command, flags or a function of tmp_path making them, what the error line says)
BAD_INPUTS = [
    ("flag prefix", "sft", ["--max_step", "3"], "unrecognized arguments: --max_step 3"),
    ("unparsable flag", "sft", ["--max_steps", "x"], "invalid int value: 'x'"),
    ("flags that contradict", "sft", ["--odc", "false", "--balance", "lb-mini"], "balance='lb-mini'"),
    ("both token caps", "dpo", ["--max_tokens_per_microbatch", "64", "--packing_ratio", "1"], "not both"),
    ("calibration file missing", "sft", ["--calibration_file", "/nonexistent/c.json"], "no such file"),
    ("no processes", "kto", ["--num_processes", "0"], "--num-processes: expected a positive integer, got 0"),
    ("global minibatch on 3 processes", "dpo", ["--num_processes", "3"],
     "--global_batch_size 16 is not a positive multiple of the number of processes (3)"),
    ("missing data file", "sft", ["--dataset_name", "/nonexistent/chats.jsonl"],
     "--dataset_name /nonexistent/chats.jsonl: no such file or directory"),
    ("JSONL of one blank line", "sft", data_file("blank.jsonl", "\n"), "the file is empty"),
    ("JSON []", "sft", data_file("empty.json", "[]"), "it holds no rows"),
    ("empty save_to_disk", "sft", empty_saved_dataset, "the saved dataset holds no rows"),
    ("columns SFT cannot train on", "sft", data_file("c.jsonl", '{"conversation": []}'), "its columns are"),
    ("unpaired data for DPO", "dpo", data_file("u.jsonl", UNPAIRED), "DPO needs preference pairs"),
    ("data for a built-in-only script", "rloo", data_file("u.jsonl", UNPAIRED), "trains on its built-in data only"),
    ("model path that does not exist", "dpo", ["--model_name_or_path", "/nonexistent/model"], "no such directory"),
    ("Hub name offline", "grpo", ["--model_name_or_path", "hf-odc-tests/not-cached"],
     "the Hub model is not in the cache"),
    ("model without tokenizer", "sft", model_without_tokenizer, "holds no tokenizer"),
    ("MoE config.json with a null router coefficient", "sft", moe_config_without_router_coefficient("--model_config"),
     "transformers refuses its config.json: Validation error for field 'router_aux_loss_coef'"),
    ("MoE model folder with a null router coefficient", "kto",
     moe_config_without_router_coefficient("--model_name_or_path"), "field 'router_aux_loss_coef'"),
    ("model config that does not exist", "reward", ["--model_config", "/nonexistent/config.json"],
     "no such file or directory; name one of tiny"),
    ("truncated scheduler.pt", "sft", truncated_scheduler, "scheduler.pt is not a sound torch.save archive"),
    ("recipe that does not exist", "sft", ["--config", "/nonexistent/recipe.yaml"], "no such file or directory"),
    ("recipe that is not YAML", "grpo", _recipe("max_steps: [1\n"), "not valid YAML"),
    ("recipe with an unknown key", "sft", _recipe("max_steps: 1\nmax_stepz: 3\n"), "no flag takes the key max_stepz"),
    ("Accelerate config that does not exist", "sft", ["--accelerate_config", "/nonexistent/a.yaml"],
     "no such file, nor a config hf_odc ships (odc, odc_cpu)"),
    ("CPU offload in the Accelerate config", "sft", lambda path: ["--accelerate_config", str(offload_config(path))],
     "fsdp_offload_params: true in the Accelerate config (FSDP_OFFLOAD_PARAMS) asks for FSDP's CPU offload"),
    ("unknown ODC key in the Accelerate config", "sft", _accelerate_flags(lambda text: text + "odc_timout: 5\n"),
     "unknown ODC key odc_timout; the ODC keys an Accelerate config takes are odc, odc_timeout"),
    ("bad ODC value in the Accelerate config", "dpo", _accelerate_flags(lambda text: text + "odc_timeout: -1\n"),
     "odc_timeout must be positive and finite"),
    ("unknown key in the Accelerate config", "sft", _accelerate_flags(lambda text: text + "bogus: 1\n"),
     "Accelerate refuses it: The config file at"),
    # the trainers' own checks of their tokenized data (ODCSFTTrainer, ODCDPOTrainer, ODCRewardTrainer:
    # check_train_dataset)
    ("sample longer than a microbatch", "sft", ["--max_tokens_per_microbatch", "32"],
     "Sample 443 of the training dataset has 249 tokens, more than one microbatch holds (32 tokens, from "
     "max_tokens_per_microbatch=32)"),
    ("local sample longer than a microbatch", "sft", _with(data_file("long.jsonl", LONG_TEXT), "--max_length", "64",
     "--max_tokens_per_microbatch", "16"), "Sample 1 of the training dataset has 31 tokens, more than one microbatch"),
    ("pair longer than a microbatch", "dpo", ["--max_tokens_per_microbatch", "16"],
     "The training dataset's longest pair has 194 tokens"),
    ("reward pair longer than a microbatch", "reward", ["--max_tokens_per_microbatch", "16"],
     "The training dataset's longest pair has"),
    ("truncation that cuts most samples", "sft", ["--max_length", "4"],
     "max_length=4 cuts 512 of the 512 training samples: 512 train on their first 4 tokens only. Raise --max_length "
     "to fit most samples whole. Or pass --allow_truncated_data true to train on what is left anyway."),
    ("truncation that leaves no assistant turn", "sft", ["--assistant_only_loss", "true", "--max_length", "4"],
     "max_length=4 cuts 512 of the 512 training samples: 512 lose every token carrying a loss (their completion) and "
     "TRL drops them. Raise --max_length to fit most samples whole. Nothing is left to train on, so the run is "
     "refused."),
    ("truncation that leaves most pairs nothing to prefer", "dpo", ["--max_length", "8"],
     "max_length=8 leaves 417 of the 512 preference pairs with nothing to prefer: 417 lost a whole reply"),
    ("example longer than a microbatch", "kto", ["--max_tokens_per_microbatch", "16"],
     "tokens (it and its mismatched KL completion stay in one microbatch), more than one microbatch holds (16 "
     "tokens). Set --max_tokens_per_microbatch to at least"),
    ("mismatched completion from another process's examples", "kto", _with(data_file("kl.jsonl", KL_EXAMPLES),
     "--per_device_train_batch_size", "2", "--max_tokens_per_microbatch", "50", "--num_processes", "2"),
     "The training dataset's longest example has 63 tokens (it and its mismatched KL completion"),
    ("example longer than a microbatch, without the KL estimate", "kto", ["--max_tokens_per_microbatch", "16",
     "--loss_type", "apo_zero_unpaired"], "tokens, more than one microbatch holds (16 tokens). Set --max_tokens_per_"),
    ("max_length that drops most reward pairs", "reward", _with(data_file("long.jsonl", LONG_PAIRS), "--max_length",
     "16"), "max_length=16 drops 3 of the 4 preference pairs: TRL's reward trainer drops a pair whose chosen or "
     "rejected sequence is longer. Raise --max_length to keep most pairs. Or pass --allow_truncated_data true"),
    ("max_length that drops every reward pair", "reward", ["--max_length", "2"],
     "max_length=2 drops 512 of the 512 preference pairs: TRL's reward trainer drops a pair whose chosen or rejected "
     "sequence is longer. Raise --max_length to keep most pairs. Nothing is left to train on, so the run is refused."),
]  # fmt: skip
if importlib.util.find_spec("vllm") is None:
    BAD_INPUTS.append(("--use_vllm without vLLM", "grpo", ["--use_vllm", "true"], "vLLM is not installed"))


@pytest.fixture
def launched(monkeypatch):
    """``hf_odc.cli.main`` in this process, its launch replaced by a recorder (what it was asked to launch), with the
    variables it sets restored after."""
    calls = []
    monkeypatch.setattr(train, "launch", lambda *args: calls.append(SimpleNamespace(args=args)) or 0)
    for name in ("HF_ODC_PROG", "HF_ODC_ENABLED", "HF_ODC_TIMEOUT", "HF_ODC_TRANSPORT", "HF_ODC_SHARD_SIZE", "RANK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never the network
    return calls


@pytest.mark.parametrize(("command", "flags", "says"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])  # fmt: skip
def test_a_bad_input_is_one_line_and_status_2_before_any_worker_starts(tmp_path, capsys, launched, command, flags,
                                                                        says):  # fmt: skip
    flags = flags(tmp_path) if callable(flags) else flags
    capsys.readouterr()  # what making the input printed (datasets' progress bars)
    with pytest.raises(SystemExit) as ended:
        main([command, *flags, "--output_dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert ended.value.code == 2 and launched == [], captured
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"hf-odc {command}: error: "), captured.err
    assert says in captured.err, captured.err


def test_the_launch_gets_the_options_a_recipe_and_an_accelerate_config_give(tmp_path, launched):
    """A recipe's launch keys (TRL's recipes may hold them) set the launch where the command line does not, and the
    script passes over them; an Accelerate config's ODC keys reach the workers as their ``HF_ODC_*`` variables, and
    Accelerate reads the config without them. TRL's name ``distillation`` is ``distill``."""
    import os

    config = accelerate_config(tmp_path, lambda text: text + "odc_timeout: 123\nodc: true\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"num_processes: 4\naccelerate_config: {config}\nmax_steps: 1\n")
    assert main(["distillation", "--config", str(recipe), "--output_dir", str(tmp_path / "out")]) == 0
    ((program, script, script_args, accelerate, options),) = [call.args for call in launched]
    assert (program, script.name, options.num_processes) == ("hf-odc distill", "distill.py", 4)
    assert script_args == ["--config", str(recipe), "--output_dir", str(tmp_path / "out")]
    assert accelerate.odc_variables == {"HF_ODC_TIMEOUT": "123.0", "HF_ODC_ENABLED": "true"}
    assert os.environ["HF_ODC_TIMEOUT"] == "123.0" and os.environ["HF_ODC_PROG"] == "hf-odc distill"
    with accelerate.file_for_accelerate() as file:
        read = yaml.safe_load(file.read_text())
    assert "odc_timeout" not in read and read["num_processes"] == 2 and read["distributed_type"] == "FSDP"
    assert main(["sft", "--config", str(recipe), "--num_processes", "2", "--output_dir", str(tmp_path)]) == 0
    assert launched[-1].args[4].num_processes == 2  # the command line wins
    assert set(train.LAUNCH_OPTIONS) == LAUNCH_KEYS  # what the command takes is what the scripts pass over


@pytest.mark.parametrize(
    "flags",
    [["sft", "--max_length", "4"], ["dpo", "--max_length", "8"], ["reward", "--max_length", "16", "{long_pairs}"]],
    ids=["sft", "dpo", "reward"],
)
def test_truncation_that_damages_most_samples_is_launched_when_allowed(tmp_path, capsys, launched, flags):
    """``--allow_truncated_data true`` lets a run whose truncation damages most samples (or, reward modelling's,
    drops most pairs) through the launcher's check (the one refused above, named in its message), silently: the first
    worker warns."""
    if "{long_pairs}" in flags:
        flags = [*flags[:-1], *data_file("long.jsonl", LONG_PAIRS)(tmp_path)]
    assert main([*flags, "--allow_truncated_data", "true", "--output_dir", str(tmp_path)]) == 0
    assert len(launched) == 1 and capsys.readouterr().err == ""


def test_ktos_mismatched_completions_are_checked_as_the_processes_to_come_choose_them(tmp_path, launched):
    """The examples refused on two processes (:data:`BAD_INPUTS`: the longest example with its mismatched completion,
    chosen within a global batch of 4) are launched on one, whose global batches of 2 pair them otherwise."""
    flags = data_file("kl.jsonl", KL_EXAMPLES)(tmp_path)
    batch = ["--per_device_train_batch_size", "2", "--max_tokens_per_microbatch", "50", "--num_processes", "1"]
    assert main(["kto", *flags, *batch, "--output_dir", str(tmp_path / "out")]) == 0 and len(launched) == 1


_failure = SimpleNamespace  # torchrun's ProcessFailure, as far as it is read


def test_a_worker_failure_is_one_line_with_the_workers_status(capsys):
    """torchrun's failures (its report: forty lines) become the worker's own exit status: 2, unsaid (the worker said
    it), for a one-line error; else the status of the first failure, or 128 + its signal, said in one line."""
    said = {0: _failure(exitcode=2, pid=11, timestamp=2.0), 1: _failure(exitcode=-15, pid=12, timestamp=1.0)}
    assert launching._failed("hf-odc sft", said) == 2 and capsys.readouterr().err == ""
    killed = {0: _failure(exitcode=1, pid=11, timestamp=2.0), 1: _failure(exitcode=-9, pid=12, timestamp=1.0)}
    assert launching._failed("hf-odc sft", killed) == 137
    assert capsys.readouterr().err == "hf-odc sft: error: rank 1 (pid 12) was ended by SIGKILL; its output is above\n"
    assert launching._failed("hf-odc dpo", {1: _failure(exitcode=1, pid=5, timestamp=0.0)}) == 1
    assert capsys.readouterr().err == "hf-odc dpo: error: rank 1 (pid 5) exited with status 1; its output is above\n"


def test_a_stopped_worker_is_ended_once_another_has_ended():
    """Two workers, one stopped: left alone while both run (a debugger may hold it); once the other ends, the stopped
    one is ended at once (torchrun would give it 30 s to act on a SIGTERM it cannot take)."""
    import signal
    import time

    from hf_odc.liveness import procfs

    with launching._ending_stopped_workers(interval=0.05):
        stopped, other = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
        try:
            os.kill(stopped.pid, signal.SIGSTOP)
            time.sleep(0.5)
            assert procfs.stopped(procfs.process_state(stopped.pid)), "left alone while no worker has ended"
            other.kill()
            other.wait()
            assert stopped.wait(timeout=scaled(10)) == -signal.SIGKILL
        finally:
            for process in (stopped, other):
                process.kill()
                process.wait()


def test_env_prints_versions_devices_and_the_transport(capsys):
    assert main(["env"]) == 0
    report = dict(line[2:].split(": ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith("- "))
    assert report["torch"] == torch.__version__ and report["trl"] != "not installed"
    cuda = torch.cuda.is_available()
    assert report["ODC transport"].startswith("cuda-symm-mem" if cuda else "cpu-shm (the device's")
    assert ("NVLink" in report) and ("CUDA symmetric memory" in report) and "Devices" in report
    if not cuda:
        assert report["CUDA symmetric memory"] == report["NVLink"] == "no (no CUDA device)"
        assert report["hf-odc sft's Accelerate config"].startswith("odc_cpu (")


def test_help_lists_the_launch_options_and_the_scripts_flags(capsys, launched):
    with pytest.raises(SystemExit) as ended:
        main(["kto", "--help"])
    out = capsys.readouterr().out
    assert ended.value.code == 0 and launched == []
    assert out.startswith("usage: hf-odc kto [--config RECIPE.yaml]") and "--num_processes N" in out
    assert "--desirable_weight" in out and "--allow_truncated_data" in out and "--odc_timeout" in out


# -- the launches (slow) ----------------------------------------------------------------------------------------------

TINY = ["--max_steps", "1", "--disable_tqdm", "true"]
EXAMPLE = ["--max_steps", "2", "--disable_tqdm", "true"]
GENERATING = [*TINY, "--num_prompts", "16", "--max_completion_length", "16"]
LAUNCHES = {
    "readme": ["sft"],  # README's first command, as it is, from a fresh folder
    "dpo": ["dpo", *EXAMPLE],
    "kto": ["kto", *EXAMPLE, "--accelerate_config", "{odc_config}"],
    "reward": ["reward", "--config", "{recipe}"],
    "grpo": ["grpo", *EXAMPLE],
    "grpo lora": ["grpo", *TINY, "--use_peft", "--beta", "0.04"],
    "rloo": ["rloo", *EXAMPLE],
    "distill": ["distill", *EXAMPLE],
    "refused": ["kto", *TINY, "--num_examples", "32", "--max_tokens_per_microbatch", "16"],
    "rollout refused": ["grpo", *GENERATING, "--max_tokens_per_microbatch", "8"],
}
"""Each launch's arguments; ``{odc_config}``: ``examples/odc_cpu.yaml`` plus ``odc_timeout: 123``; ``{recipe}``: a
recipe of two steps on 2 processes (a launch key). The trainings are each example with no argument but the output and
fewer steps (the examples' own tests: :data:`EXAMPLE_CHECKS`)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Every launch of :data:`LAUNCHES` through the installed ``hf-odc`` script, two at a time, each in a folder of
    its own: by name, its folder, exit status, standard output and error."""
    require_slow("hf-odc's training commands")
    base = tmp_path_factory.mktemp("cli")
    odc_config = accelerate_config(base, lambda text: text + "odc_timeout: 123\n")
    (base / "recipe.yaml").write_text("num_processes: 2\nmax_steps: 2\ndisable_tqdm: true\n")
    fill = {"odc_config": str(odc_config), "recipe": str(base / "recipe.yaml")}

    def run(name: str) -> SimpleNamespace:
        folder = base / name.replace(" ", "-")
        folder.mkdir()
        argv = [arg.format(**fill) for arg in LAUNCHES[name]]
        if name != "readme":
            argv += ["--output_dir", str(folder / "out")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # this checkout's hf_odc
        code, out, err = run_process([str(HF_ODC), *argv], scaled(240, 2), cwd=folder, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        return SimpleNamespace(folder=folder, code=code, out=out, err=err)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(LAUNCHES, pool.map(run, LAUNCHES), strict=True))


FOREIGN = re.compile(
    r"Traceback|ChildFailedError|elastic/errors|torch/distributed|exitcode|\[rank\d\]|FutureWarning|model_init_kwargs"
)
"""What the launches print none of: a traceback, torchrun's report or its log lines, or a warning the user did not
cause (transformers' ``is_gradient_checkpointing`` deprecation, from PEFT and TRL; TRL's "``model_init_kwargs`` will
be ignored", false for the ones hf_odc sets)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readmes_first_command_trains_the_tiny_model_on_2_cpu_processes(runs):
    run = runs["readme"]
    assert run.code == 0, run.err[-4000:]
    steps = logged_steps(run.folder / "odc-sft-output")
    assert sorted(steps) == list(range(1, 31)) and all("tokens/rank_1" in step for step in steps.values())
    assert "Training completed; model saved to odc-sft-output." in run.out
    assert not FOREIGN.search(run.out + run.err), (run.out + run.err)[-4000:]


def _dpo_example(logs: dict, out: Path) -> None:
    """The built-in pairs, a reference model built from the same seed; ODC + LB-Mini."""
    assert all(entry["reference_s"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert logs[2]["rewards/margins"] != 0.0


def _kto_example(logs: dict, out: Path) -> None:
    """The built-in examples, a reference model built from the same seed; ODC + LB-Mini."""
    assert all(entry["reference_s"] > 0 and entry["kl_s"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert logs[2]["kl"] != logs[1]["kl"]
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.odc_timeout == 123.0


def _reward_example(logs: dict, out: Path) -> None:
    """The built-in pairs and a tiny reward model built from a config; ODC + LB-Mini."""
    assert all(entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert logs[2]["margin"] != logs[1]["margin"]


def _grpo_example(peft: bool) -> Callable[[dict, Path], None]:
    def check(logs: dict, out: Path) -> None:
        """Transformers generation (each rank decoding alone, the default; a LoRA policy's generate enters below the
        FSDP root), then ODC updates (a LoRA policy's KL reference: the same model, adapter disabled); a LoRA run
        saves its adapter."""
        assert all(entry["completions/mean_length"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
        assert (out / "adapter_config.json").is_file() == peft
        assert (out / "model.safetensors").is_file() != peft

    return check


def _rloo_example(logs: dict, out: Path) -> None:
    """Transformers generation on each rank, TRL's default ``beta`` (the reference model loaded from the saved initial
    policy and sharded), ODC updates."""
    assert all(entry["completions/mean_length"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert all("kl" in entry and entry["scoring_s"] > 0 for entry in logs.values())
    assert (out / "model.safetensors").is_file()


def _distill_example(logs: dict, out: Path) -> None:
    """The student decodes on each rank with transformers, the teacher (sharded) scores the packed rows, ODC updates
    the student."""
    assert all(entry["completions/mean_length"] > 0 and entry["scoring_s"] > 0 for entry in logs.values())
    assert (out / "model.safetensors").is_file()


EXAMPLE_CHECKS = {
    "dpo": _dpo_example, "kto": _kto_example, "reward": _reward_example, "grpo": _grpo_example(peft=False),
    "grpo lora": _grpo_example(peft=True), "rloo": _rloo_example, "distill": _distill_example,
}  # fmt: skip
"""What each training launch's example does, checked on its logged steps and its output folder."""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", list(EXAMPLE_CHECKS))
def test_each_command_trains_on_2_cpu_processes(runs, command):
    """Each other command's example, with the built-in tiny model and data, on both processes, for two steps (LoRA
    GRPO: one, with ``--use_peft --beta 0.04``); kto through an Accelerate config holding an ODC key (the workers'
    config has it), reward through a recipe."""
    run = runs[command]
    assert run.code == 0, run.err[-4000:]
    steps = logged_steps(run.folder / "out")
    assert sorted(steps) == [1, 2][: 1 if command == "grpo lora" else 2], steps
    assert all("tokens/rank_1" in step for step in steps.values()), steps
    assert not FOREIGN.search(run.out + run.err), (run.out + run.err)[-4000:]
    EXAMPLE_CHECKS[command](steps, run.folder / "out")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_refusal_of_the_tokenized_data_is_one_line_with_status_2_before_any_worker_starts(runs):
    """The installed ``hf-odc kto``, whose data holds an example longer than a microbatch (once tokenized, with its
    mismatched completion): the launcher's one line, status 2, no worker started (nothing written) and neither a
    traceback nor torchrun's report."""
    run = runs["refused"]
    lines = [line for line in re.split(r"[\r\n]", run.err) if line.strip() and "examples/s]" not in line]  # no bars
    assert run.code == 2 and len(lines) == 1, run.err[-4000:]
    assert re.fullmatch(r"hf-odc kto: error: The training dataset's longest example has \d+ tokens \(it and its "
                        r"mismatched KL completion stay in one microbatch\), more than one microbatch holds \(16 "
                        r"tokens\)\..*", lines[0]), lines  # fmt: skip
    assert not (run.folder / "out").exists()
    assert not FOREIGN.search(run.out + run.err), (run.out + run.err)[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rollout_longer_than_a_microbatch_ends_the_run_in_one_line_with_status_2(runs):
    """The installed ``hf-odc grpo`` whose generated rollouts outgrow ``--max_tokens_per_microbatch``: what only the
    workers can see (the rollouts' lengths) is said once, by the first process, as a bad flag is: status 2, no
    traceback per rank, nor torchrun's report."""
    run = runs["rollout refused"]
    lines = [line for line in re.split(r"[\r\n]", run.err) if line.strip() and "examples/s]" not in line]
    assert run.code == 2 and len(lines) == 1, run.err[-4000:]
    assert re.fullmatch(r"hf-odc grpo: error: A rollout of \d+ tokens \(its prompt and completion\) is longer than a "
                        r"microbatch holds \(max_tokens_per_microbatch=8\)\. Set --max_tokens_per_microbatch to at "
                        r"least \d+, .*", lines[0]), lines  # fmt: skip
    assert not FOREIGN.search(run.out + run.err), (run.out + run.err)[-4000:]
