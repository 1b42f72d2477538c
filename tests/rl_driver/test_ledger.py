"""The driver's ledger on SQLite and PostgreSQL: what one driver process records, the next one reads."""

import pytest

from sprout.rl_driver.ledger import Ledger
from tests.runstore.conftest import db_url, pg_admin_url  # noqa: F401  (fixtures: SQLite and PostgreSQL)

pytestmark = pytest.mark.python_only

SLOTS = [("g:slot:11", 11), ("g:slot:12", 12), ("g:slot:13", 13)]


def test_a_group_survives_a_new_ledger_on_the_same_database(db_url):  # noqa: F811
    first = Ledger(db_url)
    assert first.add_group("g", "digest", {"prompt_group_id": "3"}, 1000.0, SLOTS, used=2)
    assert not first.add_group("g", "other", {}, 2000.0, SLOTS, used=3)  # the id is taken
    first.set_status("g", "running")
    assert first.set_slot("g", 1000.0, "g:slot:11", state="running", job_id=7)
    assert first.set_slot("g", 1000.0, "g:slot:11", state="done", trajectory={"reward": 1.0}, budget={"model_calls": 3})
    assert first.set_slot("g", 1000.0, "g:slot:12", state="failed", failure="actor failed: boom")
    assert not first.set_slot("g", 999.0, "g:slot:13", state="failed")  # another submission of the id
    first.close()

    second = Ledger(db_url)  # a restarted driver
    assert second.unfinished() == ["g"]
    group = second.group("g")
    assert (group.digest, group.request, group.status, group.submitted_at) == ("digest", {"prompt_group_id": "3"},
                                                                              "running", 1000.0)
    assert [(s.slot_id, s.state, s.job_id) for s in group.slots] == [
        ("g:slot:11", "done", 7), ("g:slot:12", "failed", None), ("g:slot:13", "unused", None)]
    assert group.slots[0].trajectory == {"reward": 1.0} and group.slots[0].budget == {"model_calls": 3}
    assert group.slots[1].failure == "actor failed: boom"
    assert second.set_status("g", "early_stopped", "1 of 2 samples failed", 1010.0)
    assert second.unfinished() == [] and second.group("g").stop_reason == "1 of 2 samples failed"
    assert not second.set_status("g", "failed")  # a terminal status is never left
    assert not second.set_slot("g", 1000.0, "g:slot:13", state="done")  # nor its slots changed
    assert second.set_status("g", "deleting", only_live=False) and second.unfinished() == ["g"]
    second.delete("g")
    assert second.group("g") is None
    assert second.add_group("g", "digest", {}, 3000.0, SLOTS, used=1)  # a deleted id can be used again
    second.close()
