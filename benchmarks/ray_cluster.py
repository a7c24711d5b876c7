"""A throwaway Ray cluster on 127.0.0.1, started as users start one (`ray start`), for the ray suite and
tests/test_ray_batch.py: a head and more nodes on this machine, each with its own CPU count, in a temp dir of
their own; at the end every process of it is killed, whatever happened (each `ray start` leads a session of its
own that its daemons and their workers stay in, so nothing of anyone else's is touched).

    with LoopbackCluster(node_cpus=[1, 1]) as cluster:       # two nodes, one CPU each
        subprocess.run([sys.executable, "-m", "nanoinfer.cli", "batch", ..., "--ray", cluster.address],
                       env=driver_env())
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 300          # one `ray start` on a loaded 2-core machine took 10 s; a hang is what this catches


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def driver_env() -> dict[str, str]:
    """The environment of a driver (ray.init) on this machine: its own address is 127.0.0.1, where the nodes are
    (left to Ray, a driver given a loopback address looks for a node at the machine's LAN address)."""
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class LoopbackCluster:
    """`ray start --head` and then `ray start --address` per further node, every node on 127.0.0.1 with
    `node_cpus[i]` CPUs; `address` is the head's HOST:PORT. A context manager: `stop()` at the end."""

    def __init__(self, node_cpus: list[int]):
        if not node_cpus:
            raise ValueError("a cluster needs at least its head node")
        self.node_cpus = node_cpus
        self.sessions: list[int] = []          # the session of each `ray start` (its pid)
        self.address = ""
        self._temp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> LoopbackCluster:
        # a short path: Ray's unix sockets live under it, and a socket path has at most 107 bytes
        self._temp = tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp", ignore_cleanup_errors=True)
        try:
            port = free_port()
            self._start(["--head", "--port", str(port), "--include-dashboard", "false",
                         "--dashboard-port", str(free_port())], self.node_cpus[0])
            self.address = f"127.0.0.1:{port}"
            for cpus in self.node_cpus[1:]:
                self._start(["--address", self.address], cpus)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, role: list[str], cpus: int) -> None:
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", *role, "--num-cpus", str(cpus),
                   "--node-ip-address", "127.0.0.1", "--temp-dir", self._temp.name, "--disable-usage-stats",
                   "--dashboard-agent-listen-port", str(free_port()), "--log-style", "record"]
        # its own session, so its pid names the session its daemons and their workers inherit (a raylet puts each
        # worker in a process group of its own, not a session)
        start = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        self.sessions.append(start.pid)
        try:
            out, _ = start.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`ray start {' '.join(role)}` did not finish in {START_TIMEOUT_S} s") from None
        if start.returncode != 0:
            raise RuntimeError(f"`ray start {' '.join(role)}` failed ({start.returncode}):\n{out[-3000:]}")

    def processes(self, name_prefix: str = "") -> list[int]:
        """The pids of this cluster's processes whose command line starts with `name_prefix` (e.g.
        "ray::MapWorker", the name Ray gives a Ray Data map actor's process). Linux: read from /proc."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getsid(int(entry)) in self.sessions and \
                        Path(f"/proc/{entry}/cmdline").read_bytes().startswith(name_prefix.encode()):
                    found.append(int(entry))
            except OSError:            # it ended meanwhile
                pass
        return found

    def stop(self) -> None:
        """Kill every process of every node (SIGKILL: nothing of a throwaway cluster needs saving), then remove
        its temp dir."""
        for _ in range(10):            # again while a raylet still alive starts workers
            members = self.processes()
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        self.sessions = []
        if self._temp is not None:
            self._temp.cleanup()
            self._temp = None
