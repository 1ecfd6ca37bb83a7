"""`vllm serve` as users type it, in a subprocess, for the server tests: the virtual environment's
`vllm` console script (which `make install` points at `vllm_ddtree.cli`), on 127.0.0.1 and a free
port, one OpenMP thread, stopped by its PID (SIGTERM, then SIGKILL) whatever happens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class Served:
    """A running server: its base URL, the model name it serves (the target's path), its log file and
    how long it took to start."""

    url: str
    model: str
    log_path: Path
    start_s: float


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


@contextmanager
def vllm_serve(target: str, speculative_config: dict[str, Any], args: list[str], log_dir: Path) -> Iterator[Served]:
    """`vllm serve target --speculative-config ... *args` until the context exits; fails the test
    with the log's tail if the server does not answer /health within STARTUP_TIMEOUT_S."""
    port = _free_port()
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    command = [vllm, "serve", target, "--host", "127.0.0.1", "--port", str(port), *args,
               "--speculative-config", json.dumps(speculative_config)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1"}
    log_path = log_dir / "server.log"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if get(f"{url}/health") == "":
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"server did not start; log tail:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Served(url=url, model=target, log_path=log_path, start_s=time.monotonic() - started)
    finally:
        _stop(process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
