"""The benchmark runner and examples.qwen.run over the one-task dataset, with a scripted model."""

import json

from sprout.eval.gate import FlakyTask, GateSummary
from sprout.eval.results import find_summaries
from sprout.testing.scripted_model import ScriptedModelServer
from tests.conftest import RUNTIME_BIN
from tests.method.conftest import KEY_ENV, SUBMIT, run_module

SOLVE = [{"thought": "Fix it.", "command": "sed -i 's/return a - b/return a + b/' /app/calc.py"},
         {"thought": "Done.", "command": SUBMIT}]


def test_benchmark_runs_every_task_and_method_then_resumes(dataset, outputs, tmp_path):
    out = tmp_path / "bench"
    outputs.append(out)
    with ScriptedModelServer(SOLVE * 2) as agent:
        args = ["--tasks-dir", dataset.tasks_dir, "--output", out, "--methods", "single", "restarts",
                "--workers", "1", "--dataset-digest", dataset.digest, "--preparation-manifest", dataset.manifest,
                "--model", "scripted", "--model-endpoint", agent.base_url, "--model-key-env", KEY_ENV,
                "--runtime-bin", RUNTIME_BIN, "--allow-dirty", "--step-limit", "5", "--rounds", "1", "--branches", "2",
                "--parallel", "1"]  # restarts one at a time: they share one script
        result = run_module("sprout.eval.benchmark", *args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert len(agent.requests) == 4
        again = run_module("sprout.eval.benchmark", *args)  # resumable: both are finished, nothing reruns
        assert again.returncode == 0 and len(agent.requests) == 4
    assert "py-bugfix single: solved by a1" in result.stdout and "py-bugfix restarts: solved by a1" in result.stdout
    summaries = find_summaries(out)
    assert sorted((s.config.method, s.solved_by, s.config.budget.amount) for s in summaries) == [
        ("restarts", "a1", 15), ("single", "a1", 5)]
    assert '"step_limit":5' in (out / "logs" / "py-bugfix-restarts.log").read_text().splitlines()[0]
    results = json.loads((out / "results.json").read_text())
    assert {r["method"]: r["solved"] for r in results["methods"]} == {"single": 1, "restarts": 1}
    markdown = (out / "results.md").read_text()
    assert "| py-bugfix | restarts | solved | a1 |" in markdown and "pass@5" in markdown and "pass@15" in markdown
    tree = run_module("ops.report", "task", out)
    assert tree.returncode == 0 and tree.stdout.count("a1 first attempt") == 2
    assert "pass@budget" in tree.stdout and "per task" in tree.stdout


def test_a_benchmark_leaves_out_the_tasks_a_gate_found_flaky(dataset, tmp_path):
    summary = GateSummary(tasks_dir=str(dataset.tasks_dir), workers=1, started_at="now", wall_s=1.0, passed=0,
                          failed=0, errors=0, results=[], trials=4, flaky=1,
                          flaky_tasks=[FlakyTask(task="py-bugfix", oracle_pass_rate=0.5, nop_zero_rate=1.0)])
    (tmp_path / "gate.json").write_text(summary.model_dump_json())
    result = run_module("sprout.eval.benchmark", "--tasks-dir", dataset.tasks_dir, "--output", tmp_path / "bench",
                        "--methods", "single", "--dataset-digest", dataset.digest, "--preparation-manifest",
                        dataset.manifest, "--model", "scripted", "--model-endpoint", "http://127.0.0.1:9/v1",
                        "--model-key-env", KEY_ENV, "--allow-dirty", "--exclude-flaky", tmp_path / "gate.json")
    assert result.returncode == 1 and "error: no runnable task to evaluate" in result.stderr, result.stderr
    assert f"left out as flaky by {tmp_path / 'gate.json'} (4 trials): py-bugfix" in " ".join(result.stdout.split())


def test_qwen_example_without_an_endpoint_says_so():
    result = run_module("examples.qwen.run", "--endpoint", "http://127.0.0.1:9/v1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    text = " ".join(result.stderr.split())
    assert "no OpenAI-compatible endpoint reachable at http://127.0.0.1:9/v1" in text and "vllm serve" in text


def test_qwen_example_prepares_and_benchmarks(dataset, outputs, tmp_path):
    out = tmp_path / "qwen"
    outputs.append(out)
    script = {"model": "Qwen/Qwen3-Coder-30B-A3B-Instruct", "steps": SOLVE}
    with ScriptedModelServer(script) as server:
        result = run_module("examples.qwen.run", "--endpoint", server.base_url, "--tasks-dir", dataset.tasks_dir,
                            "--output", out, "--methods", "single", "--workers", "1", "--allow-dirty",
                            "--runtime-bin", RUNTIME_BIN, env={"QWEN_API_KEY": None})
        wrong = run_module("examples.qwen.run", "--endpoint", server.base_url, "--model", "other")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "placeholder key EMPTY" in result.stdout and f"digest {dataset.digest}" in result.stdout
    assert json.loads((out / "prep.json").read_text())["dataset"]["digest"] == dataset.digest
    (summary,) = find_summaries(out)
    assert summary.solved_by == "a1" and summary.config.model == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert wrong.returncode == 1 and "does not serve other" in " ".join(wrong.stderr.split())
