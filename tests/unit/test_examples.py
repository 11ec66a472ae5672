"""``examples/sft.py`` as a new user meets it (issue #15): what it saves loads with the Auto classes, offline (the
tokenizer as the example built it; a LoRA adapter with its base model); the global minibatch does not depend on the
number of processes; a checkpoint flag alone switches checkpoints on; the console summarises the per-rank metrics
that ``trainer_state.json`` keeps; a bad flag ends the run with one error line, from the first process only.

Two short one-process runs (a full model, a LoRA adapter), loaded by one fresh interpreter; the flag handling is tested
on the parser alone.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
from _machine import Concurrently, scaled
from _trainer_launch import EXAMPLES, load_example, logged_steps, run

from hf_odc.demo import build_tokenizer, script

sft = load_example("sft.py")
grpo = load_example("grpo.py")
grpo_tools = load_example("grpo_tools.py")
sft_vlm = load_example("sft_vlm.py")
FAST = ("--max_steps", "2", "--num_samples", "32", "--global_batch_size", "4")
CHAT = [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w3 w2 w1"}]

LOAD = """
import json, sys
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer

full, adapter, chat = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(full)
ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
text = tokenizer.decode(ids)
prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, return_dict=False)
greedy = dict(input_ids=torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
lora = AutoPeftModelForCausalLM.from_pretrained(adapter)
print(json.dumps({
    "class": type(tokenizer).__name__, "ids": ids, "text": text,
    "reencoded": tokenizer(text, add_special_tokens=False)["input_ids"],
    "generated": AutoModelForCausalLM.from_pretrained(full).generate(**greedy)[0].tolist(),
    "base": lora.peft_config["default"].base_model_name_or_path, "lora_generated": lora.generate(**greedy)[0].tolist(),
}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two one-process runs (:func:`trained`, :func:`adapter`), side by side (:class:`~_machine.Concurrently`):
    each leaves a core idle."""
    directories = {"trained": tmp_path_factory.mktemp("sft"), "adapter": tmp_path_factory.mktemp("lora")}
    flags = {
        "trained": ("--save_steps", "1"),
        "adapter": ("--max_steps", "1", "--use_peft", "--disable_tqdm", "true"),
    }

    def job(name: str, background: Concurrently) -> tuple:
        directory = directories[name]
        output = run("sft.py", *FAST, *flags[name], "--output_dir", str(directory), background=background,
                     timeout=2 * 180)  # fmt: skip
        return directory, output

    with Concurrently({name: functools.partial(job, name) for name in flags}) as launches:
        yield launches


@pytest.fixture(scope="module")
def trained(runs):
    """Two steps on one process with ``--save_steps 1`` and no ``--save_strategy``: the directory and the output."""
    return runs.result("trained")


@pytest.fixture(scope="module")
def adapter(runs):
    """One LoRA step on one process, without tqdm (transformers' other console printer): the directory and output."""
    return runs.result("adapter")


@pytest.fixture(scope="module")
def loaded(trained, adapter):
    """What a fresh interpreter, the Hub unreachable (``HF_HUB_OFFLINE=1``) and hf_odc not imported, loads from both
    outputs with the Auto classes: the tokenizer's ids and text for :data:`CHAT`, and three greedy tokens generated
    after its first turn by each model."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(trained[0]), str(adapter[0]), json.dumps(CHAT)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_saved_tokenizer_and_model_load_with_the_auto_classes(loaded):
    """Every word of a chat gets its id back (the tokenizer class of a Qwen2 model type would drop them all)."""
    tokenizer = build_tokenizer()
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    turns = [["<|im_start|>", "user", "w1", "w2", "w3", "<|im_end|>"], ["<|im_start|>", "assistant", "w3", "w2", "w1"]]
    assert ids == tokenizer.convert_tokens_to_ids([*turns[0], *turns[1], "<|im_end|>"])
    assert loaded["ids"] == ids, loaded
    assert loaded["text"] == tokenizer.decode(ids) and loaded["reencoded"] == ids
    prompt = tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_dict=False)
    assert loaded["generated"][: len(prompt)] == prompt and len(loaded["generated"]) == len(prompt) + 3


@pytest.mark.slow
def test_the_lora_adapter_loads_and_generates_offline(adapter, loaded):
    directory, _ = adapter
    assert json.loads((directory / "adapter_config.json").read_text())["lora_dropout"] == 0
    assert loaded["base"] == str(directory / "base_model")
    assert len(loaded["lora_generated"]) == len(loaded["generated"])


@pytest.mark.slow
def test_a_checkpoint_flag_alone_switches_checkpoints_on(trained):
    directory, _ = trained
    assert (directory / "checkpoint-1").is_dir() and (directory / "checkpoint-2").is_dir()


@pytest.mark.parametrize(
    ("flags", "strategy"),
    [
        ((), "no"),
        (("--save_steps", "2"), "steps"),
        (("--save_total_limit", "1"), "steps"),
        (("--save_steps", "2", "--save_strategy", "no"), "no"),
        (("--save_strategy", "epoch"), "epoch"),
    ],
)
def test_checkpoint_flags_imply_saving_unless_the_strategy_is_given(flags, strategy):
    namespace, _ = sft.make_parser().parse_known_args(list(flags))
    assert namespace.save_strategy == strategy


def test_a_checkpoint_setting_of_a_config_file_counts_as_given(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("save_steps: 2\n")
    _, training_args, _ = sft.make_parser().parse_args_and_config(["--config", str(recipe)])
    assert training_args.save_strategy == "steps" and training_args.save_steps == 2


@pytest.mark.slow
@pytest.mark.parametrize("run_output", ["trained", "adapter"])
def test_the_console_summarises_what_trainer_state_keeps_per_rank(request, run_output):
    """With tqdm (``ProgressCallback``) and without (``PrinterCallback``); nor the warnings the example avoids (PEFT's
    own use of a deprecated transformers name, ``is_gradient_checkpointing``, is not the example's)."""
    directory, output = request.getfixturevalue(run_output)
    assert "'busy_s': " in output and "'microbatches': " in output and "busy_s/rank_0" not in output, output
    steps = logged_steps(directory)
    assert all("busy_s/rank_0" in entry and "microbatches/rank_0" in entry for entry in steps.values()), steps
    assert "`gradient_checkpointing` is deprecated" not in output and "new PAD/BOS/EOS tokens" not in output, output


@pytest.mark.parametrize(
    ("processes", "flags", "per_device", "total"),
    [
        ("1", (), 16, 16),
        ("2", (), 8, 16),
        ("4", ("--global_batch_size", "32"), 8, 32),
        ("2", ("--per_device_train_batch_size", "3"), 3, 6),
    ],
)
def test_the_global_minibatch_does_not_depend_on_the_process_count(monkeypatch, processes, flags, per_device, total):
    monkeypatch.setenv("WORLD_SIZE", processes)
    namespace, _ = sft.make_parser().parse_known_args(list(flags))
    assert (namespace.per_device_train_batch_size, namespace.global_batch_size) == (per_device, total)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--global_batch_size", "15"),
            "--global_batch_size 15 is not a positive multiple of the number of processes (2)",
        ),
        (("--global_batch_size", "8", "--per_device_train_batch_size", "4"), "not both"),
    ],
)
def test_a_global_minibatch_the_processes_cannot_share_is_refused(monkeypatch, capsys, flags, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as failure:
        sft.make_parser().parse_known_args(list(flags))
    assert failure.value.code == 2 and message in capsys.readouterr().err


BAD_FLAGS = [
    (("--max_stepz", "3"), "unrecognized arguments: --max_stepz 3"),  # unknown
    (("--max_step", "3"), "unrecognized arguments: --max_step 3"),  # a prefix of --max_steps: spelt in full only
    (("--max_steps", "x"), "invalid int value: 'x'"),  # unparsable
    (("--odc", "false", "--balance", "lb-mini"), "balance='lb-mini'"),  # refused by the config's __post_init__
]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS)
def test_a_bad_flag_fails_with_one_error_line_from_the_first_process_only(monkeypatch, capsys, flags, named):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as failure:
        sft.make_parser().parse_args_and_config(list(flags))
    (error,) = capsys.readouterr().err.splitlines()
    assert failure.value.code == 2 and error.startswith(f"{sft.make_parser().prog}: error: ") and named in error
    monkeypatch.setenv("RANK", "1")  # the others exit as silently as they can, with the same status
    monkeypatch.setattr(script, "ERROR_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as failure:
        sft.make_parser().parse_args_and_config(list(flags))
    assert failure.value.code == 2 and capsys.readouterr().err == ""


def test_grpo_refuses_a_dataset_it_would_not_read_in_one_line(tmp_path, monkeypatch, capsys):
    """``examples/grpo.py`` trains on its built-in prompts: ``--dataset_name`` is refused, not silently ignored."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as failure:
        grpo.make_parser().parse_args_and_config(["--dataset_name", str(tmp_path)])
    error = capsys.readouterr().err.splitlines()[-1]
    says = f"--dataset_name {tmp_path}: {grpo.make_parser().prog} trains on its built-in data only"
    assert failure.value.code == 2 and error.endswith(says)


def test_the_vision_example_takes_its_built_in_shapes_and_refuses_any_other_model_config(monkeypatch, capsys):
    """``examples/sft_vlm.py --model_config`` names a built-in Qwen2.5-VL shape (the GPU point's ``qwen2.5-vl-3b``);
    the text scripts' names and ``config.json`` paths are refused in one line that lists the shapes."""
    monkeypatch.delenv("RANK", raising=False)
    script_args, _, _ = sft_vlm.make_parser().parse_args_and_config(["--model_config", "qwen2.5-vl-3b"])
    assert script_args.model_config == "qwen2.5-vl-3b"
    for config in ("qwen2.5-1.5b", "/nonexistent/config.json"):
        with pytest.raises(SystemExit) as failure:
            sft_vlm.make_parser().parse_args_and_config(["--model_config", config])
        (error,) = capsys.readouterr().err.splitlines()
        assert failure.value.code == 2
        assert error.endswith(f"--model_config {config}: name one of tiny, qwen2.5-vl-3b, the built-in shapes, or pass "
                              "--model_name_or_path")  # fmt: skip


def test_the_text_examples_import_without_pillow():
    """The README's first command installs hf_odc's dependencies only, and Pillow is none of them (the dev extras
    bring it through matplotlib): the demos import it only where they make images, so ``hf-odc sft`` runs without it."""
    blocked = "import sys; sys.modules['PIL'] = None; import runpy, hf_odc.demo; "
    load = f"runpy.run_path({str(EXAMPLES / 'sft.py')!r}, run_name='not_main')"
    done = subprocess.run([sys.executable, "-c", blocked + load], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_vision_demos_name_the_extra_without_pillow():
    """Without Pillow, making a vision-language demo's images says which extra to install."""
    blocked = "import sys; sys.modules['PIL'] = None; import numpy; from hf_odc.demo import vision; "
    make = "vision._random_images(numpy.random.default_rng(0), 0, 2)"
    done = subprocess.run([sys.executable, "-c", blocked + make], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode != 0 and "pip install 'hf_odc[vision]'" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_the_tool_calling_example_runs_trls_tool_loop_and_packs_the_tool_results(tmp_path):
    """``examples/grpo_tools.py`` with its defaults on 2 processes: every step's rollouts (8 prompts of 4 generations
    each, per process) run TRL's tool loop, the ``g``-th generation of a prompt calling the tool ``min(g, 2)`` times
    (1.25 calls per rollout, none failing), and each minibatch is packed whole, tool results included: 8 tokens a
    result beyond what TRL counts as the policy's tokens (``num_tokens``: prompts and generated tokens). That the
    packed tool results get no gradient is ``tests/test_grpo_tools.py``'s."""
    output = run("grpo_tools.py", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)
    namespace, _ = grpo_tools.make_parser().parse_known_args([])
    rollouts, groups = 2 * namespace.per_device_train_batch_size, namespace.num_generations
    calls = sum(min(g, namespace.max_calls) for g in range(groups)) / groups
    logs = logged_steps(tmp_path)
    assert sorted(logs) == list(range(1, namespace.max_steps + 1))
    counted = 0
    for _, entry in sorted(logs.items()):
        assert entry["tools/call_frequency"] == calls > 0 and entry["tools/failure_frequency"] == 0, entry
        packed = entry["tokens/rank_0"] + entry["tokens/rank_1"]
        assert packed - (entry["num_tokens"] - counted) == 8 * calls * rollouts, entry
        counted = entry["num_tokens"]
    assert f"{calls:.2f} tool calls per rollout" in output and "decoded tokens/s" in output, output


GPU_TOOL_FLAGS = ["--model_config", "qwen2.5-1.5b", "--max_completion_length", "512", "--num_generations", "8",
                  "--per_device_train_batch_size", "16", "--max_steps", "20"]  # fmt: skip


def test_the_tool_examples_gpu_command_builds_the_qwen25_15b_shape_and_fills_its_completions(tmp_path):
    """The GPU command of ``examples/grpo_tools.py``'s docstring, on CPU as far as it can go: the flags parse (static
    decoding), the Qwen2.5-1.5B shape builds (on the meta device, no weights) with the tool tokenizer's ids inside its
    vocabulary, and the scripted policy's longest completion (2 calls, their results, the answer) fills 512 tokens."""
    import torch
    from trl import ModelConfig

    from hf_odc.demo import build_model, build_tool_tokenizer

    script_args, training_args, _ = grpo_tools.make_parser().parse_args_and_config(
        [*GPU_TOOL_FLAGS, "--output_dir", str(tmp_path)]
    )
    assert training_args.odc_generation == "static" and training_args.max_completion_length == 512
    script = grpo_tools.scripted_policy(script_args, training_args)
    g, calls = 7, 2
    longest = calls * 14 + script.words_per_turn * (1 + g + calls) + 1
    assert 512 - (1 + g + calls) < longest <= 512, script
    tokenizer = build_tool_tokenizer()
    with torch.device("meta"):
        model = build_model(script_args.model_config, ModelConfig(), tokenizer, seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 28
    assert len(tokenizer) <= model.config.vocab_size == 151936


DATA_ROW = {"messages": CHAT}


@pytest.mark.parametrize(
    ("name", "rows", "says"),
    [
        ("chats.jsonl", [DATA_ROW] * 8, None),
        ("chats.json", [{"conversation": CHAT}] * 8,
         "needs 'messages' or 'text' or 'prompt' and 'completion' or 'input_ids'; its columns are ['conversation']"),
        ("empty.jsonl", [], "the file is empty"),
        ("chats.xml", [DATA_ROW], "a data file must end in one of .json, .jsonl"),
    ],
)  # fmt: skip
def test_a_data_file_loads_and_data_sft_cannot_train_on_is_said_in_one_line(tmp_path, monkeypatch, capsys, name,
                                                                              rows, says):  # fmt: skip
    """``--dataset_name`` naming a file loads it; a dataset without a column SFT trains on, or an empty file, ends the
    run as the command line is parsed, with one line naming the file, the columns expected and found (not TRL's
    ``KeyError`` on one rank)."""
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(row) for row in rows))
    flags = ["--dataset_name", str(path), "--output_dir", str(tmp_path / "out")]
    if says is None:
        script_args, training_args, _ = sft.make_parser().parse_args_and_config(flags)
        dataset = sft.load_train_dataset(script_args, training_args, vocab_size=600)
        assert len(dataset) == 8 and dataset[0]["messages"] == CHAT
        return
    with pytest.raises(SystemExit) as failure:
        sft.make_parser().parse_args_and_config(flags)
    lines = capsys.readouterr().err.splitlines()  # datasets' progress bars too, when it read the file
    (error,) = [line for line in lines if "error" in line]
    assert failure.value.code == 2 and error == lines[-1]
    assert error.startswith(f"{sft.make_parser().prog}: error: --dataset_name {path}: ") and says in error


def test_a_model_directory_without_its_tokenizer_is_refused_not_given_the_demo_one(tmp_path):
    """The demo tokenizer stands in only when no model is given: a model directory brings its own tokenizer or is
    refused, naming the files it lacks (its token ids would mean nothing to another vocabulary)."""
    from trl import ModelConfig

    from hf_odc.demo import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"holds no tokenizer \(tokenizer.json or tokenizer_config.json\)"):
        load_tokenizer(ModelConfig(model_name_or_path=str(tmp_path)))
    build_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(ModelConfig(model_name_or_path=str(tmp_path))).get_vocab() == build_tokenizer().get_vocab()
    assert len(load_tokenizer(ModelConfig())) == len(build_tokenizer())


PAIR = {"prompt": "w1 w2", "chosen": "w2 w1", "rejected": "w5 w7"}
UNPAIRED = {"prompt": "w1 w2", "completion": "w2 w1", "label": True}


@pytest.mark.parametrize(
    ("script", "rows", "says"),
    [
        ("reward.py", [PAIR] * 4, None),
        ("reward.py", [UNPAIRED] * 4, "a reward model trains on preference pairs: 'chosen' and 'rejected' columns"),
        ("kto.py", [UNPAIRED] * 4, None),
        ("kto.py", [PAIR] * 4, None),
        ("kto.py", [{"prompt": "w1", "completion": "w2"}] * 4, "KTO needs unpaired examples ('prompt', 'completion'"),
        ("dpo.py", [UNPAIRED] * 4, "DPO needs preference pairs: 'chosen' and 'rejected' columns"),
        ("rloo.py", [UNPAIRED] * 4, "trains on its built-in data only"),
        ("distill.py", [UNPAIRED] * 4, "trains on its built-in data only"),
    ],
)
def test_each_example_checks_its_dataset_as_the_command_line_is_parsed(tmp_path, monkeypatch, capsys, script, rows,
                                                                        says):  # fmt: skip
    """``--dataset_name`` loads as SFT's does, and data the script cannot train on (or any, for a script that trains on
    its built-in prompts) ends the run with one line naming the file and the columns found, before a model is built."""
    monkeypatch.delenv("RANK", raising=False)
    example = load_example(script)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    flags = ["--dataset_name", str(path), "--output_dir", str(tmp_path / "out")]
    if says is None:
        script_args, training_args, _ = example.make_parser().parse_args_and_config(flags)
        load = example.load_pairs if script == "reward.py" else example.load_examples
        assert load(script_args, training_args).to_list() == rows
        return
    with pytest.raises(SystemExit) as failure:
        example.make_parser().parse_args_and_config(flags)
    lines = capsys.readouterr().err.splitlines()
    (error,) = [line for line in lines if "error" in line]
    assert failure.value.code == 2 and error == lines[-1]
    assert error.startswith(f"{example.make_parser().prog}: error: --dataset_name {path}: ") and says in error
