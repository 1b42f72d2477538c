"""python -m examples.qwen.run: SPROUT vs restarts with a Qwen model on a Harbor dataset.

Prepares the dataset (Harbor digests, task images, OUT/prep.json), then benchmarks it (as `sprout benchmark`
does) with both methods at equal budget. The model is served by
any OpenAI-compatible endpoint, for example:

    vllm serve Qwen/Qwen3-Coder-30B-A3B-Instruct --port 8000 \\
        --enable-auto-tool-choice --tool-call-parser qwen3_coder
    python -m sglang.launch_server --model-path Qwen/Qwen3-Coder-30B-A3B-Instruct --port 8000 \\
        --tool-call-parser qwen3_coder

Defaults (flags override them):
    --tasks-dir   $SPROUT_TASKS_DIR, else ~/datasets/deep-swe/tasks
    --endpoint    $QWEN_BASE_URL, else $OPENAI_BASE_URL, else http://127.0.0.1:8000/v1
    --model       $QWEN_MODEL, else Qwen/Qwen3-Coder-30B-A3B-Instruct
    --key-env     QWEN_API_KEY (a vLLM/SGLang server started without --api-key accepts any key;
                  when the variable is unset it is set to "EMPTY" for this run)
    --output runs/qwen  --rounds 2 --branches 4 3  --step-limit 50  --workers 4
    --task-ids-file   none (a subset, one task directory name a line: SWE-bench Pro's v2/hard51_ids.txt)
With no endpoint reachable (GET /v1/models) it says so and exits 1. Over a Run Store
(SPROUT_RUNSTORE_URL/TOKEN set) the workers call --endpoint with no key (jobs never carry keys).
"""

import argparse
import os
from pathlib import Path

import httpx

from sprout.console import console, run_cli
from sprout.errors import SproutError
from sprout.eval.benchmark import METHODS, BenchmarkConfig, run_benchmark
from sprout.eval.evaluate import EvaluationOptions
from sprout.eval.prepare import prepare
from sprout.jobs.remote import configured_client
from sprout.sandbox import Store
from sprout.tasks.dataset import load_task_ids, read_task_ids

DEFAULT_MODEL = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
DEFAULT_ENDPOINT = "http://127.0.0.1:8000/v1"
DEFAULT_TASKS = Path("~/datasets/deep-swe/tasks")
REPO = Path(__file__).resolve().parents[2]


def probe(endpoint: str, model: str, key: str) -> None:
    """Refuses (SproutError) unless `endpoint` answers GET /models and serves `model`."""
    try:
        response = httpx.get(f"{endpoint}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        response.raise_for_status()
        served = [m.get("id") for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise SproutError(f"no OpenAI-compatible endpoint reachable at {endpoint} (GET /models: "
                          f"{type(e).__name__}: {e}); serve the model first, e.g. `vllm serve {model} --port 8000 "
                          "--enable-auto-tool-choice --tool-call-parser qwen3_coder`, then pass --endpoint URL "
                          "(or set QWEN_BASE_URL)") from None
    if model not in served:
        raise SproutError(f"{endpoint} does not serve {model} (it serves: {', '.join(map(str, served)) or 'nothing'}); "
                          "pass --model with one of those")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.qwen.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks-dir", type=Path, default=Path(os.environ.get("SPROUT_TASKS_DIR", DEFAULT_TASKS)),
                   help="Harbor tasks directory (default: $SPROUT_TASKS_DIR or ~/datasets/deep-swe/tasks)")
    p.add_argument("--endpoint", default=os.environ.get("QWEN_BASE_URL") or os.environ.get("OPENAI_BASE_URL")
                   or DEFAULT_ENDPOINT, help=f"Chat Completions base URL (default: $QWEN_BASE_URL, $OPENAI_BASE_URL "
                   f"or {DEFAULT_ENDPOINT})")
    p.add_argument("--model", default=os.environ.get("QWEN_MODEL", DEFAULT_MODEL),
                   help=f"served model name (default: $QWEN_MODEL or {DEFAULT_MODEL})")
    p.add_argument("--key-env", default="QWEN_API_KEY", help="variable holding the API key (default QWEN_API_KEY)")
    p.add_argument("--output", type=Path, default=Path("runs/qwen"), help="output directory (default runs/qwen)")
    p.add_argument("--methods", nargs="+", default=["sprout", "restarts"], choices=METHODS,
                   help="methods to compare (default: sprout restarts)")
    p.add_argument("--rounds", type=int, default=2, help="SPROUT rounds (default 2)")
    p.add_argument("--branches", type=int, nargs="+", default=[4, 3], help="branches per round (default 4 3)")
    p.add_argument("--step-limit", type=int, default=50, help="turns per attempt (default 50)")
    p.add_argument("--workers", type=int, default=4, help="evaluations at once (default 4)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--tasks", nargs="+", metavar="NAME", help="only these tasks")
    chosen.add_argument("--task-ids-file", type=Path, metavar="IDS",
                        help="only the tasks named in this file (one directory name a line, # comments), "
                             "e.g. SWE-bench Pro's v2/hard51_ids.txt; recorded in prep.json and results.json")
    p.add_argument("--model-class", choices=["tools", "text"], default="tools",
                   help="tools (default; needs the server's tool-call parser) or text")
    p.add_argument("--runtime-bin", type=Path, default=REPO / "runtime" / "sprout-runtime",
                   help="sprout-runtime for commands (default: runtime/sprout-runtime of this checkout)")
    p.add_argument("--allow-dirty", action="store_true", help="allow uncommitted changes (recorded)")
    args = p.parse_args(argv)
    endpoint = args.endpoint.rstrip("/")
    if args.task_ids_file:
        read_task_ids(args.task_ids_file)  # a missing or empty file fails before the endpoint is probed
    if args.key_env not in os.environ:
        console.print(f"{args.key_env} is not set; using the placeholder key EMPTY (fine for a server without --api-key)")
        os.environ[args.key_env] = "EMPTY"
    probe(endpoint, args.model, os.environ[args.key_env])
    tasks_dir = args.tasks_dir.expanduser()
    if not tasks_dir.is_dir():
        raise SproutError(f"no tasks directory {tasks_dir} (pass --tasks-dir or set SPROUT_TASKS_DIR)")
    manifest_path = args.output / "prep.json"
    task_ids = load_task_ids(args.task_ids_file, tasks_dir) if args.task_ids_file else None
    manifest = prepare(tasks_dir, manifest_path, store=Store(runtime_bin=args.runtime_bin), task_ids=task_ids)
    console.print(f"prepared {manifest.dataset.name}: digest {manifest.dataset.digest}, manifest {manifest_path}")
    options = EvaluationOptions(
        dataset_digest=manifest.dataset.digest, preparation_manifest=manifest_path, model=args.model,
        model_endpoint=endpoint, model_key_env=None if configured_client() else args.key_env,  # Run Store: keyless
        model_class=args.model_class, rounds=args.rounds, branches=args.branches, step_limit=args.step_limit,
        runtime_bin=args.runtime_bin, allow_dirty=args.allow_dirty)
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "4")  # as `sprout benchmark` does by default
    failed = run_benchmark(BenchmarkConfig(tasks_dir=tasks_dir, output=args.output, methods=args.methods,
                                           tasks=args.tasks, task_ids_file=args.task_ids_file, workers=args.workers,
                                           evaluation=options))
    return 1 if failed else 0

if __name__ == "__main__":
    run_cli(main)
