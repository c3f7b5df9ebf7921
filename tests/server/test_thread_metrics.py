"""tandem:threads: one series per host task from the start (0 until the split is recorded),
then the planned split's counts."""
from prometheus_client.parser import text_string_to_metric_families

from scheduler.planning.threads import THREAD_TASKS, ThreadSplit
from server.metrics import Metrics


def thread_series(metrics: Metrics) -> dict[str, float]:
    families = {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}
    return {sample.labels["task"]: sample.value for sample in families["tandem:threads"].samples}


def test_every_task_has_a_series_before_and_after_the_split_is_recorded():
    metrics = Metrics("m")
    assert thread_series(metrics) == {task: 0.0 for task in THREAD_TASKS}
    metrics.record_threads(ThreadSplit(gpu_threads=3, cpu_threads=5, copy_threads=2, io_threads=4))
    assert thread_series(metrics) == {"gpu": 3.0, "cpu": 5.0, "copy": 2.0, "io": 4.0}
