"""Images on every host before the first step: prepare jobs pinned to each live worker host, each importing
the task images into its own host's store, with a line per host; the RL driver does it at start."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sprout.errors import SproutError
from sprout.jobs.hosts import HostImages, prepare_hosts
from sprout.jobs.payloads import PrepareResult
from sprout.runstore.client import RunStoreClient
from sprout.sandbox import ImageNotFound, Store
from sprout.sandbox.store import default_root
from tests.conftest import REPO, RUNTIME_BIN, drop_store, free_port
from tests.rl_driver.test_driver import DriverProcess, stop_fleet, write_config
from tests.services.test_services import services


def worker(url: str, token_file: Path, host: str, store: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sprout.worker", "serve", "--url", url, "--token-file", str(token_file),
         "--host-id", host, "--lease", "5"],
        cwd=REPO, env={**os.environ, "SPROUT_STORE": str(store), "SPROUT_RUNTIME_BIN": str(RUNTIME_BIN)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_prepare_imports_the_images_on_every_live_host(tasks, tmp_path):
    tasks_dir, prompt, _ = tasks
    image = prompt["metadata"]["image"]
    store_a, store_b = Store().root, default_root() / "test-stores" / f"prepare-b-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "cfg"
    assert services(cfg, "init", "--port", str(free_port())).returncode == 0
    up = services(cfg, "up", "runstore-api")
    workers: list[subprocess.Popen] = []
    driver = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(cfg, "env").stdout.split()[1:])
        client = RunStoreClient(exports["SPROUT_RUNSTORE_URL"], exports["SPROUT_RUNSTORE_TOKEN"])
        token = cfg / "secrets" / "worker.token"
        workers += [worker(exports["SPROUT_RUNSTORE_URL"], token, "host-a", store_a),
                    worker(exports["SPROUT_RUNSTORE_URL"], token, "host-b", store_b)]
        deadline = time.monotonic() + 60
        while sorted(h.name for h in client.hosts()) != ["host-a", "host-b"]:
            assert time.monotonic() < deadline, "the workers never registered their hosts"
            time.sleep(0.5)
        with pytest.raises(ImageNotFound):
            Store(store_b).image(image)  # host b's store is new: the first sample there would import it

        env = {**os.environ, **exports}
        cli = subprocess.Popen([sys.executable, "-m", "sprout", "rl-driver", "prepare", "--tasks-dir", tasks_dir,
                                "-o", tmp_path / "miles.jsonl", "--hosts"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not any(j.state == "leased" and j.lease_host == "host-b" for j in client.list(kind="prepare").jobs):
            assert time.monotonic() < deadline and cli.poll() is None, "host b never took its prepare job"
            time.sleep(0.1)
        workers[1].send_signal(signal.SIGKILL)  # killed during its prepare job: the job waits for host b again
        workers[1].wait()
        workers.append(worker(exports["SPROUT_RUNSTORE_URL"], token, "host-b", store_b))
        out, err = cli.communicate(timeout=600)
        prepared = subprocess.CompletedProcess(cli.args, cli.returncode, out, err)
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        assert "preparing 2 task image(s) on every live worker host" in prepared.stdout
        for host in ("host-a", "host-b"):
            assert f"  {host}: 2 ready, 0 failed" in prepared.stdout
        assert Store(store_b).image(image).key == Store(store_a).image(image).key  # the same image on both

        jobs = sorted(client.list(kind="prepare").jobs, key=lambda j: j.host or "")
        assert [(j.host, j.lease_host, j.state) for j in jobs] == [  # each ran on the host it named
            ("host-a", "host-a", "succeeded"), ("host-b", "host-b", "succeeded")]
        assert [j.lease_expiries for j in jobs] == [0, 1]  # host b's, after its killed worker's lease expired
        assert not Store(store_b).sandboxes()
        missing = tmp_path / "no-such-task"
        results = prepare_hosts(client, [tasks_dir / "py-bugfix", missing], hosts=["host-b"])
        assert [(r.host, list(r.ready), list(r.failed)) for r in results] == [
            ("host-b", [str(tasks_dir / "py-bugfix")], [str(missing)])]  # one task's problem, the other ready
        with pytest.raises(SproutError, match="no live worker on host.s. host-z"):
            prepare_hosts(client, [tasks_dir / "py-bugfix"], hosts=["host-a", "host-z"])

        # the RL driver sends its tasks to every live host at start and logs what each holds
        driver = DriverProcess(write_config(tmp_path / "driver.json", tasks_dir, prepare_hosts=True), free_port(),
                               env=exports).start()
        deadline = time.monotonic() + 120
        while not all(f"host {h}: 2 task image(s) ready, 0 failed" in driver.log.read_text()
                      for h in ("host-a", "host-b")):
            assert time.monotonic() < deadline, driver.log.read_text()
            time.sleep(0.5)
    finally:
        stop_fleet(driver, workers, cfg)
        drop_store(store_b)


def test_samples_prefer_the_hosts_that_hold_their_image(tmp_path):
    images = HostImages()
    task, other = tmp_path / "task", tmp_path / "other"
    assert images.host_for(task) is None  # nothing known: any host
    images.add(PrepareResult(host="a", ready={str(task): "img"}))
    images.add(PrepareResult(host="b", ready={str(task): "img"}, failed={str(other): "pull failed"}))
    images.add(PrepareResult(host="c", failed={str(task): "pull failed"}))
    assert sorted({images.host_for(task) for _ in range(4)}) == ["a", "b"]  # in turn, never c
    assert images.host_for(other) is None
