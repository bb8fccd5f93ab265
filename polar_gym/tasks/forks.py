"""Forked tasks: a task that carries alternative oracle solutions beside its reference, by config.

Why: to show that a policy learns from the reward and not from imitation, train on a right and a wrong demo of the
same task that differ in one token (demo-calc-add's ``return a + b`` against ``return a * b``): SFT alone leaves the
model near 50/50 between them and only the reward can separate them. A fork works on any task whose request carries
an oracle script (``metadata["oracle"]``: the demo tasks, dataset rows naming a demo, Harbor tasks), whatever its
source; Harbor tasks may also bring their own ``solution-<name>/`` directories (:mod:`polar_gym.tasks.harbor`).

A :class:`TaskFork` (the launch's top-level ``forks`` list) names the variant and says how it differs from the
reference: ``replace`` (each ``old`` string replaced by its ``new`` in the reference's commands and final answer;
each ``old`` must occur there; a list of ``{old, new}``, or in YAML a mapping ``{OLD: NEW}``) or explicit
``commands`` (and ``final_answer``). :func:`fork_requests` adds each
variant to the matching requests' ``metadata.oracle_variants``; sample i of a task then plays
``[reference, *variants][i % n]`` (:meth:`polar_gym.schema.TaskMetadata.for_sample`) and its results name the
script in ``task_metadata.oracle_variant``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polar_gym.schema import ORACLE_NAME_PATTERN, OracleScript, TaskMetadata, TaskRequest
from polar_gym.settings import ConfigError, Problem

__all__ = ["REFERENCE", "Replacement", "TaskFork", "fork_requests", "oracle_scripts", "played_instead"]

#: the name of a task's own oracle script
REFERENCE = "reference"


class Replacement(BaseModel):
    """One substitution of a fork: every occurrence of ``old`` becomes ``new``."""

    model_config = ConfigDict(extra="forbid")

    old: str = Field(min_length=1, description="text of the reference solution, verbatim (inside its quoting)")
    new: str = Field(description="what replaces it")


class TaskFork(BaseModel):
    """One alternative oracle solution, added to the tasks it names (``null``: every task with an oracle script)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ORACLE_NAME_PATTERN, description="the variant's name (letters, digits, - and _; not "
                      "'reference'): sessions that play it say oracle_variant=NAME in their task_metadata and SFT "
                      "records")
    tasks: list[str] | None = Field(default=None, description="the task ids it applies to (null: every task whose "
                                    "request has an oracle script)")
    replace: list[Replacement] | None = Field(default=None, description="[{old, new}, ...] replaced in order in "
                                              "the reference's commands and final answer, each old must occur there "
                                              "(in YAML also a mapping {OLD: NEW})")
    commands: list[str] | None = Field(default=None, description="instead of replace: the variant's own shell "
                                       "commands")
    final_answer: str | None = Field(default=None, description="the variant's final answer (null: the "
                                     "reference's, after replace)")

    @field_validator("replace", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        """A mapping {OLD: NEW} (what YAML reads best) is the list of its pairs; a Hydra override cannot quote a
        mapping's keys, so the command line writes [{old: ..., new: ...}]."""
        if isinstance(value, Mapping):
            return [{"old": old, "new": new} for old, new in value.items()]
        return value

    @model_validator(mode="after")
    def _one_way(self) -> TaskFork:
        if self.name == REFERENCE:
            raise ValueError(f"{REFERENCE!r} names the task's own solution; pick another name (e.g. wrong)")
        if (self.replace is None) == (self.commands is None):
            raise ValueError("give either replace (OLD: NEW pairs applied to the reference) or commands, not "
                             f"{'both' if self.replace is not None else 'neither'}")
        if self.replace is not None and not self.replace:
            raise ValueError("replace needs at least one {old, new} pair")
        if self.tasks is not None and not self.tasks:
            raise ValueError("tasks is an empty list; null applies the fork to every task with an oracle script")
        return self

    def script(self, reference: OracleScript, task_id: str) -> OracleScript:
        """This fork's script for a task whose reference is ``reference``; ValueError naming the task, the fork and
        what is wrong (an OLD string absent from the reference, a variant equal to it)."""
        commands, answer = list(reference.commands), reference.final_answer
        if self.replace is not None:
            for pair in self.replace:
                old, new = pair.old, pair.new
                if not any(old in text for text in [*commands, answer]):
                    raise ValueError(f"task {task_id}: fork {self.name!r}: {old!r} does not occur in the reference "
                                     "solution's commands or final answer (they hold the text verbatim, inside its "
                                     "shell or JSON quoting)")
                commands = [c.replace(old, new) for c in commands]
                answer = answer.replace(old, new)
        else:
            assert self.commands is not None
            commands = list(self.commands)
        if self.final_answer is not None:
            answer = self.final_answer
        if commands == reference.commands and answer == reference.final_answer:
            raise ValueError(f"task {task_id}: fork {self.name!r} leaves the reference solution unchanged")
        return OracleScript(commands=commands, reads=list(reference.reads), final_answer=answer, name=self.name)


def oracle_scripts(metadata: TaskMetadata) -> list[OracleScript]:
    """A task's oracle scripts: the reference (``metadata.oracle``) then its variants; empty without a reference."""
    raw = (metadata.model_extra or {}).get("oracle")
    if raw is None:
        return []
    return [OracleScript.model_validate(raw), *(metadata.oracle_variants or [])]


def played_instead(requests: Sequence[TaskRequest], script: OracleScript) -> list[TaskRequest]:
    """Every request with ``script`` as its oracle solution, instead of its task's own and a fork's variants: what a
    launch's ``inference.oracle_script`` promises. The oracle plays a session's own script before the one it was
    started with, and every demo and Harbor task carries one, so passing the file to the gateways alone was not
    enough (the Slurm node-failure tests' slow script was never played)."""
    return [r.model_copy(update={"metadata": TaskMetadata.model_validate(
        {**r.metadata.model_dump(), "oracle": script.model_dump(), "oracle_variants": None})}) for r in requests]


def _forked(request: TaskRequest, forks: list[tuple[int, TaskFork]], problems: list[Problem]) -> TaskRequest:
    try:
        scripts = oracle_scripts(request.metadata)
    except ValueError as exc:
        problems += [(f"forks.{i}", f"task {request.task_id}: its oracle script does not validate: {exc}")
                     for i, _ in forks]
        return request
    if not scripts:
        problems += [(f"forks.{i}.tasks", f"fork {f.name!r}: task {request.task_id} has no oracle script to fork")
                     for i, f in forks]
        return request
    added: list[OracleScript] = []
    for index, fork in forks:
        taken = [s.name for s in [*scripts, *added]]
        if fork.name in taken:
            problems.append((f"forks.{index}.name", f"task {request.task_id} already has an oracle script named "
                             f"{fork.name!r} (its scripts: {', '.join(taken)})"))
            continue
        try:
            added.append(fork.script(scripts[0], request.task_id))
        except ValueError as exc:
            hint = ("; without a tasks list a fork applies to every task with an oracle script: list the ones it "
                    "is for in tasks") if fork.tasks is None else ""
            problems.append((f"forks.{index}", f"{exc}{hint}"))
    if not added:
        return request
    total = len(scripts) + len(added)
    if request.num_samples < total:
        problems.append(("num_samples", f"task {request.task_id} has {total} oracle scripts "
                         f"({', '.join(s.name for s in [*scripts, *added])}) but num_samples={request.num_samples}: "
                         f"some would never play; set num_samples to a multiple of {total}"))
    # a forked task's scripts think briefly: quoting the command would put every token the fork changes into the
    # reasoning too, and a model would have to learn the fork twice (and to copy it) instead of once
    brief = [s.model_copy(update={"reasoning": "brief"}) for s in [*scripts, *added]]
    data: dict[str, Any] = request.metadata.model_dump()
    data["oracle"] = brief[0].model_dump()
    data["oracle_variants"] = [s.model_dump() for s in brief[1:]]
    return request.model_copy(update={"metadata": TaskMetadata.model_validate(data)})


def fork_requests(requests: Sequence[TaskRequest], forks: Sequence[TaskFork],
                  refused: Collection[str] = ()) -> list[TaskRequest]:
    """``requests`` with every fork's variant added to the tasks it applies to (pure: new requests, in order).

    A ConfigError lists every problem at once, each naming the task and the fork: a fork naming an unknown task id
    (``refused``: ids the task source refused, named without error), a task without an oracle script, an OLD string
    absent from a task's reference, a variant equal to the reference, a name already taken, a fork that applies to no
    task, num_samples too small for every script to play."""
    problems: list[Problem] = []
    names = [f.name for f in forks]
    for index, name in enumerate(names):
        if name in names[:index]:
            problems.append((f"forks.{index}.name", f"{name!r} names two forks"))
    known = list(dict.fromkeys(r.task_id for r in requests))  # in the run's order, for the message
    wanted: dict[str, list[tuple[int, TaskFork]]] = {}
    for index, fork in enumerate(forks):
        if fork.tasks is None:
            applies = [r.task_id for r in requests if "oracle" in (r.metadata.model_extra or {})]
            if not applies:
                problems.append((f"forks.{index}", f"fork {fork.name!r}: no task has an oracle script to fork"))
        else:
            unknown = [t for t in fork.tasks if t not in known and t not in refused]
            if unknown:
                problems.append((f"forks.{index}.tasks", f"fork {fork.name!r}: unknown task id(s) "
                                 f"{', '.join(unknown)}; known: {', '.join(known) or 'none'}"))
            applies = [t for t in fork.tasks if t in known]
        for task_id in applies:
            wanted.setdefault(task_id, []).append((index, fork))
    out = [_forked(r, wanted[r.task_id], problems) if r.task_id in wanted else r for r in requests]
    if problems:
        raise ConfigError("", problems=problems, title="the forks cannot be applied")
    return out
