"""`sprout view` over a real SPROUT evaluation (a failed attempt, a review, a solved branch, checkpoints
kept): its JSON API, its pages in Debian's chromium (the tree, a turn's diff), the static page, and the
hostile cases: an agent's output holding markup, paths and links planted in a run directory."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from sprout.errors import SproutError
from sprout.eval.summary import read_summary
from sprout.jobs.journals import release
from sprout.report.view import Runs
from sprout.report.viewer import app
from sprout.sandbox import Store
from sprout.testing.browser import Browser
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import REPO, free_port, wait_healthy
from tests.method.conftest import KEY_ENV, SUBMIT, evaluate_args, run_module
from tests.services.test_services import services

MARKUP = '<script>document.title="pwned"</script><img src=x onerror="document.title=document.URL">'
FIRST = [
    {"thought": "Look at the code.", "command": f"echo '{MARKUP}'; cat /app/calc.py"},
    {"thought": "Try it.", "command": "cd /app && python3 -c 'import calc; print(calc.add(2, 3))'"},
    {"thought": "It must multiply.", "command": "sed -i 's/return a - b/return a * b/' /app/calc.py"},
    {"thought": "Done.", "command": SUBMIT},
]
BRANCH = [{"thought": "Use plus.", "command": "sed -i 's/return a - b/return a + b/' /app/calc.py"},
          {"thought": "Done.", "command": SUBMIT}]
REVIEW = {"branch_points": [{"turn": 2, "mistake_turn": 3, "mistake": "replaced - with *", "reason": "turn 2 knew",
                             "note": "add() must return the sum"}]}


@pytest.fixture(scope="module")
def evaluation(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("view") / "py-bugfix-sprout"
    with ScriptedModelServer([{"content": json.dumps(REVIEW)}]) as reviewer, \
            ScriptedModelServer(FIRST + BRANCH) as agent:
        done = run_module("sprout.eval.evaluate", *evaluate_args(
            dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url, "--keep-checkpoints"))
    assert done.returncode == 0, done.stdout + done.stderr
    yield out
    release(Store(), sorted(out.glob("attempts/*.jsonl")))


@pytest.fixture(scope="module")
def benchmark(dataset, evaluation):
    """A benchmark directory: the SPROUT evaluation beside a restarts one of the same task (solved by its
    second attempt)."""
    bench = evaluation.parent / "bench"
    shutil.copytree(evaluation, bench / "py-bugfix-sprout", symlinks=True)
    with ScriptedModelServer(FIRST + BRANCH) as agent:
        done = run_module("sprout.eval.evaluate", *evaluate_args(
            dataset, bench / "py-bugfix-restarts", agent.base_url, method="restarts"))
    assert done.returncode == 0, done.stdout + done.stderr
    return bench


def serve(*directories: Path, env: dict | None = None):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "sprout", "view", *map(str, directories), "--port", str(port)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def served(evaluation):
    yield from serve(evaluation)


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def open_page(browser: Browser, url: str) -> None:
    browser.goto(url)
    fragment = url.partition("#")[2]
    browser.wait_for(f"document.body.dataset.ready === {json.dumps('#' + fragment if fragment else '#/')}")


def test_the_api_gives_the_tree_the_trajectory_and_each_turns_diff(served):
    index = httpx.get(f"{served}/api/index").json()
    assert [(e["method"], e["status"], e["solved_by"]) for e in index["evaluations"]] == [("sprout", "solved", "r1b1")]
    summary = httpx.get(f"{served}/api/evaluations/0").json()["summary"]
    assert [(a["id"], a["parent"], a["from_turn"], a["reward"]) for a in summary["attempts"]] == [
        ("a1", None, None, 0.0), ("r1b1", "a1", 2, 1.0)]
    trajectory = httpx.get(f"{served}/api/evaluations/0/attempts/a1").json()
    assert [t["turn"] for t in trajectory["turns"]] == [1, 2, 3, 4] and MARKUP in trajectory["turns"][0]["observation"]
    assert trajectory["turns"][2]["changes"]["paths"] == ["M /app/calc.py (content)"]
    diff = httpx.get(f"{served}/api/evaluations/0/attempts/a1/turns/3/diff").json()
    patch = diff["diff"]["changes"][0]["diff"]
    assert diff["diff"]["method"] == "btrfs-send" and "-    return a - b\n+    return a * b\n" in patch
    assert httpx.get(f"{served}/api/evaluations/0/attempts/a9").status_code == 404
    assert httpx.get(f"{served}/api/evaluations/7").json() == {"detail": "no evaluation 7"}
    assert "Content-Security-Policy" in httpx.get(f"{served}/").headers


def test_the_tree_and_a_turns_diff_in_a_real_browser(served, browser, tmp_path):
    shots = Path(os.environ.get("SPROUT_VIEW_SCREENSHOTS", tmp_path))  # docs/images for the docs' pictures
    open_page(browser, f"{served}/#/e/0")
    nodes = browser.evaluate("[...document.querySelectorAll('[data-attempt]')].map(n => n.dataset.attempt)")
    assert nodes == ["a1", "r1b1"]
    assert "null" not in browser.evaluate("document.querySelector('main').textContent")
    # the branch hangs under the review's point at turn 2 of a1, with its note
    point = browser.evaluate("document.querySelector('.point').textContent")
    assert point.startswith("from turn 2 ← review r1: turn 2 knew (mistake at turn 3: replaced - with *)")
    assert browser.evaluate("document.querySelector('.point [data-attempt]').dataset.attempt") == "r1b1"
    browser.screenshot(shots / "view-tree.png")
    open_page(browser, f"{served}/#/e/0/a/a1")
    browser.evaluate("document.querySelector('#turn-3 .show-diff').click()")
    patch = browser.wait_for("document.querySelector('#turn-3 .patch')?.textContent")
    assert "-    return a - b\n+    return a * b\n" in patch
    assert browser.evaluate("[...document.querySelectorAll('#turn-3 .patch .add')].map(n => n.textContent)") == [
        "+    return a * b\n"]
    # the agent's markup is text on the page: no script ran, no element was made of it
    assert MARKUP in browser.evaluate("document.querySelector('#turn-1 .output').textContent")
    assert browser.evaluate("document.title") == "Sprout view"
    assert browser.evaluate("document.querySelectorAll('main img, main script').length") == 0
    browser.screenshot(shots / "view-attempt.png")
    assert all((shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in ("view-tree.png", "view-attempt.png"))


def test_the_static_page_needs_no_server(evaluation, browser, tmp_path):
    page = tmp_path / "share" / "view.html"
    done = run_module("sprout", "view", evaluation, "--html", page)
    assert done.returncode == 0 and f"wrote {page}" in done.stdout, done.stderr
    assert "</script><img" not in page.read_text()  # the agent's markup cannot close the data element
    open_page(browser, f"file://{page}#/e/0/a/a1")
    browser.evaluate("document.querySelector('#turn-3 .show-diff').click()")
    assert "+    return a * b" in browser.wait_for("document.querySelector('#turn-3 .patch')?.textContent")
    assert browser.evaluate("document.title") == "Sprout view"


def test_paths_and_links_planted_in_a_run_directory_are_not_followed(evaluation, tmp_path):
    hostile = tmp_path / "hostile"
    shutil.copytree(evaluation, hostile, symlinks=True)
    summary = json.loads((hostile / "summary.json").read_text())
    summary["attempts"][0]["journal"] = "../../../../../../etc/passwd"
    (hostile / "attempts" / "r1b1.jsonl").unlink()
    os.symlink("/etc/passwd", hostile / "attempts" / "r1b1.jsonl")
    (hostile / "summary.json").write_text(json.dumps(summary))
    client = TestClient(app(Runs([hostile])))
    for attempt in ("a1", "r1b1"):
        answer = client.get(f"/api/evaluations/0/attempts/{attempt}")
        assert answer.status_code == 404 and "outside the run directory" in answer.json()["detail"]
        assert "root:" not in answer.text
    assert client.get("/api/evaluations/0/attempts/..%2F..%2Fsummary.json").status_code == 404
    assert client.get("/../../etc/passwd").status_code == 404


def test_what_is_not_a_run_is_one_clear_line(tmp_path):
    missing = run_module("sprout", "view", tmp_path / "nothing")
    assert missing.returncode == 1 and missing.stderr.strip().splitlines()[-1] == (
        f"error: nothing to view: {tmp_path / 'nothing'} is not a directory")
    half = tmp_path / "half-written"
    half.mkdir()
    (half / "summary.json").write_text('{"kind": "sprout.evaluation", "config": {')
    page = tmp_path / "half.html"
    done = run_module("sprout", "view", half, "--html", page)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    data = json.loads(page.read_text().split('type="application/json">')[1].split("</script>")[0])
    assert data["/api/index"]["evaluations"] == []
    assert data["/api/index"]["problems"] == [f"{half / 'summary.json'} is not a Sprout evaluation summary (1 errors)"]



def test_a_benchmark_shows_its_table_and_the_tasks_solved_against_turns_spent(benchmark, browser, tmp_path):
    for url in serve(benchmark):
        open_page(browser, f"{url}/#/")
        header = browser.evaluate("[...document.querySelectorAll('.benchmark th')].map(n => n.textContent)")
        assert header == ["task", "sprout", "restarts"]
        cells = browser.evaluate("[...document.querySelectorAll('.benchmark td')].map(n => n.textContent)")
        assert cells[0] == "py-bugfix" and cells[1].startswith("solved, 6 / ") and cells[2].startswith("solved, 6 / ")
        curves = browser.evaluate("[...document.querySelectorAll('polyline.curve')].map(n => n.dataset.method)")
        assert curves == ["sprout", "restarts"]
        legend = browser.evaluate("[...document.querySelectorAll('svg text')].map(n => n.textContent)")
        assert "sprout: 1 solved" in legend and "restarts: 1 solved" in legend
        browser.evaluate("document.querySelector('.benchmark td a').click()")  # the sprout cell
        assert browser.wait_for("document.body.dataset.ready.startsWith('#/e/') && "
                                "document.querySelector('main h2').textContent") == "py-bugfix · sprout"
        shots = Path(os.environ.get("SPROUT_VIEW_SCREENSHOTS", tmp_path))
        open_page(browser, f"{url}/#/")
        browser.screenshot(shots / "view-benchmark.png")


def test_harbors_own_scanner_and_viewer_read_the_runs(benchmark):
    """The evaluations are Harbor jobs too: Harbor 0.22's JobScanner and its viewer app (harbor view) list the
    jobs, their trials with rewards, and each trajectory in ATIF, a branch's with its parent's turns copied."""
    from harbor.models.trajectories import Trajectory
    from harbor.viewer.scanner import JobScanner
    from harbor.viewer.server import create_app

    scanner = JobScanner(benchmark)
    assert {"py-bugfix-sprout", "py-bugfix-restarts"} <= set(scanner.list_jobs())
    assert scanner.get_job_config("py-bugfix-sprout").agents[0].model_name == "scripted"
    result = scanner.get_job_result("py-bugfix-sprout")
    assert result.n_total_trials == 2 and result.stats.n_completed_trials == 2
    assert scanner.list_trials("py-bugfix-sprout") == ["a1", "r1b1"]
    rewards = {t: scanner.get_trial_result("py-bugfix-sprout", t).verifier_result.rewards for t in ("a1", "r1b1")}
    assert rewards == {"a1": {"reward": 0.0}, "r1b1": {"reward": 1.0}}

    client = TestClient(create_app(benchmark))
    jobs = client.get("/api/jobs").json()["items"]
    sprout = next(j for j in jobs if j["name"] == "py-bugfix-sprout")
    assert sprout["n_total_trials"] == 2 and sprout["agents"] == ["sprout"]
    trials = client.get("/api/jobs/py-bugfix-sprout/trials").json()["items"]
    assert sorted((t["name"], t["reward"]) for t in trials) == [("a1", 0.0), ("r1b1", 1.0)]
    first = Trajectory.model_validate(client.get("/api/jobs/py-bugfix-sprout/trials/a1/trajectory").json())
    assert [s.source for s in first.steps] == ["system", "user", "agent", "agent", "agent", "agent"]
    assert first.steps[4].tool_calls[0].arguments == {"command": "sed -i 's/return a - b/return a * b/' /app/calc.py"}
    assert first.steps[4].extra["changes"] == "0 added, 1 changed, 0 removed: M /app/calc.py (content)"
    branch = Trajectory.model_validate(client.get("/api/jobs/py-bugfix-sprout/trials/r1b1/trajectory").json())
    assert [(s.source, bool(s.is_copied_context)) for s in branch.steps] == [
        ("system", False), ("user", False), ("agent", True), ("agent", True), ("user", False), ("agent", False),
        ("agent", False)]
    assert branch.steps[4].message == "add() must return the sum"


def test_a_live_evaluation_over_a_run_store_is_followed_through_its_event_stream(dataset, outputs, browser, tmp_path):
    """The page of an evaluation that runs over a Run Store (services up: the API and a worker) follows it
    through the Run Store's events of its group: the branch appears and the run ends on the page as first
    loaded, never reloaded."""
    config, out = tmp_path / "cfg", tmp_path / "live"
    outputs.append(out)
    assert services(config, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(config, "up", "runstore-api", "runstore-worker", env={KEY_ENV: "sk-do-not-record"})
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(config, "env").stdout.split()[1:])
        with ScriptedModelServer([{"content": json.dumps(REVIEW)}]) as reviewer, \
                ScriptedModelServer(FIRST + BRANCH, delay_s=1.5) as agent:
            args = evaluate_args(dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url)
            del args[args.index("--model-key-env"):args.index("--model-key-env") + 2]  # plain URLs, no key
            running = subprocess.Popen([sys.executable, "-m", "sprout.eval.evaluate", *args], cwd=REPO, text=True,
                                       env={**os.environ, **exports}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                group = wait_for_group(out, running)
                for url in serve(out, env=exports):
                    open_page(browser, f"{url}/#/e/0")
                    assert browser.evaluate("document.querySelector('main p').textContent").startswith("running")
                    browser.evaluate("window.loadedOnce = true")
                    assert browser.wait_for("document.body.dataset.following") == f"following Run Store group {group}"
                    ended = browser.wait_for("document.querySelector('main p').textContent.startsWith('solved') && "
                                             "[...document.querySelectorAll('[data-attempt]')].map(n => n.dataset.attempt)",
                                             timeout_s=120)
                    assert ended == ["a1", "r1b1"] and browser.evaluate("window.loadedOnce") is True
                assert running.wait(60) == 0, running.stdout.read() if running.stdout else ""
            finally:
                running.kill()
                running.wait()
    finally:
        services(config, "down")


def wait_for_group(out: Path, running: subprocess.Popen) -> str:
    """The Run Store group of the evaluation writing `out`, once its summary names it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running.poll() is None:
        try:
            if group := read_summary(out).runstore_group:
                return group
        except SproutError:
            pass  # not written yet
        time.sleep(0.2)
    raise AssertionError(f"no Run Store group in {out}: {running.stdout.read() if running.stdout else ''}")


def test_a_live_rl_groups_events_say_when_it_moved_and_when_it_ended(evaluation, tmp_path):
    """An RL group is followed through its files: a grade written is a change, the driver's status.json the
    end (here a group made of the evaluation's first attempt as its one slot)."""
    group = tmp_path / "groups" / "g-1"
    (group / "slot-11").mkdir(parents=True)
    shutil.copy(evaluation / "attempts" / "a1.jsonl", group / "slot-11" / "journal.jsonl")

    def driver() -> None:
        time.sleep(1.0)
        (group / "slot-11" / "grade.json").write_text(json.dumps({"reward": 0.0, "verdict": "fail"}))
        time.sleep(1.0)
        (group / "status.json").write_text(json.dumps({"status": "completed", "reason": None}))

    writer = threading.Thread(target=driver)
    writer.start()
    client = TestClient(app(Runs([tmp_path / "groups"])))
    with client.stream("GET", "/api/groups/0/events") as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        kinds = [line.removeprefix("event: ") for line in events.iter_lines() if line.startswith("event: ")]
    writer.join()
    assert kinds == ["change", "change", "end"]  # the grade, status.json (a file of the group too), the end
    assert client.get("/api/groups/0").json()["status"] == "completed"
    assert client.get("/api/groups/1/events").json() == {"detail": "no group 1"}
