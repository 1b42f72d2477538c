"""The RL driver as a service: `init --rl-driver-*` and `setup` write rl-driver.json and its token,
`up rl-driver` starts it next to the Run Store API, `env` exports its URL and token, `down` stops it."""

import json
import os
import shutil
import stat
from pathlib import Path

import httpx

from sprout.rl_driver.config import DriverConfig
from sprout.services import supervisor
from sprout.services.config import (
    RL_DRIVER_TOKEN_ENV,
    RLDriverService,
    ServicesConfig,
    load,
    render_rl_driver,
)
from tests.conftest import REPO, free_port
from tests.services.test_services import services


def exports(config: Path) -> dict[str, str]:
    """`services env` as variables."""
    out = services(config, "env")
    assert out.returncode == 0, out.stderr
    return dict(item.split("=", 1) for line in out.stdout.splitlines() for item in line.split()[1:])


def tasks_copy(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    shutil.copytree(REPO / "tests" / "fixtures" / "tasks" / "py-bugfix", tasks / "py-bugfix")
    return tasks


def test_init_and_setup_write_rl_driver_json_and_its_token(tmp_path):
    a, b, tasks = tmp_path / "a", tmp_path / "b", tasks_copy(tmp_path)
    init = services(a, "init", "--port", "18471", "--rl-driver-tasks-dir", str(tasks), "--rl-driver-port",
                    "11999")
    assert init.returncode == 0, init.stdout + init.stderr
    assert f"done  {a / 'rl-driver.json'}" in init.stdout
    assert load(a).rl_driver == RLDriverService(tasks_dir=str(tasks), port=11999)
    driver = DriverConfig.model_validate_json((a / "rl-driver.json").read_text())
    assert driver.ledger == str(a / "rl-driver.sqlite3") and driver.data_dir == a / "rl-driver"
    assert driver.driver_token_env == RL_DRIVER_TOKEN_ENV == "SPROUT_RL_DRIVER_TOKEN"
    assert driver.runstore_url == "http://127.0.0.1:18471"
    assert driver.runstore_token_env == "SPROUT_RUNSTORE_TOKEN"
    assert (driver.tasks_dir, driver.port, driver.miles.api_key_env) == (tasks, 11999, None)
    token_file = a / "secrets" / "rl-driver.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    files = "".join(p.read_text() for p in a.rglob("*") if p.is_file() and p != token_file)
    assert token not in files
    again = services(a, "init", "--force")
    assert f"ok    {a / 'rl-driver.json'}" in again.stdout and "(kept)" in again.stdout
    assert token_file.read_text().strip() == token

    config = load(a)  # the driver's command and environment: the Run Store's submitter token, its own token
    assert supervisor.command("rl-driver", config, a)[1:] == [
        "-m", "sprout", "rl-driver", "serve", "--config", str(a / "rl-driver.json")]
    env = supervisor.service_env(config, a, "rl-driver")
    assert env["SPROUT_RUNSTORE_URL"] == "http://127.0.0.1:18471" and env[RL_DRIVER_TOKEN_ENV] == token
    assert env["SPROUT_RUNSTORE_TOKEN"] == (a / "secrets" / "submitter.token").read_text().strip()
    assert supervisor.service_env(config, a, "runstore-worker").get(RL_DRIVER_TOKEN_ENV) == os.environ.get(
        RL_DRIVER_TOKEN_ENV)
    assert supervisor.configured(config) == ["runstore-api", "runstore-worker", "rl-driver"]

    # setup: the same answers, then a path that is not a directory (asked again), then the tasks directory
    answers = f"http://127.0.0.1:9999/v1\nMY_KEY\n18471\n3\n{tmp_path / 'nope'}\n{tasks}\n"
    setup = services(b, "setup", stdin=answers)
    assert "Harbor tasks directory for the RL driver (empty: no RL driver)" in setup.stdout
    assert "is not a directory; try again" in setup.stdout and (b / "rl-driver.json").exists(), setup.stdout
    assert load(b).rl_driver == RLDriverService(tasks_dir=str(tasks))
    assert stat.S_IMODE((b / "secrets" / "rl-driver.token").stat().st_mode) == 0o600

    # with the Run Store in PostgreSQL, the ledger's tables live next to its jobs
    db = "postgresql+psycopg://sprout@db.example/runstore"
    on_postgres = ServicesConfig(runstore_db=db, rl_driver=RLDriverService(tasks_dir=str(tasks)))
    assert DriverConfig.model_validate_json(render_rl_driver(on_postgres, a)).ledger == db

    # a reviewer makes it serve searches (miles.review); half a reviewer is one error line
    review = services(a, "init", "--rl-driver-review-endpoint", "http://127.0.0.1:9/v1", "--rl-driver-review-model",
                      "reviewer", "--rl-driver-review-key-env", "REVIEW_KEY", "--force")
    assert review.returncode == 0, review.stdout + review.stderr
    reviewer = DriverConfig.model_validate_json((a / "rl-driver.json").read_text()).miles.review
    assert (reviewer.endpoint, reviewer.model, reviewer.api_key_env) == ("http://127.0.0.1:9/v1", "reviewer",
                                                                       "REVIEW_KEY")
    half = services(tmp_path / "c", "init", "--rl-driver-tasks-dir", str(tasks), "--rl-driver-review-model", "r")
    assert half.returncode == 1 and half.stderr.strip().splitlines() == [
        "error: rl-driver: a reviewer needs both --rl-driver-review-endpoint and --rl-driver-review-model"], half.stderr

    removed = services(a, "init", "--no-rl-driver", "--force")
    assert removed.returncode == 0 and load(a).rl_driver is None
    assert "rl-driver" not in services(a, "env").stdout + services(a, "status").stdout


def test_bad_rl_driver_flags_and_preflight_give_one_line(tmp_path):
    config = tmp_path / "cfg"
    bad = services(config, "init", "--rl-driver-port", "11999")
    assert bad.returncode == 1, bad.stderr
    assert "rl-driver: --rl-driver-tasks-dir: Field required" in bad.stderr, bad.stderr
    bad = services(config, "init", "--rl-driver-tasks-dir", str(tmp_path), "--rl-driver-port", "0")
    assert bad.returncode == 1 and "--rl-driver-port: Input should be greater" in bad.stderr, bad.stderr
    assert not (config / "services.json").exists()
    assert services(config, "init").returncode == 0
    up = services(config, "up", "rl-driver")
    assert up.returncode == 1 and "rl-driver is not configured" in up.stderr
    assert "init --rl-driver-tasks-dir DIR" in up.stderr
    assert "Traceback" not in up.stderr and "rl-driver" not in services(config, "status").stdout
    gone = tmp_path / "gone"
    init = services(config, "init", "--rl-driver-tasks-dir", str(gone), "--force")
    assert init.returncode == 0 and "does not exist yet" in init.stdout
    up = services(config, "up", "rl-driver")
    assert up.returncode == 1 and f"tasks directory {gone} does not exist" in up.stderr, up.stderr
    (config / "rl-driver.json").unlink()
    up = services(config, "up", "rl-driver")
    assert up.returncode == 1 and "no rl-driver.json" in up.stderr and "init" in up.stderr, up.stderr


def test_up_status_env_rollout_groups_down(tmp_path):
    config, tasks = tmp_path / "cfg", tasks_copy(tmp_path)
    api_port, driver_port = free_port(), free_port()
    init = services(config, "init", "--port", str(api_port), "--rl-driver-tasks-dir", str(tasks),
                    "--rl-driver-port", str(driver_port))
    assert init.returncode == 0, init.stdout + init.stderr
    pids = []
    try:
        up = services(config, "up", "runstore-api")
        assert up.returncode == 0, up.stdout + up.stderr
        up = services(config, "up", "rl-driver")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "rl-driver up (GET /health 200)" in up.stdout
        infos = [json.loads((config / "run" / f"{name}.json").read_text())
                 for name in ("runstore-api", "rl-driver")]
        pids = [info[key] for info in infos for key in ("pid", "child")]
        status = services(config, "status")
        line = next(line for line in status.stdout.splitlines() if "rl-driver" in line)
        assert "healthy" in line and str(driver_port) in line, status.stdout
        assert status.stdout.count("healthy") == 2  # the worker is not up

        variables = exports(config)
        url, token = variables["SPROUT_RL_DRIVER_URL"], variables["SPROUT_RL_DRIVER_TOKEN"]
        assert url == f"http://127.0.0.1:{driver_port}" and token == (config / "secrets" / "rl-driver.token"
                                                                      ).read_text().strip()
        assert variables["SPROUT_RUNSTORE_URL"] == f"http://127.0.0.1:{api_port}"
        assert httpx.get(f"{url}/health").status_code == 200  # no token needed
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.post(f"{url}/rollout-groups", json={}, headers=headers)
            assert refused.status_code == 401 and "bearer token" in refused.json()["detail"]
        unknown = httpx.get(f"{url}/rollout-groups/no-such-group",
                            headers={"Authorization": f"Bearer {token}"})
        assert unknown.status_code == 404 and "no-such-group" in unknown.json()["detail"]
    finally:
        down = services(config, "down")
    assert "rl-driver stopped" in down.stdout and "runstore-api stopped" in down.stdout, down.stdout
    assert not list((config / "run").glob("*.json"))
    assert pids and not any(supervisor._alive(pid) for pid in pids)
    assert services(config, "status").stdout.count("not running") == 3
