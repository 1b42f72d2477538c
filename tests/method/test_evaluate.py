"""End to end: `python -m sprout.eval.evaluate` with scripted agent and reviewer servers, real
podman + btrfs sandboxes, Harbor's verifier; then `ops.report task` over the output."""

import json
import subprocess

import pytest

from sprout.agent.journal import read_journal
from sprout.eval import provenance
from sprout.eval.summary import read_summary
from sprout.method.budget import equal_budget
from sprout.method.review import FALLBACK_NOTE
from sprout.sandbox.images import stand_in
from sprout.testing.scripted_model import ScriptedModelServer
from tests.coin import CoinServer, coin_task
from tests.conftest import PYTHON_IMAGE
from tests.method.conftest import SUBMIT, Dataset, evaluate_args, prepared_dataset, run_module

FIRST = [  # the first attempt: reads, tries, then "fixes" add() with * at turn 3 and submits
    {"thought": "Look at the code.", "command": "cat /app/calc.py"},
    {"thought": "Try it.", "command": "cd /app && python3 -c 'import calc; print(calc.add(2, 3))'"},
    {"thought": "It must multiply.", "command": "sed -i 's/return a - b/return a * b/' /app/calc.py"},
    {"thought": "Done.", "command": SUBMIT},
]
NOTE = "add() must return the sum: use a + b, not a * b."
BRANCH = [  # the branch from turn 2: only answers once the review's note reached it
    {"thought": "Use plus.", "command": "sed -i 's/return a - b/return a + b/' /app/calc.py", "match": "a \\+ b"},
    {"thought": "Done.", "command": SUBMIT},
]
REVIEW = {"branch_points": [{"turn": 2, "mistake_turn": 3, "mistake": "replaced - with * instead of +",
                             "reason": "after turn 2 the agent knew add() subtracts", "note": NOTE}]}


def report(out) -> subprocess.CompletedProcess:
    return run_module("ops.report", "task", out)


def test_first_fails_review_picks_turn_2_branch_resumes_with_note_and_passes(dataset, outputs, tmp_path):
    out = tmp_path / "py-bugfix-sprout"
    outputs.append(out)
    reviewer = ScriptedModelServer([{"content": "Here you go:\n" + json.dumps(REVIEW)}]).start()
    try:
        # run 1: the agent's script ends after the first attempt, so the branch's first call fails
        with ScriptedModelServer(FIRST) as agent:
            first = run_module("sprout.eval.evaluate",
                               *evaluate_args(dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url))
        assert first.returncode == 1 and "r1b1" in first.stderr and "before its first turn" in first.stderr
        assert "Traceback" not in first.stderr
        summary = read_summary(out)
        assert summary.status == "error" and [a.id for a in summary.attempts] == ["a1"]
        a1 = summary.attempts[0]
        assert a1.verdict == "fail" and a1.reward == 0 and a1.turns == 4 and a1.status == "submitted"
        assert len(reviewer.requests) == 1
        # run 2 resumes: a1 and the review are kept, only the branch runs
        with ScriptedModelServer(BRANCH) as agent:
            second = run_module("sprout.eval.evaluate",
                                *evaluate_args(dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url))
            branch_requests = agent.requests
        assert second.returncode == 0, second.stdout + second.stderr
        assert len(reviewer.requests) == 1  # not asked again
        review_prompt = reviewer.requests[0]["body"]["messages"][-1]["content"]
    finally:
        reviewer.stop()
    assert "## Turn 3" in review_prompt and "sed -i 's/return a - b/return a * b/'" in review_prompt
    assert "add(a, b)" in review_prompt and "reward 0" in review_prompt and "failed" in review_prompt.lower()
    assert "changes on disk" not in review_prompt and not read_summary(out).config.review_changes  # off by default

    summary = read_summary(out)
    assert summary.status == "solved" and summary.solved_by == "r1b1" and summary.sessions == 2
    a1, branch = summary.attempts
    assert (branch.kind, branch.parent, branch.from_turn, branch.note, branch.review) == ("branch", "a1", 2, NOTE, "r1")
    assert branch.reward == 1 and branch.verdict == "pass" and branch.first_turn == 3 and branch.turns == 2
    assert summary.reviews[0].branch_points[0].turn == 2 and summary.reviews[0].fallback is None
    # provenance: the commit, digests, manifest hash, endpoint host (never the key)
    assert summary.source.commit and summary.source.commit == provenance.source_state().commit
    assert summary.config.commit == summary.source.commit and summary.source.allow_dirty
    assert summary.pinning.dataset_digest == dataset.digest
    assert summary.pinning.task_digest == provenance.task_digest(dataset.task_dir)
    assert summary.pinning.manifest_sha256 == provenance.sha256_of(dataset.manifest)
    assert summary.endpoint_host.startswith("127.0.0.1:")
    assert summary.image.stand_in == stand_in(PYTHON_IMAGE)  # py-bugfix is FROM python:3.11-slim
    assert "sk-do-not-record" not in (out / "summary.json").read_text()
    assert {p.name for p in (out / "attempts").iterdir()} == {"a1.jsonl", "r1b1.jsonl"}
    assert (out / "reviews" / "r1.json").exists() and (out / branch.verifier_output).exists()

    # the branch resumed from turn 2's messages, with the note last
    sent = branch_requests[0]["body"]["messages"]
    history = read_journal(out / a1.journal).messages_up_to(2)
    assert sent[-1] == {"role": "user", "content": NOTE}
    assert [m["role"] for m in sent[:-1]] == [m["role"] for m in history]
    assert read_journal(out / branch.journal).header.parent.turn == 2

    tree = report(out)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert "solved by r1b1" in lines[0]
    a1_line = next(i for i, line in enumerate(lines) if "a1 first attempt" in line)
    point_line = next(i for i, line in enumerate(lines) if "turn 2 ← r1" in line)
    branch_line = next(i for i, line in enumerate(lines) if "r1b1 branch" in line)
    assert a1_line < point_line < branch_line
    assert "reward 0" in lines[a1_line] and "turns 1-4" in lines[a1_line]
    assert "reward 1" in lines[branch_line] and "turns 3-4" in lines[branch_line]
    assert "after turn 2 the agent knew" in lines[point_line] and "mistake at turn 3" in lines[point_line]
    markdown = run_module("ops.report", "task", out, "--format", "md").stdout
    assert "- **a1** first attempt" in markdown and "\n  - turn 2 ← r1" in markdown and "\n    - **r1b1** branch" in markdown

    # the same run again: nothing to do; another configuration: refused
    with ScriptedModelServer([{"content": "unused"}]) as agent:
        again = run_module("sprout.eval.evaluate", *evaluate_args(dataset, out, agent.base_url))
        other = run_module("sprout.eval.evaluate", *evaluate_args(dataset, out, agent.base_url, "--no-early-stop"))
        assert agent.requests == []
    assert again.returncode == 0 and "already finished" in again.stdout
    assert other.returncode == 1 and "holds a different run" in other.stderr and "early_stop" in other.stderr


def test_a_sprout_run_in_microvms_branches_from_a_vm_checkpoint(tmp_path_factory, outputs, tmp_path):
    """--backend microvm: the attempt, its per-turn checkpoints, the branch from turn 2 and both grades
    are in VMs (microVMs have no network: the task's environment is offline)."""
    offline = prepared_dataset(tmp_path_factory.mktemp("offline"), network_mode="no-network")
    out = tmp_path / "in-microvms"
    outputs.append(out)
    probe = {"thought": "Where am I?", "command": "cat /proc/1/comm"}
    first = [probe, *FIRST[1:]]
    with ScriptedModelServer([{"content": json.dumps(REVIEW)}]) as reviewer, \
            ScriptedModelServer(first + BRANCH) as agent:
        result = run_module("sprout.eval.evaluate", *evaluate_args(
            offline, out, agent.base_url, "--review-endpoint", reviewer.base_url, "--backend", "microvm"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(out)
    assert summary.status == "solved" and [(a.id, a.reward) for a in summary.attempts] == [("a1", 0), ("r1b1", 1)]
    journal = read_journal(out / summary.attempts[0].journal)
    assert "sprout-agent" in journal.turns[0].observation  # PID 1 of a VM, not a container's


def test_malformed_review_is_retried_then_falls_back_and_is_recorded(dataset, outputs, tmp_path):
    out = tmp_path / "fallback"
    outputs.append(out)
    agent_script = FIRST + [BRANCH[0] | {"match": "."}, BRANCH[1]]
    with ScriptedModelServer(agent_script) as agent, \
            ScriptedModelServer([{"content": "I think turn two"}, {"content": '{"branch_points": [{"turn": 9}]}'}]) as rev:
        result = run_module("sprout.eval.evaluate", *evaluate_args(
            dataset, out, agent.base_url, "--review-endpoint", rev.base_url, "--review-retries", "1",
            "--review-changes"))
        first_prompt = rev.requests[0]["body"]["messages"][-1]["content"]
        retry_prompt = rev.requests[1]["body"]["messages"][-1]["content"]
        branch_first = agent.requests[4]["body"]["messages"][-1]["content"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cannot be used" in retry_prompt and "no JSON object" in retry_prompt
    # --review-changes: each turn says what it changed on disk (turn 3 edited calc.py)
    turn_3 = first_prompt.split("## Turn 3")[1].split("## Turn 4")[0]
    assert "changes on disk: 0 added, 1 changed, 0 removed: M /app/calc.py (content)" in turn_3
    turn_2 = first_prompt.split("## Turn 2")[1].split("## Turn 3")[0]  # python3 wrote its bytecode
    assert ("changes on disk: 2 added, 0 changed, 0 removed: A /app/__pycache__; "
            "A /app/__pycache__/calc.cpython-311.pyc\n") in turn_2
    summary = read_summary(out)
    assert summary.config.review_changes
    review = summary.reviews[0]
    assert review.fallback and "2 call(s)" in review.fallback
    assert [t.accepted for t in review.tries] == [False, False] and review.tries[0].raw == "I think turn two"
    assert any("mistake_turn" in p for p in review.tries[1].problems)
    assert [p.turn for p in review.branch_points] == [2]  # evenly spaced: round(4 * 1/2)
    assert json.loads((out / "reviews" / "r1.json").read_text())["fallback"] == review.fallback
    assert summary.attempts[1].from_turn == 2 and branch_first == FALLBACK_NOTE
    assert "fallback rule" in report(out).stdout


def test_restarts_get_sprouts_budget(dataset, outputs, tmp_path):
    out = tmp_path / "restarts"
    outputs.append(out)
    never = [{"thought": f"look {i}", "command": "ls /app"} for i in range(3)]  # 3 turns, no submit: limits
    with ScriptedModelServer(never * 3) as agent:
        result = run_module("sprout.eval.evaluate", *evaluate_args(
            dataset, out, agent.base_url, "--step-limit", "3", method="restarts"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(out)
    sprout_budget = equal_budget("sprout", "turns", 3, summary.config.token_limit, [1])
    assert summary.config.budget.amount == sprout_budget.amount == 6  # 3 turns x (1 first + 1 branch)
    assert [(a.id, a.kind, a.turns, a.status) for a in summary.attempts] == [
        ("a1", "first", 3, "limits_exceeded"), ("a2", "restart", 3, "limits_exceeded")]
    assert summary.totals.turns == 6 and summary.status == "unsolved" and summary.reviews == []
    with ScriptedModelServer(never * 2) as agent:  # --overwrite starts afresh even for the same run
        again = run_module("sprout.eval.evaluate", *evaluate_args(
            dataset, out, agent.base_url, "--step-limit", "3", "--overwrite", method="restarts"))
        assert again.returncode == 0 and len(agent.requests) == 6
    assert read_summary(out).sessions == 1 and read_summary(out).started > summary.started


def test_a_sequential_restarts_run_is_found_again_without_parallel(dataset, outputs, tmp_path):
    """A restarts run made one attempt at a time (as before waves existed) is the same run when it is
    invoked again without --parallel; another wave is another run."""
    out = tmp_path / "sequential"
    outputs.append(out)
    never = [{"thought": f"look {i}", "command": "ls /app"} for i in range(3)]
    flags = ("--step-limit", "3", "--branches", "2")
    with ScriptedModelServer(never * 3) as agent:
        first = run_module("sprout.eval.evaluate", *evaluate_args(dataset, out, agent.base_url, *flags, "--parallel",
                                                                   "1", method="restarts"))
        assert first.returncode == 0, first.stdout + first.stderr
        summary = read_summary(out)
        assert summary.config.wave is None and [a.id for a in summary.attempts] == ["a1", "a2", "a3"]
        again = run_module("sprout.eval.evaluate", *evaluate_args(dataset, out, agent.base_url, *flags,
                                                                   method="restarts"))
        assert again.returncode == 0 and "already finished" in again.stdout, again.stdout + again.stderr
        other = run_module("sprout.eval.evaluate", *evaluate_args(dataset, out, agent.base_url, *flags, "--parallel",
                                                                   "2", method="restarts"))
        assert other.returncode == 1 and "different run" in other.stderr, other.stderr


def test_dirty_checkout_is_refused_unless_allowed(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    assert provenance.check_source(False, repo).dirty is False
    (repo / "a.py").write_text("x = 2\n")
    monkeypatch.setattr(provenance, "SOURCE_REPO", repo)
    argv = ["--task-dir", str(tmp_path), "--output", str(tmp_path / "out"), "--dataset-digest", "sha256:0",
            "--preparation-manifest", str(tmp_path / "none.json"), "--model", "m"]
    with pytest.raises(SystemExit) as exit_info:
        from sprout.cli import run
        from sprout.console import run_cli
        run_cli(run, ["evaluate", *argv])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "a.py" in err and "--allow-dirty" in err
    state = provenance.check_source(True, repo)
    assert state.dirty and state.allow_dirty and state.commit and state.changes == [" M a.py"]


def test_digest_mismatches_are_refused_showing_both(dataset, tmp_path):
    wrong = "sha256:" + "0" * 64
    common = ["--task-dir", dataset.task_dir, "--output", tmp_path / "o", "--model", "m", "--allow-dirty"]
    result = run_module("sprout.eval.evaluate", *common, "--dataset-digest", wrong,
                        "--preparation-manifest", dataset.manifest)
    assert result.returncode == 1 and "dataset digest mismatch" in result.stderr
    assert wrong in result.stderr and dataset.digest in result.stderr.replace("\n", "")
    manifest = json.loads(dataset.manifest.read_text())
    manifest["tasks"][0]["digest"] = wrong
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(manifest))
    result = run_module("sprout.eval.evaluate", *common, "--dataset-digest", dataset.digest,
                        "--preparation-manifest", changed)
    text = result.stderr.replace("\n", "")
    assert result.returncode == 1 and "task digest mismatch for py-bugfix" in text
    assert wrong in text and provenance.task_digest(dataset.task_dir) in text
    assert not (tmp_path / "o").exists()


def test_rounds_and_branches_must_agree(dataset, tmp_path):
    result = run_module("sprout.eval.evaluate", "--task-dir", dataset.task_dir, "--output", tmp_path / "o",
                        "--dataset-digest", dataset.digest, "--preparation-manifest", dataset.manifest,
                        "--model", "m", "--rounds", "2", "--branches", "4")
    assert result.returncode == 2 and "--rounds 2 needs 2 --branches values" in result.stderr  # usage
    assert "Traceback" not in result.stderr


def test_regrade_gives_each_attempt_its_pass_rate(tmp_path, outputs):
    """--regrade 3 over a coin task (its verifier passes as a server says, from a fixed schedule): the attempt
    that solved it by luck is re-graded 3 times from its final checkpoint and passes 2 of its 4 grades."""
    with CoinServer([1, 0, 0, 1]) as coin:
        coin_task(tmp_path / "tasks" / "coin", coin)
        manifest = tmp_path / "prep.json"
        prepared = run_module("sprout.eval.prepare", "--tasks-dir", tmp_path / "tasks", "-o", manifest)
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        ds = Dataset(tmp_path / "tasks", tmp_path / "tasks" / "coin", manifest,
                     json.loads(manifest.read_text())["dataset"]["digest"])
        out = tmp_path / "out"
        outputs.append(out)
        steps = [{"thought": "Do it.", "command": "touch /app/solved"}, {"thought": "Done.", "command": SUBMIT}]
        with ScriptedModelServer(steps, api_key="sk-do-not-record") as agent:
            result = run_module("sprout.eval.evaluate", *evaluate_args(ds, out, agent.base_url, "--regrade", "3",
                                                                        method="single"))
        assert coin.oracle == []  # the live grade and the three re-grades took the whole schedule
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    [attempt] = summary["attempts"]
    assert summary["status"] == "solved" and summary["regrade"] == 3 and attempt["reward"] == 1.0
    assert sorted(attempt["regrades"]) == [0.0, 0.0, 1.0] and attempt["pass_rate"] == 0.5
    assert "a1: passed 2 of 4 grades (50%)" in result.stdout
