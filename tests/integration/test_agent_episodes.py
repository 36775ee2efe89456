"""Agent episodes on Ray worker processes (agent/episodes.py): overlapping runs (a pool source's batches in
flight) that time out on the same process replace it once, and go on."""

from __future__ import annotations

import threading

from hybridflow.agent.episodes import EpisodeRunner

PROGRAM = '''
import time

def run_episode(task, base_url, api_key, session_id):
    if task["hang"]:
        time.sleep(600)
    return 1.0
'''


def test_overlapping_runs_replace_a_hung_process_once(tmp_path, ray_cluster):
    path = tmp_path / "agent.py"
    path.write_text(PROGRAM)
    runner = EpisodeRunner(f"{path}:run_episode", processes=2, per_process=8, timeout_s=4.0)
    try:
        first = list(runner.workers)
        tasks = [{"hang": i % 4 == 0} for i in range(8)]  # tasks 0 and 4 run on process 0: they hang
        results, errors = {}, []

        def one(label: str) -> None:
            try:
                results[label] = runner.run(tasks, "http://unused", "key", [f"{label}/{i}" for i in range(8)])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(f"b{k}",)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for outcomes in results.values():  # a run's hung episode timed out, or died with the process replaced
            assert all(outcomes[i].error is not None for i in (0, 4))
            assert [outcomes[i].reward for i in (1, 2, 3, 5, 6, 7)] == [1.0] * 6
        assert any(outcomes[0].error == "timeout" for outcomes in results.values())
        assert runner.workers[0] != first[0] and runner.workers[1] == first[1]
        replaced = list(runner.workers)
        runner._replace_hung([first[0]])  # a run late to see its hung process gone replaces nothing more
        assert runner.workers == replaced
        after = runner.run([{"hang": False}] * 2, "http://unused", "key", ["c/0", "c/1"])
        assert [o.reward for o in after] == [1.0, 1.0]
    finally:
        runner.close()
