"""Launches of the parity scripts without paying every rank's imports: a process that imports torch, transformers, TRL,
datasets, Accelerate and peft once (the "zygote", one per pytest process, started at the first such launch) and forks a
child for each rank, which takes the environment a real ``accelerate launch`` gives that rank and runs the script as
``python script`` would (:func:`launch`). A 2-process launch's CPU time is nearly all start-up (two ranks' and the
launcher's imports); a forked rank starts with them done.

What a rank sees is what the launcher gives it: the variables ``accelerate launch`` (torchrun) sets for each rank are
recorded once per config, process count and environment, from a real launch of this file
(:func:`_launcher_environment`), and replayed with this launch's own store (the agent store torchrun hosts, which the
ranks join, here hosted by the caller), run id and error files. hf_odc itself is not pre-imported: a rank imports it
fresh, so that what hf_odc does at import under a launcher (the heartbeat, ending with the launcher) happens as it does
under torchrun. The zygote only imports, never computes, so it forks before any thread of torch's is started; the
threads an import starts (OpenBLAS's pool, which ``OPENBLAS_NUM_THREADS=1`` keeps from starting, and the allocator's
of pyarrow) are ones whose libraries reset them at fork.

The tests that check *how* a launch behaves (faults, signals, output, the command line) keep the real launchers:
``_trainer_launch.launch`` runs ``accelerate launch`` unless told ``preimported``; ``tests/unit/test_cli_train.py``
runs the ``hf-odc`` commands.

Run as a script: ``serve SOCKET`` (the zygote) or ``record PREFIX`` (a rank of the recording launch)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.nn.attention.varlen", "transformers", "transformers.modeling_utils", "datasets", "accelerate", "peft", "trl",
)  # fmt: skip
"""The libraries the zygote imports (what ``hf_odc.trainer`` and ``hf_odc.demo`` pull, but hf_odc itself)."""
TRL_CLASSES = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer", "RewardTrainer", "RLOOTrainer")
"""TRL's lazily imported trainers, loaded by name in the zygote."""
_GRACE_S = 30.0  # as torchrun: after a rank fails, the others get SIGTERM, then SIGKILL this much later


# -- the caller's side (pytest) ---------------------------------------------------------------------------------------


class _Zygote:
    """The running zygote: its process and the socket it forks ranks for."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="hf_odc_zygote_"))
        self.socket = self.directory / "zygote.sock"
        self.log = self.directory / "zygote.log"
        env = {"OPENBLAS_NUM_THREADS": "1"} | dict(os.environ)
        with open(self.log, "w") as log:
            # stdin: a pipe only this process writes, so that the zygote ends (and ends its ranks) when pytest does
            self.process = subprocess.Popen(
                [sys.executable, __file__, "serve", str(self.socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env=env, start_new_session=True,
            )  # fmt: skip
        ready = self.process.stdout.readline()  # after its imports; empty if it died
        if ready.strip() != b"ready":
            self.process.kill()
            raise RuntimeError(f"the test zygote did not start:\n{self.log.read_text()[-8000:]}")

    def close(self) -> None:
        """End the zygote (closing its stdin ends it and the ranks it still runs) and wait for it."""
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for path in self.directory.iterdir():
            path.unlink()
        self.directory.rmdir()

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, script: str, args: list[str], env: dict, log: Path) -> _Rank:
        """:func:`start`."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(self.socket))
        request = {"script": script, "args": args, "env": env, "cwd": os.getcwd(), "log": str(log)}
        connection.sendall(json.dumps(request).encode() + b"\n")
        rank = _Rank(connection)
        pid = rank.line(None)
        if not pid:
            connection.close()
            raise RuntimeError(f"the test zygote did not start {script}:\n{self.log.read_text()[-8000:]}")
        rank.pid = int(pid)
        return rank


class _Rank:
    """A rank forked by the zygote, as much of :class:`subprocess.Popen` as :class:`~_machine.Concurrently` uses
    (``pid``, :meth:`poll`, :meth:`wait`): the zygote, its parent, sends its pid, then its exit status."""

    def __init__(self, connection: socket.socket) -> None:
        self.pid, self.returncode, self._connection, self._buffer = 0, None, connection, b""
        self._lock = threading.Lock()

    def line(self, timeout: float | None) -> bytes | None:
        """The zygote's next line (empty: it closed the connection), or ``None`` after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            chunk = self._connection.recv(256)
            if not chunk:
                return b""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        return self.wait(0.0)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status (``-N``: ended by signal ``N``, as :class:`subprocess.Popen` says it), or ``None`` if the
        rank still runs after ``timeout`` seconds (``None``: however long it takes)."""
        with self._lock:
            if self.returncode is None:
                line = self.line(timeout)
                if line is None:
                    return None
                self.returncode = int(line) if line else -signal.SIGKILL  # no status: the zygote itself died
                self._connection.close()
            return self.returncode

    def signal(self, number: int) -> None:
        """Send ``number`` to the rank's session (the rank and anything it started), unless it has ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, number)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()
_recorded: dict[tuple, list[dict]] = {}
_recorded_lock = threading.Lock()


def _running_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = _Zygote()
            atexit.register(_zygote.close)
        return _zygote


def start(script: str, args: list[str], env: dict, log: Path) -> _Rank:
    """Start ``script`` with ``args`` as ``python script args`` would, in a child of the zygote (started if none runs),
    in a session of its own, with ``env`` as its whole environment and its output appended to ``log``."""
    return _running_zygote().fork(script, args, env, log)


def launch(
    script: str,
    args: list[str],
    *,
    processes: int,
    env: dict,
    timeout: float,
    config: Path,
    track=None,
) -> tuple[int, str]:
    """Run ``script`` with ``args`` on ``processes`` ranks forked by the zygote, each in the environment ``accelerate
    launch --config_file config`` gives it (one process: ``python script``'s, ``env``); return the exit status (0, or
    torchrun's 1 when a rank failed: the others then get SIGTERM) and the ranks' output. After ``timeout`` seconds
    every rank is killed and an AssertionError carries the output; whatever ends the wait, no rank outlives it.
    ``track``: called with each rank as it starts (:meth:`~_machine.Concurrently.track`)."""
    from torch.distributed import TCPStore

    launcher = _launcher_environment(config, processes, env) if processes > 1 else [{}]
    directory = Path(tempfile.mkdtemp(prefix="hf_odc_zygote_launch_"))
    log, ranks, store = directory / "output.txt", [], None
    log.touch()
    if processes > 1:  # the agent store torchrun hosts for its ranks (TORCHELASTIC_USE_AGENT_STORE)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_id = f"zygote-{uuid.uuid4().hex[:12]}"
    try:
        for rank, variables in enumerate(launcher):
            own = {**env, **variables}
            if store is not None:
                own |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": run_id,
                        "TORCHELASTIC_ERROR_FILE": str(directory / f"error{rank}.json")}  # fmt: skip
            ranks.append(start(script, args, own, log))
            if track is not None:
                track(ranks[-1])
        returncode = _wait(ranks, time.monotonic() + timeout)
        if returncode is None:
            raise AssertionError(f"{script} {' '.join(args)} ran past {timeout:g} s:\n{log.read_text()[-16000:]}")
        return returncode, log.read_text()
    finally:
        for rank in ranks:
            rank.signal(signal.SIGKILL)
            rank.wait()
        del store
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def _wait(ranks: list[_Rank], deadline: float) -> int | None:
    """As torchrun waits for its ranks: 0 once all exit 0; when one fails, SIGTERM the others and, after a grace,
    SIGKILL, then 1 (one process: its own status); ``None`` at ``deadline``."""
    failed = None
    while True:
        statuses = [rank.poll() for rank in ranks]
        if failed is None and any(status not in (None, 0) for status in statuses):
            failed = time.monotonic()
            for rank in ranks:
                rank.signal(signal.SIGTERM)
        if all(status is not None for status in statuses):
            if len(ranks) == 1:
                return statuses[0]
            return 0 if failed is None else 1
        if failed is not None and time.monotonic() > failed + _GRACE_S:
            for rank in ranks:
                rank.signal(signal.SIGKILL)
        if time.monotonic() > deadline:
            return None
        next(rank for rank, status in zip(ranks, statuses, strict=True) if status is None).wait(0.2)


def _launcher_environment(config: Path, processes: int, env: dict) -> list[dict]:
    """What ``accelerate launch --config_file config --num_processes processes`` adds to ``env`` for each rank (or
    changes in it), recorded from a real launch of this file, once per config text, count and environment."""
    key = (Path(config).read_text(), processes, tuple(sorted(env.items())))
    with _recorded_lock:
        if key not in _recorded:
            with tempfile.TemporaryDirectory(prefix="hf_odc_zygote_record_") as directory:
                accelerate = Path(sys.executable).with_name("accelerate")
                prefix = os.path.join(directory, "rank")
                command = [str(accelerate), "launch", "--config_file", str(config), "--num_processes", str(processes),
                           __file__, "record", prefix]  # fmt: skip
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(f"recording the launcher's environment failed:\n{done.stdout}{done.stderr}")
                seen = [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in range(processes)]
            _recorded[key] = [{k: v for k, v in rank.items() if env.get(k) != v} for rank in seen]
        return _recorded[key]


# -- the zygote's side -------------------------------------------------------------------------------------------------


def _serve(path: str) -> tuple[dict, None]:
    """Import :data:`PRELOAD`, then fork a child for each request on the socket at ``path`` and tell the requester its
    pid and, when it ends, its exit status. Returns only in a child (its request); exits when stdin closes (pytest
    ended), killing the children still running."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    trl = sys.modules["trl"]
    for name in TRL_CLASSES:
        getattr(trl, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector, children = selectors.DefaultSelector(), {}  # pidfd -> (pid, connection)
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "pytest")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "pytest":  # EOF: the caller ended
                for pid, _ in children.values():
                    _kill_session(pid)
                sys.exit(0)
            if key.data == "request":
                connection, _ = listener.accept()
                request = json.loads(connection.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    connection.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    return request
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, connection)
                selector.register(pidfd, selectors.EVENT_READ, "exit")
                _send(connection, pid)
            else:
                pid, connection = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(connection, os.waitstatus_to_exitcode(status))
                connection.close()


def _send(connection: socket.socket, number: int) -> None:
    with contextlib.suppress(OSError):  # the requester gave up on it (killed it after a timeout)
        connection.sendall(f"{number}\n".encode())


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _become(request: dict) -> None:
    """In a forked child: become the process ``python script args`` would be, started with ``request["env"]``."""
    os.setsid()  # a session of its own: the caller ends it and whatever it starts with one killpg
    output = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)  # as PYTHONUNBUFFERED, which torchrun's -u sets
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    import numpy
    import torch

    numpy.random.seed()  # a process of its own draws its own seed; forked ones would share the zygote's
    threads = request["env"].get("OMP_NUM_THREADS")  # read by OpenMP when torch loaded, in the zygote's environment
    if threads is not None:
        torch.set_num_threads(int(threads))


def _record(prefix: str) -> None:
    """A rank of the recording launch: save this process's environment."""
    rank = os.environ["RANK"]
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(dict(os.environ)))


if __name__ == "__main__":
    if sys.argv[1] == "record":
        _record(sys.argv[2])
    else:
        import runpy

        request = _serve(sys.argv[2])
        _become(request)
        runpy.run_path(request["script"], run_name="__main__")
