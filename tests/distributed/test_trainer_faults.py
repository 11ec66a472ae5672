"""What a user sees when a rank stalls or the launcher dies, tried the way a user runs the example: every collective of
a step is bounded by the ODC timeout and names the rank, and no process or shared-memory segment is left behind."""

from __future__ import annotations

import ast
import contextlib
import glob
import os
import re
import signal
import subprocess
import time

import pytest
from _machine import Concurrently, scaled
from _stall_sft import POINTS, STOPS
from _trainer_launch import ROOT, SUPPORT, start

from hf_odc.liveness import procfs

AT_ONCE = 2
"""Launches side by side (:class:`~_machine.Concurrently`): a case's processes spend much of it waiting (for the
timeout, the launcher's start and teardown), which another case's fill."""
PROCESSES = 2 * AT_ONCE  # on the machine at once: what the bounds below scale with
# A healthy rank of a busy machine must not miss it: the load average (taken at the start) counts the other jobs; a
# step of the tiny model takes a fraction of a second, so a launch beside it does not need more (which each stall
# case would spend waiting).
TIMEOUT = max(3, round(scaled(3, 2)))
COMMON = (
    "--num_samples", "64", "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--logging_steps", "1",
    "--odc_timeout", str(TIMEOUT),
)  # fmt: skip
# What the survivor says: a stall is named where the survivor next meets the others; a death inside a collective (a
# connection reset to gloo) by the host, which sees the dead process.
SAYS = {
    "microbatch": r"ranks \[1\] did not reach the minibatch barrier",
    "exit-barrier": r"ranks \[1\] did not reach the minibatch barrier",
    "metrics-gather": r"ranks \[1\] did not reach the step's metrics gather",
    "clip-grad": r"ranks \[1\] did not reach gradient clipping",
    "logging": r"ranks \[1\] did not reach logging, evaluation and checkpointing",
    "checkpoint-save": r"ranks \[1\] did not reach a checkpoint save",
    "killed-in-gather": r"rank 1 \(pid \d+\) died; .*\(the step's metrics gather failed: ",
}


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/hf_odc_*"))


def _left_behind(before: set[str]) -> set[str]:
    """The ``hf_odc_*`` segments not in ``before`` that are still there a second later (a launch running beside this
    one names its own for a few milliseconds while it sets them up)."""
    new = _segments() - before
    if new:
        time.sleep(1)
    return new & _segments()


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every selected test's launch (:data:`LAUNCHES`), :data:`AT_ONCE` at a time, while the tests go on."""
    with Concurrently.of_tests(request, tmp_path_factory, LAUNCHES, AT_ONCE) as launches:
        yield launches


def _stalled(background: Concurrently, point: str, directory) -> dict:
    before = _segments()
    stall_file, log = directory / "stalled", directory / "log"
    env = {"HF_ODC_TEST_STALL": point, "HF_ODC_TEST_STALL_FILE": str(stall_file)}
    saving = ["--save_strategy", "no"]  # a checkpoint only where the stall is in one
    if point == "checkpoint-save":
        saving = ["--save_strategy", "steps", "--save_steps", "1"]
    args = (*COMMON, "--max_steps", "3", *saving, "--output_dir", str(directory))
    process = background.track(start(str(SUPPORT / "_stall_sft.py"), *args, log=log, env=env))
    try:
        code = process.wait(timeout=scaled(120, PROCESSES))
        ended = time.time()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launch ran past its timeout:\n{log.read_text()[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert code != 0 and stall_file.exists(), output[-3000:]
    pid, stalled_at = stall_file.read_text().split()
    # the bound is taken when the run ends: the load average of its own time
    late = ended - float(stalled_at) - TIMEOUT - scaled(10, PROCESSES)
    outlived = os.path.exists(f"/proc/{pid}")
    return {"output": output, "late": late, "outlived": outlived, "left": _left_behind(before)}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(POINTS))
def test_a_rank_stalled_anywhere_in_a_step_is_named_within_the_timeout(point, launched, request):
    """Rank 1 stalls (or dies) at ``point`` of the second step; rank 0 ends within timeout + 10 s with PeerFailureError
    naming rank 1, and the launcher then ends the stalled rank."""
    run = launched.result(request.node.nodeid)
    output = run["output"]  # (the launch failed, rank 1 stalled: checked by _stalled)
    assert run["late"] < 0, output[-3000:]
    assert re.search(rf"PeerFailureError: hf_odc: {SAYS[point]}", output), output[-3000:]
    assert not run["outlived"], "the stalled rank outlived the job"
    assert not run["left"]


# What the survivor says when rank 1 is frozen by SIGSTOP: its heartbeat stopped too ({pid}: rank 1's pid).
STOPPED_SAYS = {
    "stopped-in-gather": r"PeerFailureError: hf_odc: rank 1 \(pid {pid}\) has not been heard from for [\d.]+ s \(its "
    r"process is stopped: SIGSTOP, a debugger or a paused container\); it was last seen .*\(the step's metrics gather "
    r"failed: ",
    # whichever survivor's watchdog fires first says it (under load, the hybrid's other ranks may before rank 0)
    "stopped-at-startup": r"hf_odc: ending rank \d+: a rank went silent for longer than the ODC timeout "
    r"\({timeout} s\):\n\s+rank {rank} \(pid {pid}\) has not been heard from for [\d.]+ s \(its process is stopped",
}


def _stopped(background: Concurrently, point: str, hybrid: bool, directory) -> tuple[re.Match | None, str]:
    stall_file, log = directory / "stalled", directory / "log"
    stalled = 3 if hybrid else 1
    env = {
        "HF_ODC_TEST_STALL": point,
        "HF_ODC_TEST_STALL_FILE": str(stall_file),
        "HF_ODC_TEST_STALL_RANK": str(stalled),
    }
    args = (*COMMON, "--max_steps", "3", "--save_strategy", "no", "--output_dir", str(directory))
    if hybrid:
        args = (*args, "--odc_shard_size", "2")
    processes = 4 if hybrid else 2
    process = background.track(start(str(SUPPORT / "_stall_sft.py"), *args, log=log, env=env, processes=processes))
    pid, said = None, None
    try:
        deadline = time.monotonic() + scaled(240, PROCESSES + processes - 2)
        while said is None and process.poll() is None and time.monotonic() < deadline:
            if pid is None and stall_file.exists() and stall_file.read_text().strip():
                pid = int(stall_file.read_text().split()[0])
            if pid is not None:
                said = re.search(STOPPED_SAYS[point].format(pid=pid, timeout=TIMEOUT, rank=stalled), log.read_text())
            time.sleep(0.2)
    finally:
        if pid is not None:  # torchrun starts each rank in a session of its own, and a stopped one ignores SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the launcher; rank 0 follows it (its parent-death signal)
        process.wait()
    return said, log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "hybrid"), [*((point, False) for point in STOPS), ("stopped-at-startup", True)], ids=lambda v: str(v)
)
def test_a_stopped_rank_is_named_inside_a_collective_and_during_startup(point, hybrid, launched, request):
    """Rank 1 is frozen by SIGSTOP (every thread, its heartbeat's too): inside the metrics gather, after meeting its
    peers, where gloo's timeout names nobody; or at startup, before the process group exists, where nothing of hf_odc
    waits and gloo would wait 30 minutes. Rank 0 names rank 1, its pid and that its process is stopped. Hybrid: 4
    processes as 2 replicas x 2 (``--odc_shard_size 2``), rank 3 (the other replica's) stopped at startup."""
    said, output = launched.result(request.node.nodeid)
    assert said is not None, output[-4000:]


def _launcher_killed(background: Concurrently, when: str, directory) -> None:
    log = directory / "log"
    args = (*COMMON, "--max_steps", "400", "--save_strategy", "no", "--output_dir", str(directory / "out"))
    launcher = background.track(start("sft.py", *args, log=log))
    workers: list[int] = []
    try:
        deadline = time.monotonic() + scaled(120, PROCESSES)
        # torchrun starts each worker in a session of its own: they are the launcher's children
        while len(workers := _children(launcher.pid)) < 2 or (when == "training" and "'loss'" not in log.read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        launcher.kill()
        launcher.wait()
        # At startup a worker first finishes importing its libraries; a busy machine takes longer to end a process.
        limit = scaled(10 if when == "training" else 60, PROCESSES)
        deadline = time.monotonic() + limit
        while alive := [pid for pid in workers if _running(pid)]:
            assert time.monotonic() < deadline, f"workers {alive} outlived their launcher by {limit:.0f} s"
            time.sleep(0.1)
    finally:
        for pid in [launcher.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["startup", "training"])
def test_killing_the_launcher_ends_its_workers(when, launched, request):
    """SIGKILL of `accelerate launch` alone (its workers untouched), as soon as both workers exist (they are still
    importing their libraries) or once they train: the workers end too (the kernel's parent-death signal, asked for
    when hf_odc is imported; a worker whose launcher died before that ends itself there), instead of waiting in a
    rendezvous with a launcher that is gone, or training on, unsupervised, to the end."""
    launched.result(request.node.nodeid)  # the launch's own assertions fail it


LAUNCHES = {
    "test_a_rank_stalled_anywhere_in_a_step_is_named_within_the_timeout": _stalled,
    "test_a_stopped_rank_is_named_inside_a_collective_and_during_startup": _stopped,
    "test_killing_the_launcher_ends_its_workers": _launcher_killed,
}
"""Each test's launch, by test name: a function of the :class:`~_machine.Concurrently` running it, the test's
parameters and its directory."""


def _children(parent: int) -> list[int]:
    return sorted(pid for pid in procfs.pids() if procfs.parent(pid) == parent)


def _running(pid: int) -> bool:
    return not procfs.gone(procfs.process_state(pid))


def _message_templates() -> list[str]:
    """Every string the library's source builds, with each ``{...}`` of an f-string as ``\\0`` (adjacent literals
    already joined, as Python joins them)."""
    templates = []
    for path in (ROOT / "hf_odc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                templates.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                templates.append(node.value)
    return templates


def _failures_table() -> list[list[str]]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text[text.index("<!-- failures:start -->") : text.index("<!-- failures:end -->")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]  # rows[0]: the header


def test_the_failures_table_quotes_the_library():
    """docs/troubleshooting.md's table of errors: every quoted message (``<...>`` stands for what varies, a bracketed
    ``[<R>]`` for a printed list; quoted flags and names are not messages) is one the library's source still builds,
    and every row names a test that exists."""
    templates = _message_templates()
    rows = _failures_table()
    assert len(rows) >= 10
    for failure, what_you_see, checked_by in rows:
        for quote in re.findall(r"`([^`]+)`", what_you_see):
            if quote.startswith("-") or " " not in quote:
                continue  # a flag, a command or a name, not a message
            quote = quote.replace("[<", "<").replace(">]", ">")
            pattern = ".*?".join(re.escape(chunk) for chunk in re.split(r"<[^>]*>", quote))
            assert any(re.search(pattern, t, re.DOTALL) for t in templates), f"{failure}: {quote!r} is in no message"
        for test in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", checked_by):
            path, name = test
            assert f"def {name}(" in (ROOT / path).read_text(), f"{failure}: {path}::{name} does not exist"
        assert "tests/" in checked_by, failure
