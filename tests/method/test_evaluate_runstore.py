"""`python -m sprout.eval.evaluate` and the benchmark runner over a Run Store (services init + up + env):
the rollouts, grades and the review run as jobs on the worker and give the summary the in-process path
gives."""

import json

import pytest

from sprout.eval.evaluate import EvaluateConfig, endpoints
from sprout.eval.results import find_summaries
from sprout.eval.summary import read_summary
from sprout.jobs.endpoints import EndpointRef, endpoint_ref
from sprout.runstore.client import RunStoreClient
from sprout.sandbox.errors import SproutError
from sprout.testing.scripted_model import ScriptedModelServer
from tests.method.conftest import KEY_ENV, evaluate_args, run_module
from tests.method.test_benchmark import SOLVE
from tests.method.test_evaluate import BRANCH, FIRST, REVIEW
from tests.services.test_services import free_port, services


def evaluate(dataset, out, env: dict, *, remote: bool = False) -> tuple:
    """One SPROUT evaluation with fresh scripted servers: a1 fails, the review picks turn 2, r1b1 passes.
    `remote`: over a Run Store, where plain URLs are called with no key (no --model-key-env)."""
    with ScriptedModelServer([{"content": json.dumps(REVIEW)}]) as reviewer, \
            ScriptedModelServer(FIRST + BRANCH) as agent:
        args = evaluate_args(dataset, out, agent.base_url, "--review-endpoint", reviewer.base_url)
        if remote:
            at = args.index("--model-key-env")
            del args[at:at + 2]
        result = run_module("sprout.eval.evaluate", *args, env=env)
        return result, len(agent.requests), len(reviewer.requests)


def comparable(summary) -> dict:
    """What must not depend on where the work ran."""
    attempts = [a.model_dump(include={"id", "kind", "parent", "from_turn", "note", "status", "first_turn", "turns",
                                      "tokens_in", "tokens_out", "reward", "verdict", "grade_mode"}) for a in summary.attempts]
    reviews = [(r.id, r.reviewed, [p.model_dump() for p in r.branch_points], r.fallback) for r in summary.reviews]
    return {"status": summary.status, "solved_by": summary.solved_by, "attempts": attempts, "reviews": reviews,
            "totals": summary.totals.model_dump(exclude={"review_tokens"}), "config_hash": summary.config_hash}


@pytest.mark.rootless
def test_evaluation_through_the_run_store_gives_the_in_process_summary(dataset, outputs, tmp_path):
    config = tmp_path / "cfg"
    assert services(config, "init", "--port", str(free_port()), "--slots", "2").returncode == 0
    up = services(config, "up", "runstore-api", "runstore-worker", env={KEY_ENV: "sk-do-not-record"})
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(item.split("=", 1) for item in services(config, "env").stdout.split()[1:])
        remote_out, local_out = tmp_path / "remote", tmp_path / "local"
        outputs.extend([remote_out, local_out, tmp_path / "bench"])
        remote, agent_calls, review_calls = evaluate(dataset, remote_out, {**exports, KEY_ENV: None}, remote=True)
        assert remote.returncode == 0, remote.stdout + remote.stderr
        assert "running as Run Store jobs at " + exports["SPROUT_RUNSTORE_URL"] in remote.stdout
        assert "r1b1   turn   3" in remote.stdout  # turns are followed from the worker's journal
        assert (agent_calls, review_calls) == (6, 1)
        client = RunStoreClient(exports["SPROUT_RUNSTORE_URL"], exports["SPROUT_RUNSTORE_TOKEN"])
        jobs = client.list(limit=100).jobs
        bench = benchmark(dataset, tmp_path / "bench", exports)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        bench_jobs = [j for j in client.list(limit=100).jobs if j.id not in {k.id for k in jobs}]
        refused, *_ = evaluate(dataset, tmp_path / "refused", {**exports, "SPROUT_RUNSTORE_TOKEN": "wrong"},
                               remote=True)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert f"the Run Store at {exports['SPROUT_RUNSTORE_URL']} refused a rollout job" in refused.stderr
    finally:
        services(config, "down")
    # each attempt is graded live by the worker that ran it, in its own sandbox: no grade jobs
    assert sorted(j.kind for j in jobs) == ["review", "rollout", "rollout"]
    assert all(j.state == "succeeded" for j in jobs) and len({j.group_id for j in jobs}) == 1
    branch_job = next(j for j in jobs if j.kind == "rollout" and j.payload["turn"] == 2)
    assert branch_job.host and branch_job.payload["from_checkpoint"]  # prefers the host holding turn 2
    assert branch_job.payload["options"]["endpoint"]["url"].startswith("http://127.0.0.1:")  # called with no key
    assert "key_env" not in json.dumps([j.payload for j in jobs])
    local, *_ = evaluate(dataset, local_out, {"SPROUT_RUNSTORE_URL": None, "SPROUT_RUNSTORE_TOKEN": None})
    assert local.returncode == 0, local.stdout + local.stderr
    remote_summary, local_summary = read_summary(remote_out), read_summary(local_out)
    assert remote_summary.runstore == exports["SPROUT_RUNSTORE_URL"] and local_summary.runstore is None
    assert comparable(remote_summary) == comparable(local_summary)
    assert remote_summary.solved_by == "r1b1" and remote_summary.attempts[1].reward == 1
    assert [a.grade_mode for a in remote_summary.attempts] == ["live", "live"]
    assert (remote_out / remote_summary.attempts[1].verifier_output).exists()  # the worker wrote it there
    assert {a.host for a in remote_summary.attempts} == {jobs[0].lease_host}
    # the benchmark's evaluations inherit the Run Store: every attempt ran as jobs, and it solves as in-process
    assert sorted(j.kind for j in bench_jobs) == ["rollout", "rollout"]
    assert all(s.runstore == exports["SPROUT_RUNSTORE_URL"] for s in find_summaries(tmp_path / "bench"))
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert {r["method"]: r["solved"] for r in results["methods"]} == {"single": 1, "restarts": 1}


def benchmark(dataset, out, env: dict):
    """Two evaluations, one after the other (they share one scripted model)."""
    with ScriptedModelServer(SOLVE * 2) as agent:
        return run_module("sprout.eval.benchmark", "--tasks-dir", dataset.tasks_dir, "--output", out, "--methods",
                          "single", "restarts", "--workers", "1", "--dataset-digest", dataset.digest,
                          "--preparation-manifest", dataset.manifest, "--model", "scripted", "--model-endpoint",
                          agent.base_url, "--allow-dirty", "--step-limit", "5",
                          "--rounds", "1", "--branches", "2", "--parallel", "1", env=env)


def test_over_a_run_store_jobs_name_a_workers_endpoint_or_a_keyless_url():
    """--model-endpoint-name (default "default") names an endpoint configured on the workers; a plain
    --model-endpoint URL goes as a URL; a key variable never goes into a job."""
    def config(**given: str) -> EvaluateConfig:
        return EvaluateConfig(task_dir="t", output="o", model="m", dataset_digest="d", preparation_manifest="p",
                              **given)

    agent, reviewer = endpoints(config(), remote=True)
    assert endpoint_ref(agent) == endpoint_ref(reviewer) == EndpointRef(name="default")
    agent, reviewer = endpoints(config(model_endpoint="http://h:1/v1/", review_endpoint_name="big"), remote=True)
    assert (endpoint_ref(agent), endpoint_ref(reviewer)) == (EndpointRef(url="http://h:1/v1"), EndpointRef(name="big"))
    with pytest.raises(SproutError, match="--model-key-env does not apply over a Run Store"):
        endpoints(config(model_endpoint="http://h:1/v1", model_key_env=KEY_ENV), remote=True)
    with pytest.raises(SproutError, match="not both"):
        endpoints(config(model_endpoint="http://h:1/v1", model_endpoint_name="x"), remote=True)
    with pytest.raises(SproutError, match="--model-endpoint-name names an endpoint of a Run Store's workers"):
        endpoints(config(model_endpoint_name="default"), remote=False)
