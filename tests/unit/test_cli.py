"""``hf-odc plan``: sources of lengths, cost models, the table, ``--json`` and ``--plot``, and error messages."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _machine import scaled

from hf_odc.cli import main
from hf_odc.packing import CalibratedCost, Calibration
from hf_odc.packing.cost import DEFAULT_ATTENTION_SHAPE, AttentionCost

SCHEMES = ("Collective+LocalSort", "Collective+LB-Micro", "ODC+LB-Micro", "ODC+LB-Mini")
RESULT_KEYS = {"world_size", "scheme", "sync", "bubble_rate", "speedup", "time", "min_microbatches", "max_microbatches"}
# Long-tailed measured lengths: a few long samples among many short ones.
LENGTHS = [512, 700, 900, 1200, 1500, 2048, 3000, 4096, 6000, 8000, 12000, 16384, 600, 800, 1000, 24000]
FAST = ["--world-sizes", "2,4", "--samples-per-rank", "6", "--minibatches", "3"]


def _plan(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def _fails(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _lengths_file(tmp_path: Path, lengths=LENGTHS) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths))
    return path


def test_default_run_prints_every_scheme_for_every_world_size(capsys):
    out = _plan(capsys)
    assert "Predicted bubble rate and speedup over Collective+LB-Micro" in out
    assert "longalign, 8 samples/rank, max_tokens=65536, cost=attention, 10" in out
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert [row[:2] for row in rows] == [[str(w), name] for w in (2, 8, 32, 128) for name in SCHEMES]
    for _, name, bubble, speedup, _ in rows:
        assert bubble.endswith("%") and speedup.endswith("x")
        if name == "Collective+LB-Micro":
            assert speedup == "1.00x"


def test_the_console_script_runs():
    script = shutil.which("hf-odc", path=str(Path(sys.executable).parent)) or shutil.which("hf-odc")
    assert script, "the hf-odc console script is installed with the package"
    result = subprocess.run(
        [script, "plan", "--distribution", "swe-smith", "--world-sizes", "4", "--minibatches", "1"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in SCHEMES)
    assert "max_tokens=131072" in result.stdout


def test_lengths_file_with_json_and_plot(tmp_path, capsys):
    lengths_file, out_json, out_png = _lengths_file(tmp_path), tmp_path / "out.json", tmp_path / "out.png"
    out = _plan(capsys, "--lengths", str(lengths_file), *FAST, "--json", str(out_json), "--plot", str(out_png))
    assert all(name in out for name in SCHEMES)

    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 20_000  # two timelines and a line chart, not an empty canvas

    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "results"}
    assert report["config"] == {
        "source": str(lengths_file),
        "world_sizes": [2, 4],
        "samples_per_rank": 6,
        "max_tokens": max(LENGTHS),  # --packing-ratio 1.0 of the longest measured sample
        "cost": "attention",
        "num_minibatches": 3,
        "seed": 0,
    }
    results = report["results"]
    assert [(r["world_size"], r["scheme"]) for r in results] == [(w, s) for w in (2, 4) for s in SCHEMES]
    for result in results:
        assert set(result) == RESULT_KEYS
        assert 0.0 <= result["bubble_rate"] < 1.0
        assert result["sync"] == ("minibatch" if result["scheme"].startswith("ODC") else "layer")
        assert result["speedup"] == 1.0 or result["scheme"] != "Collective+LB-Micro"
        assert f"{result['bubble_rate']:.1%}" in out  # the table shows the same numbers


def _json_report(capsys, tmp_path: Path, *args: str) -> dict:
    out_json = tmp_path / f"report{len(list(tmp_path.glob('report*')))}.json"
    _plan(capsys, *args, *FAST, "--json", str(out_json))
    return json.loads(out_json.read_text())


def test_csv_text_and_dataset_sources_give_the_same_plan(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    reference = _json_report(capsys, tmp_path, "--lengths", str(_lengths_file(tmp_path)))

    csv_file = tmp_path / "lengths.csv"
    csv_file.write_text("id,tokens\n" + "".join(f"s{i},{length}\n" for i, length in enumerate(LENGTHS)))
    text_file = tmp_path / "lengths.txt"
    text_file.write_text(" ".join(map(str, LENGTHS[:8])) + "\n" + "\n".join(map(str, LENGTHS[8:])))
    dataset_dir = tmp_path / "dataset"
    rows = {"input_ids": [[7] * length for length in LENGTHS], "num_tokens": LENGTHS}
    datasets.Dataset.from_dict(rows).save_to_disk(str(dataset_dir))
    dict_dir = tmp_path / "dataset_dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"num_tokens": [5, 6]}), "test": datasets.Dataset.from_dict(rows)}
    ).save_to_disk(str(dict_dir))

    sources = {
        f"{csv_file}": ["--lengths", str(csv_file), "--column", "tokens"],
        f"{text_file}": ["--lengths", str(text_file)],
        f"{dataset_dir}:input_ids": ["--dataset", str(dataset_dir), "--column", "input_ids"],  # len() of lists
        f"{dataset_dir}:num_tokens": ["--dataset", str(dataset_dir), "--column", "num_tokens"],  # integers
        f"{dict_dir}:num_tokens": ["--dataset", str(dict_dir), "--column", "num_tokens", "--split", "test"],
    }
    for name, args in sources.items():
        report = _json_report(capsys, tmp_path, *args)
        assert report["config"] == {**reference["config"], "source": name}
        assert report["results"] == reference["results"], name  # same lengths, same seeded draws, same plans


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"


def _save_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A word-level tokenizer built in code (no download): each word one token, and a chat template that adds 3
    tokens per message (<|im_start|>, the role, <|im_end|>)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    special = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    vocab = {token: i for i, token in enumerate([*special, "user", "assistant", "w"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(special)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", chat_template=chat_template
    )
    tokenizer.save_pretrained(directory)
    return directory


def test_text_and_chat_columns_are_counted_with_a_tokenizer_and_refused_without(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    tokenizer = str(_save_tokenizer(tmp_path / "tokenizer"))
    reference = _json_report(capsys, tmp_path, "--lengths", str(_lengths_file(tmp_path)))

    def chat(length: int) -> list[dict[str, str]]:  # 2 messages: 2 x 3 template tokens and length - 6 words
        return [{"role": "user", "content": "w " * 3}, {"role": "assistant", "content": "w " * (length - 9)}]

    dataset_dir = tmp_path / "chats"
    rows = {"messages": [chat(n) for n in LENGTHS], "text": ["w " * n for n in LENGTHS], "num_tokens": LENGTHS}
    datasets.Dataset.from_dict(rows).save_to_disk(str(dataset_dir))
    for column in ("messages", "text"):
        args = ["--dataset", str(dataset_dir), "--column", column, "--tokenizer", tokenizer]
        report = _json_report(capsys, tmp_path, *args)
        assert report["config"] == {**reference["config"], "source": f"{dataset_dir}:{column} (tokenizer {tokenizer})"}
        assert report["results"] == reference["results"], column  # the token counts are LENGTHS

    # Without a tokenizer, len() would count messages (2 each) or characters: refused, naming the column and the flag.
    err = " ".join(_fails(capsys, "--dataset", str(dataset_dir), "--column", "messages").split())
    assert (
        f"{dataset_dir} column 'messages' holds chat messages (lists of {{'role', 'content'}} dicts), not lengths: "
        "add --tokenizer DIR (a local tokenizer or model directory)"
    ) in err
    err = " ".join(_fails(capsys, "--dataset", str(dataset_dir), "--column", "text").split())
    assert f"{dataset_dir} column 'text' holds text (strings), not lengths: add --tokenizer DIR" in err


def test_tokenizer_misuse_exits_with_a_clear_message(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    dataset_dir = tmp_path / "chats"
    rows = {
        "messages": [[{"role": "user", "content": "w w"}]],
        "sharegpt": [[{"from": "human", "value": "w w"}]],
        "words": [["w", "w"]],
        "num_tokens": [5],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(str(dataset_dir))
    chats = ["--dataset", str(dataset_dir), "--column", "messages"]
    no_template = str(_save_tokenizer(tmp_path / "plain", chat_template=None))
    assert f"--tokenizer {no_template} has no chat template" in _fails(capsys, *chats, "--tokenizer", no_template)
    assert "is not a directory" in _fails(capsys, *chats, "--tokenizer", str(tmp_path / "missing"))
    err = _fails(capsys, "--dataset", str(dataset_dir), "--column", "num_tokens", "--tokenizer", no_template)
    assert "holds integer lengths, whose lengths need none: drop --tokenizer" in err
    err = _fails(capsys, "--lengths", str(_lengths_file(tmp_path)), "--tokenizer", no_template)
    assert "--tokenizer needs --dataset" in err
    err = _fails(capsys, "--dataset", str(dataset_dir), "--column", "sharegpt")
    assert "column 'sharegpt' holds lists of dicts with keys ['from', 'value'], not chat messages" in err
    err = _fails(capsys, "--dataset", str(dataset_dir), "--column", "words")
    assert "column 'words' holds List(Value('string')), which is none of: integer lengths, token ids" in err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert "--tokenizer needs transformers" in _fails(capsys, *chats, "--tokenizer", no_template)


def test_json_dash_writes_the_json_to_stdout_and_the_table_to_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--lengths", str(_lengths_file(tmp_path)), *FAST, "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # nothing but the JSON on stdout, for pipes
    assert [(r["world_size"], r["scheme"]) for r in report["results"]] == [(w, s) for w in (2, 4) for s in SCHEMES]
    assert "Predicted bubble rate and speedup" in captured.err
    assert not (tmp_path / "-").exists()


def test_max_tokens_packing_ratio_and_cost_options(tmp_path, capsys):
    lengths_file = str(_lengths_file(tmp_path))
    doubled = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--packing-ratio", "2", "--cost", "tokens")
    assert doubled["config"]["max_tokens"] == 2 * max(LENGTHS)
    assert doubled["config"]["cost"] == "tokens"
    capped = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--max-tokens", "30000")
    assert capped["config"]["max_tokens"] == 30000

    config = tmp_path / "model"
    config.mkdir()
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4}
    (config / "config.json").write_text(json.dumps({**shape, "vocab_size": 1000}))
    by_model = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--model-config", str(config))
    assert by_model["config"]["cost"].startswith("AttentionCost(")

    calibration = tmp_path / "calibration.json"
    rows = [[1, 4096, 4096**2, 0.5], [2, 8192, 2 * 4096**2, 1.0], [1, 8192, 8192**2, 1.5], [3, 6000, 1.2e7, 0.6]]
    calibration.write_text(json.dumps(rows))
    by_fit = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--calibration", str(calibration))
    assert by_fit["config"]["cost"].startswith("CalibratedCost(")
    saved = tmp_path / "odc_calibration.json"
    Calibration(CalibratedCost(linear=1e-5, quadratic=1e-9, per_microbatch=0.01), speeds=(1.0, 1.0)).save(saved)
    by_file = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--calibration", str(saved))
    assert f"linear={1e-5 + 0.01 / 24000!r}" in by_file["config"]["cost"], "the microbatch cost spread over the cap"
    assert by_file["results"] != by_fit["results"]
    calibration.write_text(json.dumps([[4096, 4096**2, 0.5]]))
    assert "nor a JSON list of measured microbatches" in _fails(capsys, "--lengths", str(lengths_file),
                                                                "--calibration", str(calibration))  # fmt: skip
    by_tokens = _json_report(capsys, tmp_path, "--lengths", lengths_file, "--cost", "tokens")
    assert by_fit["results"] != by_tokens["results"]


def test_a_cap_below_the_longest_sample_names_it_before_simulating(tmp_path, capsys):
    lengths_file = _lengths_file(tmp_path)
    # The longest sample, by its place in the user's file (not in a random minibatch), its length and the cap.
    err = _fails(capsys, "--lengths", str(lengths_file), "--max-tokens", "4096")
    assert f"Sample 15 of {lengths_file} has 24000 tokens, more than max_tokens=4096; raise --max-tokens" in err
    err = _fails(capsys, "--distribution", "swe-smith", "--max-tokens", "65536")
    assert "swe-smith draws samples of up to 131072 tokens, more than max_tokens=65536" in err
    err = _fails(capsys, "--lengths", str(lengths_file), "--packing-ratio", "0.9")
    assert f"more than max_tokens={int(0.9 * 24000)}" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "100"], "Sample 15 of "),
        (["--world-sizes", "2,x"], "argument --world-sizes: expected a positive integer, got x"),
        (["--world-sizes", "2.5"], "argument --world-sizes: expected a positive integer, got 2.5"),
        (["--world-sizes", "0"], "argument --world-sizes: expected a positive integer, got 0"),
        (["--samples-per-rank", "-3"], "argument --samples-per-rank: expected a positive integer, got -3"),
        (["--packing-ratio", "0"], "packing_ratio must be > 0"),
        (["--cost", "flops"], "argument --cost: invalid choice: 'flops'"),
        (["--distribution", "uniform"], "argument --distribution: not allowed with argument --lengths"),
    ],
)
def test_bad_options_exit_with_a_clear_message(tmp_path, capsys, args, message):
    err = _fails(capsys, "--lengths", str(_lengths_file(tmp_path)), "--minibatches", "1", *args)
    assert message in err


def test_bad_sources_exit_with_a_clear_message(tmp_path, capsys):
    assert "No such file or directory" in _fails(capsys, "--lengths", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([100, "abc", 300]))
    assert "holds 'abc', which is not an integer length" in _fails(capsys, "--lengths", str(bad))
    bad.write_text(json.dumps([100, 0, 300]))
    assert "holds the length 0; lengths must be positive" in _fails(capsys, "--lengths", str(bad))
    bad.write_text(json.dumps({"lengths": [1, 2]}))
    assert f"{bad} holds a JSON object; it must hold a JSON list of integers" in _fails(capsys, "--lengths", str(bad))
    bad.write_text("[100, 200,\n")
    assert f"{bad} is not valid JSON: Expecting value: line 2 column 1" in _fails(capsys, "--lengths", str(bad))
    bad.write_text(json.dumps([100, [200], 300]))
    assert f"{bad} holds [200], which is not an integer length" in _fails(capsys, "--lengths", str(bad))
    wide = tmp_path / "wide.csv"
    wide.write_text("a,b\n1,2\n")
    assert "has 2 columns; name the one holding lengths with --column" in _fails(capsys, "--lengths", str(wide))
    assert "A dataset needs --column" in _fails(capsys, "--dataset", str(tmp_path))


def test_the_documented_table_is_the_default_runs_output(capsys):
    """docs/planner.md shows plain ``hf-odc plan``'s numbers: every cell must be the command's own."""
    page = (Path(__file__).parents[2] / "docs" / "planner.md").read_text()
    section = page[page.index("<!-- plan:start -->") : page.index("<!-- plan:end -->")]
    header = "| ranks | " + " | ".join(SCHEMES) + " |"
    lines = section[section.index(header) :].splitlines()[2:]
    documented = {}
    for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]:
        ranks, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        documented |= {(ranks, scheme): cell for scheme, cell in zip(SCHEMES, cells, strict=True)}

    out = _plan(capsys)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    printed = {(ranks, scheme): f"{bubble} / {speedup}" for ranks, scheme, bubble, speedup, _ in rows}
    assert documented == printed
    assert all(re.fullmatch(r"\d+\.\d% / \d+\.\d\dx", cell) for cell in printed.values())


def test_the_plot_legend_explains_the_shades_and_the_gaps(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.patches import Rectangle

    from hf_odc.cli.plan import LengthPool, simulate
    from hf_odc.cli.plan.plot import plot_simulation

    simulation = simulate(LengthPool("measured", tuple(LENGTHS)), [2, 4], 6, max(LENGTHS), num_minibatches=1)
    figure = plot_simulation(simulation, tmp_path / "plan.png")
    timelines = [axes for axes in figure.axes if axes.get_title(loc="left").startswith(("Collective", "ODC"))]
    assert len(timelines) == 2
    for axes in timelines:
        legend = axes.get_legend()
        assert legend is not None, axes.get_title(loc="left")
        labels = [" ".join(text.get_text().split()) for text in legend.get_texts()]
        assert labels[0] == "microbatch (shades alternate)"
        assert labels[1].startswith("idle (white gap): waiting for")
        assert labels[2] == "minibatch end"
        # The legend's swatches: the microbatches' two shades, then white for the gaps.
        swatches = [tuple(patch.get_facecolor()) for patch in legend.findobj(Rectangle)]
        assert set(swatches[:2]) == {tuple(bar.get_facecolor()[0]) for bar in axes.collections}
        assert swatches[2:] == [(1.0, 1.0, 1.0, 1.0)]


HYBRID = ("HSDP+LB-Micro", "Hybrid ODC+LB-Mini")
NO_TIME_SCALE = (
    "--gpus-per-host weighs the cross-host all-reduce against compute time, and cost='tokens' has no time scale: "
    "give --calibration FILE (seconds) or an attention cost"
)
HYBRID_FAST = ["--world-sizes", "2,4,8", "--gpus-per-host", "2", "--samples-per-rank", "4", "--minibatches", "2"]


def test_hybrid_rows_for_world_sizes_spanning_hosts(tmp_path, capsys):
    lengths_file, out_json = str(_lengths_file(tmp_path)), tmp_path / "hybrid.json"
    out = _plan(capsys, "--lengths", lengths_file, *HYBRID_FAST, "--json", str(out_json))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    # 2 ranks are one host of 2 GPUs: no cross-host all-reduce, no hybrid rows.
    assert [row[:2] for row in rows] == [["2", name] for name in SCHEMES] + [
        [str(w), name] for w in (4, 8) for name in (*SCHEMES, *HYBRID)
    ]
    caption = " ".join(out.split())  # rich wraps the caption
    assert "2 GPUs/host" in caption and "(50 GB/s per GPU)" in caption
    assert "No hybrid rows for 2 ranks" in caption and "leaves out a flat FSDP's cross-host collectives" in caption

    report = json.loads(out_json.read_text())
    params = (
        AttentionCost.from_config(DEFAULT_ATTENTION_SHAPE).linear / 2
    )  # the default cost's model, as the parameter count
    assert report["config"]["cross_host"] == {
        "gpus_per_host": 2,
        "gradient_bytes": 4 * params,
        "bandwidth": 50e9,
        "seconds_per_unit": 3 / 200e12,
    }
    results = {(r["world_size"], r["scheme"]): r for r in report["results"]}
    for world_size in (4, 8):
        hosts = world_size // 2
        all_reduce = 2 * (hosts - 1) / hosts * 4 * params / 2 / 50e9 / (3 / 200e12)  # in forward FLOPs
        for hybrid, compute in zip(HYBRID, ("Collective+LB-Micro", "ODC+LB-Mini"), strict=True):
            expected = results[world_size, compute]["time"] + 2 * all_reduce  # one per minibatch
            assert results[world_size, hybrid]["time"] == pytest.approx(expected, rel=1e-12)
            assert set(results[world_size, hybrid]) == RESULT_KEYS


def test_hybrid_rows_with_a_calibration_and_a_parameter_count(tmp_path, capsys):
    calibration = tmp_path / "odc_calibration.json"
    Calibration(CalibratedCost(linear=1e-5, quadratic=1e-10, per_microbatch=0.01), speeds=(1.0, 1.0)).save(calibration)
    args = ["--lengths", str(_lengths_file(tmp_path)), "--calibration", str(calibration), *HYBRID_FAST]

    def report(gbps: str) -> dict:
        _plan(capsys, *args, "--params", "1.5e9", "--cross-host-gbps", gbps, "--json", str(tmp_path / "out.json"))
        return json.loads((tmp_path / "out.json").read_text())

    fast = report("1e9")
    assert fast["config"]["cross_host"] == {
        "gpus_per_host": 2,
        "gradient_bytes": 6e9,
        "bandwidth": 1e18,
        "seconds_per_unit": 1.0,  # a calibration is in seconds
    }
    slow = report("0.01")
    for world_size in (4, 8):  # the all-reduce free, or far slower than the compute
        fast_rows = {r["scheme"]: r for r in fast["results"] if r["world_size"] == world_size}
        slow_rows = {r["scheme"]: r for r in slow["results"] if r["world_size"] == world_size}
        assert fast_rows["Hybrid ODC+LB-Mini"]["speedup"] == pytest.approx(
            fast_rows["ODC+LB-Mini"]["speedup"], rel=1e-6
        )
        assert slow_rows["Hybrid ODC+LB-Mini"]["speedup"] < 1.0
        assert slow_rows["ODC+LB-Mini"] == fast_rows["ODC+LB-Mini"]  # the compute rows do not see the hosts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cost", "tokens"], NO_TIME_SCALE),
        (["--world-sizes", "2,3,6", "--gpus-per-host", "4"], "--gpus-per-host 4: none of --world-sizes 2,3,6 spans"),
        (["--gpus-per-host", "0"], "argument --gpus-per-host: expected a positive integer, got 0"),
        (["--cross-host-gbps", "0"], "argument --cross-host-gbps: expected a positive number, got 0"),
        (["--params=-1e9"], "argument --params: expected a positive number, got -1e9"),
        (["--params", "lots"], "argument --params: expected a positive number, got lots"),
        (["--tflops", "inf"], "argument --tflops: expected a positive number, got inf"),
    ],
)
def test_bad_hybrid_options_exit_naming_the_flag(tmp_path, capsys, args, message):
    err = _fails(capsys, "--lengths", str(_lengths_file(tmp_path)), *HYBRID_FAST, *args)
    assert message in err


def test_hybrid_options_need_gpus_per_host_and_fit_the_cost(tmp_path, capsys):
    lengths_file = str(_lengths_file(tmp_path))
    err = _fails(capsys, "--lengths", lengths_file, "--params", "1e9", "--tflops", "300")
    assert "--params, --tflops need --gpus-per-host" in err
    calibration = tmp_path / "odc_calibration.json"
    Calibration(CalibratedCost(linear=1e-5, quadratic=1e-10), speeds=(1.0, 1.0)).save(calibration)
    calibrated = ["--lengths", lengths_file, "--calibration", str(calibration), *HYBRID_FAST]
    assert "--params is required with --calibration" in _fails(capsys, *calibrated)
    err = _fails(capsys, *calibrated, "--params", "1e9", "--tflops", "300")
    assert "--tflops does not apply to --calibration" in err


def test_planning_does_not_import_torch():
    """``hf-odc plan`` starts in a fraction of a second: neither ``hf_odc`` nor its planners load torch until the
    engine is used."""
    code = (
        "import sys, hf_odc, hf_odc.cli, hf_odc.packing\n"
        "assert 'torch' not in sys.modules, 'planning imported torch'\n"
        "assert hf_odc.enable.__module__ == 'hf_odc.engine.odc'\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sp_size_plans_documents_longer_than_the_cap_on_groups(tmp_path, capsys):
    """``--sp-size 2`` with a cap of half the longest sample: every scheme plans it, ODC+LB-Mini with group
    microbatches (the lengths over the cap on two ranks each, counted on both), the others splitting every microbatch
    over a group; the caption says so and the JSON records the size. A size that does not divide a world size, or a
    sample longer than the groups hold, is refused."""
    lengths_file, out_json = str(_lengths_file(tmp_path)), tmp_path / "sp.json"
    out = _plan(capsys, "--lengths", lengths_file, "--max-tokens", "12000", "--sp-size", "2", "--world-sizes", "2,4",
                "--minibatches", "2", "--samples-per-rank", "4", "--json", str(out_json))  # fmt: skip
    schemes_table = out.split("┃ Group ┃")[0]  # the groups' table follows
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in schemes_table.splitlines() if line[:1] == "│"]
    assert [row[:2] for row in rows] == [[str(w), name] for w in (2, 4) for name in SCHEMES]
    assert "sp_size=2: samples over max_tokens split over 2 ranks" in " ".join(out.split())
    report = json.loads(out_json.read_text())
    assert report["config"]["sp_size"] == 2
    assert all(0 <= result["bubble_rate"] < 1 for result in report["results"])
    err = _fails(capsys, "--lengths", lengths_file, "--sp-size", "4", "--max-tokens", "12000", "--world-sizes", "2")
    assert "must divide the number of processes (2)" in err
    err = _fails(capsys, "--lengths", lengths_file, "--max-tokens", "6000", "--sp-size", "2")
    assert "has 24000 tokens, more than --sp-size 2 x max_tokens=6000" in err


def test_sp_size_shows_which_documents_each_group_splits_and_the_balance(tmp_path, capsys):
    """With ``--sp-size 2``, ``hf-odc plan`` shows ODC+LB-Mini's groups in the first minibatch (here every length of
    the file, drawn in some order, on 4 ranks): exactly the documents over the cap (5, so some group splits several),
    each on one group of 2 ranks, longest first; what they cost each rank of the group and every rank's load (token
    costs: the short documents' tokens plus each split document's share, all-to-alls included, on both ranks of its
    group); the busiest rank's load over the mean, in the table too."""
    from hf_odc.packing import split_costs

    out_json = tmp_path / "groups.json"
    lengths = [*LENGTHS[:11], 24000, 20000, 16384, 13000, 12500]
    out = _plan(capsys, "--lengths", str(_lengths_file(tmp_path, lengths)), "--max-tokens", "12000", "--sp-size", "2",
                "--world-sizes", "4", "--samples-per-rank", "4", "--minibatches", "1", "--cost", "tokens",
                "--json", str(out_json))  # fmt: skip
    groups = json.loads(out_json.read_text())["groups"]["4"]
    assert [group["ranks"] for group in groups] == [[0, 1], [2, 3]]
    long = sorted(length for length in lengths if length > 12000)
    assert sorted(length for group in groups for length in group["documents"]) == long
    shares = dict(zip(long, split_costs(long, 2, "tokens"), strict=True))
    for group in groups:
        assert list(group["documents"]) == sorted(group["documents"], reverse=True)
        assert group["shared_cost"] == pytest.approx(sum(shares[length] for length in group["documents"]))
        assert all(load >= group["shared_cost"] for load in group["loads"])
    loads = [load for group in groups for load in group["loads"]]
    short = sum(length for length in lengths if length <= 12000)
    assert sum(loads) == pytest.approx(short + 2 * sum(shares.values()))
    balance = f"{max(loads) / (sum(loads) / len(loads)):.2f}x"
    groups_table = " ".join(out.split("┃ Group ┃")[1].split())
    for group in groups:
        documents = ", ".join(map(str, group["documents"])) or "-"
        assert f"{group['ranks'][0]}-{group['ranks'][1]} │ {documents} │" in groups_table
    assert f"│ {balance} │" in groups_table
