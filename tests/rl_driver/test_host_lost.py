"""A whole host lost mid-group, over a Run Store with two hosts (two btrfs stores on this machine): its
worker and, with it, its checkpoint server are SIGKILLed. The root it was running is run again on the
other host once its lease lapses; a branch from a checkpoint only the dead host held fails with the reason
in `failed_samples`; the group ends within its wall time."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sprout.sandbox import Store
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, RUNTIME_BIN, free_port
from tests.rl_driver.test_driver import (
    DriverProcess,
    MilesShapedClient,
    endpoint_of,
    group_request,
    stop_fleet,
    write_config,
)
from tests.rl_driver.test_search import CONTINUE, SUBMIT, branch_submits, recount, reviewer_script, search
from tests.services.test_services import services

WALL_S = 150.0


def root(name: str, slow_s: float = 0.0) -> list[dict]:
    """A root that echoes twice and submits without fixing anything; its second call waits `slow_s`."""
    return [{"thought": "start", "command": f"echo {name}-one", "match": "Fix it so that"},
            {"thought": "next", "command": f"echo {name}-two", "match": f"{name}-one", "delay_s": slow_s},
            {"thought": "done", "command": SUBMIT, "match": f"{name}-two"}]


def start_worker(exports: dict, cfg: Path, host: str, store: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sprout.worker", "serve", "--url", exports["SPROUT_RUNSTORE_URL"], "--token-file",
         str(cfg / "secrets" / "worker.token"), "--host-id", host, "--slots", "2", "--lease", "5", "--ship-listen",
         "127.0.0.1:0"],
        cwd=REPO, env={**os.environ, "SPROUT_STORE": str(store), "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN),
                       "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def graded(data: Path) -> int:
    return len(list(data.glob("groups/*/slot-*/grade.json")))


def test_a_host_lost_mid_search_reruns_its_root_elsewhere_and_fails_the_branch_it_alone_could_start(
        tasks, tmp_path, base_store, other_store):
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(cfg, "up", "runstore-api")
    workers: list[subprocess.Popen] = []
    driver = None
    checkpoints = {c.id for c in base_store.checkpoints()}
    # alpha finishes on host-a; beta is in its slow second call there when host-a dies, and runs again
    # (the spare beta) on host-b; the reviewer puts both roots' branch points at turn 2
    policy = root("alpha") + root("beta", slow_s=20.0) + root("beta") + branch_submits(1)
    review = reviewer_script("alpha", 2, None) + reviewer_script("beta", 2, None)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        workers.append(start_worker(exports, cfg, "host-a", base_store.root))
        with ScriptedModelServer(policy) as model, ScriptedModelServer(review) as reviewer:
            config = write_config(tmp_path / "driver.json", tasks[0], branch_affinity_s=5.0, miles={
                "review": {"endpoint": reviewer.base_url, "model": "reviewer", "continuation_prompt": CONTINUE}})
            driver = DriverProcess(config, free_port(), env=exports).start()
            spec = search(roots=2)
            request = group_request(tasks[1], endpoint_of(model), 4, minimum_returned_samples=1, search=spec,
                                    budgets={"max_wall_time_seconds": WALL_S}, finalization_timeout_seconds=60.0)
            started = time.monotonic()

            def lose_host_a(_: dict) -> None:
                if len(workers) == 1 and graded(tmp_path / "data") >= 1:  # alpha done, beta mid-rollout
                    workers[0].send_signal(signal.SIGKILL)
                    workers[0].wait()
                    workers.append(start_worker(exports, cfg, "host-b", other_store.root))

            result = MilesShapedClient(driver.url).run_group(request, on_running=lose_host_a)
            took = time.monotonic() - started
        assert len(workers) == 2, "host-a was not lost mid-group"
        assert took < WALL_S
        assert recount(result, request) == "FF" and result["status"] == "early_stopped"
        hosts = {}
        for t in result["trajectories"]:
            labels = t["metadata"]["search"]
            name = "alpha" if "alpha-one" in str(t["messages"]) else "beta"
            hosts[f"{labels['kind']} {name}"] = t["metadata"]["host"]
        assert hosts == {"root alpha": "host-a", "root beta": "host-b", "student beta": "host-b"}
        (failed,) = result["failed_samples"]
        assert "CheckpointUnavailable" in failed["reason"] and "host-a" in failed["reason"], failed
        assert "does not answer" in failed["reason"]
        # beta's first run died before its last call: one submit step is left over, and no other
        assert [step.match for step in model.remaining] == ["beta-two"] and not reviewer.remaining
    finally:
        stop_fleet(driver, workers, cfg)
        # the killed worker's sandbox (beta's first run) is reaped: its owner process is gone
        Store(base_store.root, runtime_bin=RUNTIME_BIN).gc()
    assert {c.id for c in base_store.checkpoints()} <= checkpoints
