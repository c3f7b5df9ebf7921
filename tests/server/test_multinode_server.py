"""`tandem serve -tp 2` and `-pp 2 --ray-address` with their ranks (stages) on two Ray nodes, each
node in a network namespace of its own and the two joined by a shaped veth link (netns_cluster.py):
greedy completions as a one-process server's, and the worker node lost mid-stream makes /health
answer 503 and the server exit 1 naming the rank that was on it."""
import time

import httpx
import openai
import pytest

from benchmarks.cluster import netns_cluster
from tandem_server import MODEL, REQUEST_TIMEOUT_S, ServerProcess, greedy_completion, rank_pids

pytestmark = pytest.mark.multinode

PROMPTS = ("The capital of France is", "def fibonacci(n):")
MAX_TOKENS = 24
DEAD_ENGINE_GRACE_S = 3
EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    reason = netns_cluster.missing_requirements()
    if reason is not None:  # asked for with --multinode: a skip would pass unnoticed in CI
        pytest.fail(f"cannot build the two-node cluster: {reason}")
    with netns_cluster.running_cluster() as running:
        yield running


def start_on_cluster(cluster, log, *flags: str) -> ServerProcess:
    """A server in the head's namespace (the driver joins the cluster on a node's network) and
    listening there, its actors spread over the nodes. A node lost: a short grace."""
    return ServerProcess(log, *flags, "--ray-address", cluster.address, "--dead-engine-grace",
                         str(DEAD_ENGINE_GRACE_S), env=netns_cluster.RAY_ENV, host=cluster.server_host,
                         prefix=netns_cluster.netns_exec(cluster.head_namespace)).start()


@pytest.fixture(scope="module")
def multinode_server(cluster, tmp_path_factory):
    """Two tensor-parallel ranks, one on each node. The last test loses a node."""
    server = start_on_cluster(cluster, tmp_path_factory.mktemp("multinode") / "serve.log", "-tp", "2")
    yield server
    server.stop()


def actor_namespaces(server, kind: str = "tensor-parallel rank") -> dict[int, str | None]:
    """rank (stage) -> the network namespace its process runs in."""
    return {rank: netns_cluster.namespace_of(pid) for rank, pid in rank_pids(server, kind).items()}


def assert_completes_as_one_process(server, http) -> None:
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as two_nodes:
        for prompt in PROMPTS:
            assert greedy_completion(two_nodes, prompt, MAX_TOKENS) == greedy_completion(http, prompt, MAX_TOKENS)


def test_ranks_on_two_nodes_complete_as_one_process(multinode_server, cluster, http):
    assert sorted(actor_namespaces(multinode_server).values()) == [cluster.head_namespace, cluster.worker_namespace]
    assert_completes_as_one_process(multinode_server, http)


def test_pipeline_stages_on_two_nodes_complete_as_one_process(multinode_server, cluster, http, tmp_path_factory):
    """The tensor-parallel server's ranks leave the nodes first (a CPU each)."""
    multinode_server.stop()
    server = start_on_cluster(cluster, tmp_path_factory.mktemp("multinode-pp") / "serve.log", "-pp", "2")
    try:
        stages = actor_namespaces(server, "pipeline stage")
        assert sorted(stages.values()) == [cluster.head_namespace, cluster.worker_namespace]
        assert_completes_as_one_process(server, http)
    finally:
        server.stop()
    multinode_server.start()


def test_a_lost_node_makes_health_503_and_the_server_exit(multinode_server, cluster):
    """The module's last test: the worker node does not come back."""
    lost_rank, = [rank for rank, namespace in actor_namespaces(multinode_server).items()
                  if namespace == cluster.worker_namespace]
    two_nodes = openai.OpenAI(base_url=f"{multinode_server.url}/v1", api_key="unused", max_retries=0,
                              timeout=REQUEST_TIMEOUT_S)
    stream = two_nodes.completions.create(model=MODEL, prompt="Count to one hundred:", max_tokens=400,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # generating
    netns_cluster.kill_namespace(cluster.worker_namespace)  # its raylet and the rank's process
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    health = httpx.get(f"{multinode_server.url}/health", timeout=5.0)
    assert health.status_code == 503
    assert f"rank {lost_rank}" in health.json()["error"]["message"]
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while multinode_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert multinode_server.proc.returncode == 1, multinode_server.log_tail()
    assert f"tandem serve: exiting: the engine loop died: tensor-parallel rank {lost_rank}" \
        in multinode_server.log_tail()
