"""One contract for a rollout, in-process and on a worker: every field of a rollout reaches the handler
through the typed payload, and a payload with an unknown or missing field is refused."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from sprout.agent.models import Endpoint, SamplingParams
from sprout.agent.runner import InsertedTurn, RolloutSpec
from sprout.jobs.local import RolloutRequest
from sprout.jobs.payloads import RolloutPayload, rollout_payload, rollout_request

pytestmark = pytest.mark.python_only

# A new RolloutSpec field must be added here and carried by RolloutPayload (or named local-only).
CARRIED = {"task", "model", "endpoint", "journal", "image", "cwd", "model_class", "step_limit", "token_limit",
           "wall_time_s", "command_timeout_s", "sampling", "from_journal", "from_turn", "note", "insert"}
LOCAL_ONLY = {"keep_sandbox"}  # a worker's sandboxes are its own


def test_every_field_of_a_rollout_reaches_the_worker(tmp_path: Path):
    assert {f.name for f in fields(RolloutSpec)} == CARRIED | LOCAL_ONLY
    spec = RolloutSpec(task="fix it", model="m", endpoint=Endpoint("http://h:1/v1", None), journal=tmp_path / "j.jsonl",
                       image="img:1", cwd="/app", model_class="text", step_limit=7, token_limit=9, wall_time_s=11,
                       command_timeout_s=13, sampling=SamplingParams(temperature=0.5, top_k=3, stop=["x"]),
                       from_journal=tmp_path / "parent.jsonl", from_turn=2, note="try again",
                       insert=InsertedTurn(reasoning="The sum subtracts.", command="sed -i s/-/+/ calc.py", call_id="r-1"))
    payload = rollout_payload(RolloutRequest("a1", spec, checkpoint="ck-1"), tmp_path)
    wire = RolloutPayload.model_validate(json.loads(json.dumps(payload.model_dump(mode="json"))))
    back = rollout_request(wire, spec.endpoint, "a1")
    assert {name: getattr(back.spec, name) for name in CARRIED} == {name: getattr(spec, name) for name in CARRIED}
    assert wire.from_checkpoint == back.checkpoint == "ck-1" and wire.options.endpoint.url == "http://h:1/v1"


@pytest.mark.parametrize("change, field", [
    (lambda p: p["options"].update(step_limt=3), "options.step_limt"),
    (lambda p: p.pop("task"), "task"),
    (lambda p: p["options"].pop("journal"), "options.journal"),
])
def test_a_payload_with_an_unknown_or_missing_field_is_refused(tmp_path: Path, change, field):
    spec = RolloutSpec(task="t", model="m", endpoint=Endpoint("http://h:1/v1", None), journal=tmp_path / "j.jsonl")
    body = rollout_payload(RolloutRequest("a1", spec), tmp_path).model_dump(mode="json")
    change(body)
    with pytest.raises(ValidationError) as error:
        RolloutPayload.model_validate(body)
    assert field in {".".join(map(str, e["loc"])) for e in error.value.errors()}
