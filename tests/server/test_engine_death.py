"""The engine loop's death: a step that cannot go on (a lost tensor-parallel rank) ends the loop,
reports why, and tells the server, which exits after its grace; any other failed step fails the
requests in flight and the loop goes on."""
import threading
import time
from types import SimpleNamespace

from engine.async_engine import AsyncEngine
from engine.runtime.runner import FatalRunnerError
from server.cli import ExitWhenDead

WAIT_S = 5.0


class FailingEngine:
    """Stands in for LLMEngine: every step raises `error` (until `heal` is set)."""

    def __init__(self, error: Exception) -> None:
        self.error, self.num_steps, self.healed = error, 0, threading.Event()

    def has_unfinished_requests(self) -> bool:
        return not self.healed.is_set()

    def step(self):
        self.num_steps += 1
        raise self.error

    def abort_request(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def wait_until(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_fatal_step_ends_the_loop_and_tells_the_server():
    reasons = []
    loop = AsyncEngine(FailingEngine(FatalRunnerError("tensor-parallel rank 1 died: killed")), on_dead=reasons.append)
    loop.start()
    assert wait_until(lambda: reasons)
    assert not loop.is_running and reasons == [loop.dead_reason]
    assert loop.dead_reason == "the engine loop died: tensor-parallel rank 1 died: killed"


def test_another_failed_step_fails_the_batch_and_the_loop_goes_on():
    reasons = []
    engine = FailingEngine(ValueError("one bad step"))
    loop = AsyncEngine(engine, on_dead=reasons.append)
    loop.start()
    assert wait_until(lambda: engine.num_steps >= 3)
    assert loop.is_running and not reasons
    engine.healed.set()
    loop.shutdown()
    assert not reasons  # a shutdown is no death


def test_the_server_exits_after_its_grace():
    exit_when_dead = ExitWhenDead(grace_s=0.2)
    exit_when_dead.server = SimpleNamespace(should_exit=False)
    start = time.monotonic()
    exit_when_dead("the engine loop died: rank 1")
    assert not exit_when_dead.server.should_exit  # /health answers 503 meanwhile
    assert wait_until(lambda: exit_when_dead.server.should_exit)
    assert time.monotonic() - start >= 0.2 and exit_when_dead.reason == "the engine loop died: rank 1"
