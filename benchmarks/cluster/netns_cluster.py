"""A two-node Ray cluster on this host: each node in its own network namespace, the two joined by a
veth pair shaped to 1 Gbit/s, so that the ranks of `tandem serve -tp 2 --ray-address` meet over a
network link as on two hosts. A third veth pair links the test or benchmark process (the root
namespace) to the head's namespace, where the server listens. Needs root and iproute2 (ip, tc).
`make test-multinode` and `make bench-multinode` build it."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACES = ("tandem-n0", "tandem-n1")  # the head's node, the worker's node
NODE_LINK = ("tandem-v0", "tandem-v1")  # the veth pair between the nodes, one end in each
NODE_IPS = ("10.77.0.1", "10.77.0.2")
CLIENT_LINK = ("tandem-h", "tandem-h0")  # the test process's end (root namespace), the head's end
CLIENT_IPS = ("10.77.1.1", "10.77.1.2")
PREFIX_LEN = 24
# The rate of a datacenter link; netem (delay, loss) is not in every kernel, tbf is.
SHAPING = ("tbf", "rate", "1gbit", "burst", "32kbit", "latency", "50ms")
RAY_PORT = 6379  # each namespace has a network of its own: no other cluster can hold the port
OBJECT_STORE_BYTES = 256 * 2**20  # the ranks pass plans and tokens only; Ray's default takes 30% of memory
NODE_START_TIMEOUT_S = 120.0
PROCESS_EXIT_TIMEOUT_S = 10.0
RAY = str(Path(sys.executable).with_name("ray"))
SHARED_MEMORY = Path("/dev/shm")
SEMAPHORE_KINDS = ("hdr", "obj")  # Ray's mutable objects' semaphores: /dev/shm/sem.<kind><pid>-<n>
REQUIRED_TOOLS = ("ip", "tc", "taskset")
# Set for every Ray process and the driver: the ranks import this checkout, and token authentication
# is off on every node alike (a token in ~/.ray/auth_token turns it on for a head started without
# RAY_AUTH_MODE, and a joining node then cannot authenticate).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}


@dataclass(frozen=True)
class Cluster:
    """The running cluster: where the driver joins it, and where a server in the head's namespace
    is reached from the test process."""

    address: str  # host:port of the head's GCS
    head_namespace: str
    worker_namespace: str
    server_host: str  # the head namespace's address on the test process's link


def node_cores(namespace: str) -> list[int]:
    """The cores of the node in `namespace`: this host's cut in two, so each node's processes (its
    Ray daemons and actors, and on the head's a server) compute on cores of their own, as on two hosts."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // len(NAMESPACES))
    index = NAMESPACES.index(namespace)
    return cores[index * half:(index + 1) * half] or cores


def netns_exec(namespace: str) -> tuple[str, ...]:
    """The command prefix that runs a command in `namespace`, on its node's cores."""
    return ("ip", "netns", "exec", namespace, "taskset", "-c", ",".join(map(str, node_cores(namespace))))


def missing_requirements() -> str | None:
    """Why the cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run `make test-multinode` as root)"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt-get install iproute2 util-linux)"
    return None


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()}")


def create_network() -> None:
    """The namespaces, their loopback (Ray's processes talk over it too), the shaped node link and
    the test process's link."""
    for namespace in NAMESPACES:
        _run("ip", "netns", "add", namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
    _run("ip", "link", "add", NODE_LINK[0], "type", "veth", "peer", "name", NODE_LINK[1])
    for namespace, device, address in zip(NAMESPACES, NODE_LINK, NODE_IPS):
        _run("ip", "link", "set", device, "netns", namespace)
        _add_address(namespace, device, address)
        _run(*netns_exec(namespace), "tc", "qdisc", "add", "dev", device, "root", *SHAPING)
    _run("ip", "link", "add", CLIENT_LINK[0], "type", "veth", "peer", "name", CLIENT_LINK[1])
    _run("ip", "link", "set", CLIENT_LINK[1], "netns", NAMESPACES[0])
    _run("ip", "addr", "add", f"{CLIENT_IPS[0]}/{PREFIX_LEN}", "dev", CLIENT_LINK[0])
    _run("ip", "link", "set", CLIENT_LINK[0], "up")
    _add_address(NAMESPACES[0], CLIENT_LINK[1], CLIENT_IPS[1])


def _add_address(namespace: str, device: str, address: str) -> None:
    _run("ip", "-n", namespace, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", device)
    _run("ip", "-n", namespace, "link", "set", device, "up")


def start_nodes(temp_dir: Path) -> Cluster:
    """A Ray head in the first namespace and a worker node joining it from the second, one CPU each:
    two ranks asking a CPU each land on different nodes. Each node keeps its own temp dir (their
    sessions would otherwise share /tmp/ray)."""
    address = f"{NODE_IPS[0]}:{RAY_PORT}"
    common = ("--num-cpus", "1", "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats")
    _start_node(NAMESPACES[0], "--head", "--port", str(RAY_PORT), "--include-dashboard", "false",
                "--node-ip-address", NODE_IPS[0], "--temp-dir", str(temp_dir / "n0"), *common)
    _start_node(NAMESPACES[1], "--address", address, "--node-ip-address", NODE_IPS[1],
                "--temp-dir", str(temp_dir / "n1"), *common)
    return Cluster(address, NAMESPACES[0], NAMESPACES[1], CLIENT_IPS[1])


def _start_node(namespace: str, *flags: str) -> None:
    """`ray start` returns once the node's daemons run; they stay in the namespace."""
    command = (*netns_exec(namespace), RAY, "start", *flags)
    result = subprocess.run(command, env={**os.environ, **RAY_ENV}, capture_output=True, text=True,
                            timeout=NODE_START_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"ray start in {namespace} exited {result.returncode}:\n{result.stderr[-4000:]}")


def namespace_of(pid: int) -> str | None:
    """The named network namespace process `pid` is in (None: the root one, or none named)."""
    result = subprocess.run(("ip", "netns", "identify", str(pid)), capture_output=True, text=True)
    return result.stdout.strip() or None


def kill_namespace(namespace: str) -> None:
    """SIGKILL every process in `namespace` (a node's Ray daemons and workers, a server) and wait
    for them to go: `ray stop` would stop every Ray process on the host, the other node's too."""
    pids = _pids_in(namespace)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + PROCESS_EXIT_TIMEOUT_S
    while _pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    _remove_semaphores(pids)


def _remove_semaphores(pids: list[int]) -> None:
    """The semaphores of Ray's compiled-graph channels that a killed raylet leaves in /dev/shm, named
    after its pid (one that stops cleanly removes them)."""
    for pid in pids:
        for kind in SEMAPHORE_KINDS:
            for path in SHARED_MEMORY.glob(f"sem.{kind}{pid}-*"):
                path.unlink(missing_ok=True)


def _pids_in(namespace: str) -> list[int]:
    result = subprocess.run(("ip", "netns", "pids", namespace), capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()]


def _existing_namespaces() -> set[str]:
    listed = subprocess.run(("ip", "netns", "list"), capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def tear_down() -> None:
    """Every node stopped and every namespace deleted, whatever of them exists (also what a killed
    run left behind); deleting a namespace deletes the veth ends in it, and so their peers."""
    for namespace in NAMESPACES:
        if namespace in _existing_namespaces():
            kill_namespace(namespace)
            subprocess.run(("ip", "netns", "delete", namespace), capture_output=True)


def make_temp_dir() -> Path:
    """Short: Ray's unix sockets live under it, and a socket's path holds at most 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="tandem-ray-"))


@contextlib.contextmanager
def running_cluster():
    """The cluster for the duration of the block, torn down after (and what a killed run left
    behind, before); RuntimeError saying why where it cannot be built here."""
    reason = missing_requirements()
    if reason is not None:
        raise RuntimeError(f"cannot build the two-node cluster: {reason}")
    tear_down()
    temp_dir = make_temp_dir()
    try:
        create_network()
        yield start_nodes(temp_dir)
    finally:
        tear_down()
        shutil.rmtree(temp_dir, ignore_errors=True)
