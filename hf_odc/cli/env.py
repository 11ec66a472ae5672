"""``hf-odc env``: what a bug report needs, as TRL's ``trl env`` prints it for TRL, plus what ODC runs on: the
versions of hf_odc and the libraries it drives, the devices, the transport a training process here would pick and
whether it can run, CUDA symmetric memory and NVLink, the Accelerate config ``hf-odc sft`` would launch with, and the
``HF_ODC_*`` variables set."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from .._env import PREFIX, env

_PACKAGES = ("hf-odc", "torch", "transformers", "trl", "accelerate", "datasets", "peft", "triton", "vllm", "numpy")


def environment() -> dict[str, str]:
    """The report, one line a key."""
    import torch

    from .launch import default_config_name, shipped_config

    cuda = torch.cuda.is_available()
    info = {"Platform": platform.platform(), "Python": platform.python_version()}
    info |= {package: _version(package) for package in _PACKAGES}
    info["hf-odc"] += _checkout()
    info["Devices"] = _devices(torch)
    info["ODC transport"] = _transport(torch, cuda)
    info["CUDA symmetric memory"] = _symmetric_memory(torch, cuda)
    info["NVLink"] = _nvlink(cuda)
    config = default_config_name(cuda)
    info["hf-odc sft's Accelerate config"] = f"{config} ({shipped_config(config)})"
    variables = {name: value for name, value in sorted(os.environ.items()) if name.startswith(PREFIX)}
    info["HF_ODC_* variables"] = ", ".join(f"{name}={value}" for name, value in variables.items()) or "none set"
    return info


def print_env() -> None:
    """Print :func:`environment` to paste into a bug report."""
    lines = "\n".join(f"- {key}: {value}" for key, value in environment().items())
    print(f"Copy-paste the following when you report an issue:\n\n{lines}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _checkout() -> str:
    """Where hf_odc is imported from, with its git commit when that is a checkout (a bug report's exact code)."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return f"+{commit} ({root})" if commit else f" ({root})"


def _devices(torch) -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} CUDA: " + ", ".join(names) + f" (CUDA {torch.version.cuda})"
    return f"CPU only ({os.cpu_count()} cores)"


def _transport(torch, cuda: bool) -> str:
    """The transport a process here picks (``HF_ODC_TRANSPORT``, else the device's), and whether it can run."""
    from ..kernels.transports import TRANSPORTS

    name = env("TRANSPORT") or next(n for n, device in TRANSPORTS.items() if device == ("cuda" if cuda else "cpu"))
    source = "HF_ODC_TRANSPORT" if env("TRANSPORT") else "the device's"
    if TRANSPORTS.get(name) == "cpu":
        usable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        free = shutil.disk_usage("/dev/shm").free / 2**30 if usable else 0.0
        state = f"/dev/shm writable, {free:.1f} GiB free" if usable else "needs a writable /dev/shm, and there is none"
    elif TRANSPORTS.get(name) == "cuda":
        state = "usable" if cuda and _symmetric_memory(torch, cuda) == "available" else "not usable here"
    else:
        state = f"unknown: hf_odc has {', '.join(TRANSPORTS)}"
    return f"{name} ({source}; {state})"


def _symmetric_memory(torch, cuda: bool) -> str:
    if not cuda:
        return "no (no CUDA device)"
    from .._compat import symmetric_memory

    try:
        symmetric_memory()
    except Exception as error:  # a torch without it, or whose layout hf_odc does not know
        return f"no ({' '.join(str(error).split())})"
    return "available"


def _nvlink(cuda: bool) -> str:
    """Whether the GPUs link through NVLink, from ``nvidia-smi topo -m`` (``NV<n>`` between two GPUs)."""
    if not cuda:
        return "no (no CUDA device)"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        topology = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    links = sorted(set(re.findall(r"\bNV\d+\b", topology)))
    return f"yes ({', '.join(links)} between GPUs)" if links else "no (nvidia-smi topo -m shows none)"
