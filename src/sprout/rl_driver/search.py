"""SPROUT's search for RL, run for a request with `search`: the roots first, then, by the outcome they give
(`outcome.search_outcome`), branches from checkpoints a review of the failed rollouts chose.

    TT, TT_partial, ungraded  nothing more
    TF, FF_partial            each failed root is reviewed: up to `points` points, `tf_student_continuations`
                              students from each (none, and no review, when that is 0)
    FF                        each root is reviewed: up to `points` points, `student_continuations` students
                              from each, and `candidates` repair turns per point (identical ones merged, with
                              their `multiplicity`), each executed and continued `candidate_continuations`
                              times; while nothing at a point has resolved, the failed repair is reviewed again
                              and one more turn is inserted later in its history, up to `repair_rounds` rounds

A branch starts from the chosen turn's checkpoint with that turn's conversation (never by replaying it),
gets the configured continuation prompt as a training hint (stripped at export), runs the repair turn
first when it is a repair, and has only the model calls its root had left. Slots: the roots take the
first ones, then branches in plan order (by root, point, students, then each candidate's continuations;
later rounds after). Slots no branch needed stay unused, which is no failure.

Deadlines, inside Miles' wait (submission + wall time + finalization + `search_seconds(finalization)`):
the roots' agents stop at submission + wall time and are graded within the finalization; each round then
has `review_seconds` for its reviews and `wall_time_seconds` for its branches' agents (cut so that half
the finalization is left for grading before the group's end; a round left with less than MIN_BRANCH_S is
not started), and its grades within the finalization. A review that fails in a way nothing foresaw gets
the fallback points rather than failing the group; a reviewer endpoint that refuses the call (401, 403,
404: its configuration is wrong) ends the search there, logged, with no branch from that review.

A restarted driver runs the same search: reviews are stored in the group's directory and read back, and
the plan is a function of them and of the ledger, so the same branches land in the same slots; finished
slots stay.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..agent.journal import read_journal
from ..agent.runner import INSERTED, InsertedTurn
from ..files import write_atomic
from ..method.records import Repair, ReviewRecord
from ..method.review import ReviewerRefused, ReviewInput
from ..method.trajectory import history
from ..tasks import GradeResult
from .config import ServedTask
from .leaks import leak_terms, message_text, task_terms
from .ledger import UNFINISHED, GroupRow
from .outcome import failed, resolved, root_counts, search_outcome
from .protocol import HINT_CLOSE, HINT_OPEN, RolloutGroupRequest, SearchSpec
from .samples import BranchStart, prompt_text

if TYPE_CHECKING:
    from .groups import Driver

log = logging.getLogger("sprout.rl_driver")
GRADE_SHARE = 0.5  # of the finalization, kept for grading after a round's branches stop
MIN_BRANCH_S = 5.0  # a round whose branches would have less agent time than this is not started


@dataclass
class Planned:
    position: int
    start: BranchStart
    label: str
    search: dict[str, Any]


@dataclass
class ReviewAsk:
    """A review a round asks for: of `source` (a sample's trajectory), up to `points` points with `candidates`
    repairs each, from `first_turn` on, done by `deadline` (unix time)."""

    source: dict
    points: int
    candidates: int
    first_turn: int
    deadline: float


@dataclass
class Chain:
    """A point of an FF task and the repairs tried there, round after round."""

    point_id: str
    number: int
    root: dict
    step: int  # the turn the last repair was inserted after
    candidates: int = 0  # repair candidates numbered so far
    positions: list[int] = field(default_factory=list)  # every branch slot at this point
    last_repairs: list[int] = field(default_factory=list)  # the last round's repair continuations


class SearchRun:
    def __init__(self, driver: "Driver", group: GroupRow, request: RolloutGroupRequest, task: ServedTask,
                 stop: threading.Event):
        from .groups import finish_by

        self.driver, self.group, self.request, self.task, self.stop = driver, group, request, task, stop
        assert request.search is not None and driver.reviewer is not None and driver.config.miles.review is not None
        self.spec: SearchSpec = request.search
        self.reviewer = driver.reviewer
        self.continuation_prompt = driver.config.miles.review.continuation_prompt
        self.finish = finish_by(group, request)
        self.finalization = request.finalization_timeout_seconds
        self.reviews = driver.group_dir(group) / "reviews"
        self.next_position = self.spec.roots
        self.chains: list[Chain] = []

    def run(self) -> None:
        spec = self.spec
        deadline = self.group.submitted_at + self.request.budgets.max_wall_time_seconds
        roots = [self.driver.plan_sample(self.group, self.request, i, self.task, deadline, group_label="root",
                                         search={"kind": "root"})
                 for i in range(spec.roots) if self.group.slots[i].state in UNFINISHED]
        self.driver.run_phase(roots, self.stop, until=min(deadline + self.finalization, self.finish))
        if self._stopping():
            return  # a closing driver's roots may still run: the next driver decides the outcome
        trajectories = self._trajectories()[:spec.roots]
        outcome = search_outcome(**root_counts(spec.roots, trajectories))
        log.info("group %s: roots give %s", self.group.id, outcome)
        if outcome == "FF":  # every root was graded
            reviewed, students = [t for t in trajectories if t is not None], spec.student_continuations
        elif outcome in ("TF", "FF_partial") and spec.tf_student_continuations:
            reviewed, students = [t for t in trajectories if t is not None and failed(t)], spec.tf_student_continuations
        else:
            return
        repairing = outcome == "FF" and spec.candidates > 0
        rounds = spec.repair_rounds if repairing else 1
        for number in range(1, rounds + 1):
            if self._stopping() or self._agents_by(time.time()) - time.time() < MIN_BRANCH_S:
                return
            review_by = min(time.time() + spec.review_seconds, self._agents_by(float("inf")) - MIN_BRANCH_S)
            planned = (self._first_round(reviewed, students, repairing, review_by) if number == 1
                       else self._later_round(number, review_by))
            if not planned:
                return
            self._run_round(planned)

    def _stopping(self) -> bool:
        return self.stop.is_set() or self.driver.closing

    def _agents_by(self, start: float) -> float:
        """When the agents of a round started at `start` stop: its wall time, or earlier, leaving half the
        finalization for grading before the group's end."""
        return min(start + self.spec.wall_time_seconds, self.finish - GRADE_SHARE * self.finalization)

    def _run_round(self, planned: list[Planned]) -> None:
        agents_by = self._agents_by(time.time())
        if self._stopping() or agents_by - time.time() < MIN_BRANCH_S:
            log.warning("group %s: no time left for %d branches", self.group.id, len(planned))
            return
        self.driver.ledger.plan_slots(self.group.id, self.group.submitted_at,
                                      [self.request.sample_slots[p.position].sample_slot_id for p in planned])
        self.group = self.driver.ledger.group(self.group.id) or self.group
        plans = [self.driver.plan_sample(self.group, self.request, p.position, self.task, agents_by, branch=p.start,
                                         group_label=p.label, search=p.search)
                 for p in planned if self.group.slots[p.position].state in UNFINISHED]
        self.driver.run_phase(plans, self.stop, until=min(agents_by + self.finalization, self.finish))

    def _first_round(self, reviewed: list[dict], students: int, repairing: bool, review_by: float) -> list[Planned]:
        spec = self.spec
        tasks = [self._review_task(root, spec.points, spec.candidates if repairing else 0, 1, review_by)
                 for root in reviewed]
        reviews = self._reviews(1, tasks)
        planned: list[Planned] = []
        for root, review in zip(reviewed, reviews, strict=True):
            for number, point in enumerate(review.branch_points, start=1):
                point_id = f"{root['branch_id']}-step{point.turn}"
                start = self._start(root, root, point.turn)
                base = {"point_id": point_id, "point": number, "step": point.turn, "round": 1,
                        "parent_job_id": root["branch_id"]}
                planned += self._take(students, start, f"student:{point_id}", {"kind": "student", **base})
                if not repairing:
                    continue
                chain = Chain(point_id, number, root, point.turn)
                chain.positions = [p.position for p in planned if p.search.get("point_id") == point_id]
                for repair, multiplicity in merge(point.repairs[:spec.candidates]):
                    planned += self._repair(chain, start, repair, multiplicity, base)
                self.chains.append(chain)
        return planned

    def _later_round(self, number: int, review_by: float) -> list[Planned]:
        trajectories = self._trajectories()
        reviewed: list[tuple[Chain, dict]] = []
        for chain in self.chains:
            if any(resolved(trajectories[p]) for p in chain.positions):
                continue
            repair = next((trajectories[p] for p in chain.last_repairs if failed(trajectories[p])), None)
            if repair is not None:
                reviewed.append((chain, repair))
        tasks = [self._review_task(repair, 1, 1, chain.step + 1, review_by) for chain, repair in reviewed]
        reviews = self._reviews(number, tasks)
        planned: list[Planned] = []
        for (chain, repair), review in zip(reviewed, reviews, strict=True):
            if not review.branch_points or not review.branch_points[0].repairs:
                continue
            point = review.branch_points[0]
            base = {"point_id": chain.point_id, "point": chain.number, "step": point.turn, "round": number,
                    "parent_job_id": repair["branch_id"]}
            chain.step = point.turn
            planned += self._repair(chain, self._start(chain.root, repair, point.turn), point.repairs[0], 1, base)
        return planned

    def _repair(self, chain: Chain, start: BranchStart, repair: Repair, multiplicity: int,
                base: dict[str, Any]) -> list[Planned]:
        """The continuations of one repair candidate at `chain`'s point (numbered after the chain's last)."""
        chain.candidates += 1
        candidate = chain.candidates
        insert = InsertedTurn(reasoning=repair.reasoning, command=repair.command,
                              call_id=f"repair-{base['round']}-{candidate}")
        search = {"kind": "repair", **base, "candidate": candidate, "multiplicity": multiplicity,
                  "samples": self.spec.candidate_continuations, "leak_terms": self._leaks(start, insert),
                  "assistant_turn_rendering": "reasoning"}
        taken = self._take(self.spec.candidate_continuations, replace(start, insert=insert),
                           f"repair:{chain.point_id}:{candidate}", search)
        chain.last_repairs = [p.position for p in taken]
        chain.positions += chain.last_repairs
        return taken

    def _take(self, n: int, start: BranchStart, label: str, search: dict[str, Any]) -> list[Planned]:
        """`n` branches in the next free slots (fewer when the group's max_samples is reached)."""
        taken = []
        for _ in range(n):
            if self.next_position >= self.request.max_samples:
                log.warning("group %s: no slot left for a %s branch", self.group.id, label)
                break
            taken.append(Planned(self.next_position, start, label, search))
            self.next_position += 1
        return taken

    def _start(self, root: dict, source: dict, turn: int) -> BranchStart:
        """Turn `turn` of the sample `source` (the root, or a failed repair of a later round)."""
        journal = Path(source["metadata"]["journal"])
        prompt = self.continuation_prompt
        return BranchStart(journal=journal, turn=turn, checkpoint=read_journal(journal).turn(turn).checkpoint or "",
                           host=source["metadata"].get("host"), note=f"{HINT_OPEN}{prompt}{HINT_CLOSE}" if prompt else None,
                           insert=None, root_branch_id=root["branch_id"])

    def _review_task(self, source: dict, points: int, candidates: int, first_turn: int, deadline: float) -> ReviewAsk:
        return ReviewAsk(source, points, candidates, first_turn, deadline)

    def _reviews(self, number: int, tasks: list[ReviewAsk]) -> list[ReviewRecord]:
        """The reviews of round `number`, all at once."""
        with ThreadPoolExecutor(max_workers=max(1, len(tasks)), thread_name_prefix="review") as pool:
            return list(pool.map(self._review, [number] * len(tasks), tasks))

    def _review(self, number: int, ask: ReviewAsk) -> ReviewRecord:
        """The review of `ask.source` in round `number`: read back when a previous driver made it."""
        source = ask.source
        path = self.reviews / f"round-{number}-{source['branch_id']}.json"
        kept = _read_review(path)
        if kept is not None:
            return kept
        names = {"review_id": path.stem, "round_number": number, "reviewed": source["metadata"]["journal"]}
        inp = None
        try:
            inp = review_input(self.request, ask)
            review = self.reviewer.review(inp, deadline=ask.deadline, stop=self.stop, **names)
        except ReviewerRefused as e:  # the reviewer's configuration is wrong: no branches, and none invented
            log.error("group %s: no branches from %s: %s", self.group.id, source["branch_id"], e)
            return self.reviewer.refused(str(e), **names)
        except Exception as e:  # noqa: BLE001 - an answer or a journal nothing foresaw: the fallback, not a lost group
            log.exception("group %s: the review of %s failed", self.group.id, source["branch_id"])
            review = self.reviewer.fallback(inp, f"the review failed: {type(e).__name__}: {e}", **names)
        if self._stopping():
            return review  # cut short: not kept, a next driver asks again
        write_atomic(path, review.model_dump_json(indent=1))
        if review.fallback:
            log.info("group %s: review of %s: %s", self.group.id, source["branch_id"], review.fallback)
        return review

    @cached_property
    def hidden_terms(self) -> list[str] | None:
        return task_terms(self.task)

    def _leaks(self, start: BranchStart, insert: InsertedTurn) -> list[str] | None:
        if self.hidden_terms is None:
            return None
        history = message_text(policy_messages(read_journal(start.journal).messages_up_to(start.turn)))
        return leak_terms(f"{insert.reasoning}\n{insert.command}", history, self.hidden_terms)

    def _trajectories(self) -> list[dict | None]:
        """Each slot's trajectory (None until it returned one), by position."""
        group = self.driver.ledger.group(self.group.id) or self.group
        return [s.trajectory if s.state == "done" else None for s in group.slots]


def review_input(request: RolloutGroupRequest, ask: ReviewAsk) -> ReviewInput:
    """What the review of `ask.source` reads (its history and its grade) and is asked for."""
    journal = Path(ask.source["metadata"]["journal"])
    grade_file = journal.parent / "grade.json"
    grade = GradeResult.model_validate_json(grade_file.read_text()) if grade_file.exists() else None
    return ReviewInput(instruction=prompt_text(request.prompt), steps=history(journal),
                       verifier_output=grade.verifier_output if grade else "", reward=grade.reward if grade else None,
                       points=ask.points, candidates=ask.candidates, first_turn=ask.first_turn,
                       max_calls=request.max_turns)


def _read_review(path: Path) -> ReviewRecord | None:
    """A review a previous driver stored, or None (none, or one this version cannot read: asked again)."""
    if not path.exists():
        return None
    try:
        return ReviewRecord.model_validate_json(path.read_text())
    except ValidationError:
        log.warning("%s: a stored review this version cannot read; asking again", path)
        return None


def policy_messages(messages: list[dict]) -> list[dict]:
    """The history without earlier inserted turns and their results: what a reviewer wrote before is no
    evidence that the agent was shown a hidden term."""
    inserted = [m for m in messages if (m.get("extra") or {}).get(INSERTED)]
    calls = {call.get("id") for m in inserted for call in m.get("tool_calls") or []}
    left_out = {id(m) for m in inserted} | {id(m) for m in messages
                                           if m.get("role") == "tool" and m.get("tool_call_id") in calls}
    return [m for m in messages if id(m) not in left_out]


def merge(repairs: list[Repair]) -> list[tuple[Repair, int]]:
    """Identical repairs (the same reasoning and command) as one, with how many times it was written."""
    merged: dict[tuple[str, str], list] = {}
    for repair in repairs:
        key = (repair.reasoning.strip(), repair.command.strip())
        merged.setdefault(key, [repair, 0])[1] += 1
    return [(repair, count) for repair, count in merged.values()]
