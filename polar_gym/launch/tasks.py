"""Task sources for the ``tasks`` config group: callables ``(template, **params) -> list[TaskRequest] | TaskSet``
(a TaskSet also names the tasks the source refused; the launch reports each as an ERROR session)."""

from __future__ import annotations

import os
import shlex
from typing import Literal

from pydantic import ValidationError

from polar_gym.datagen.template import TaskTemplate
from polar_gym.runtime.podman_host import default_cli
from polar_gym.schema import EvaluatorSpec, TaskRequest
from polar_gym.tasks import DEMO_TASKS, demo_tasks
from polar_gym.tasks.harbor import HarborTask, refusal, scan_tasks
from polar_gym.tasks.harbor_images import Runner, ensure_image, run_command
from polar_gym.tasks.refused import RefusedTask, TaskSet

__all__ = ["demo_requests", "harbor_requests", "harbor_task_requests"]

#: the evaluator group's default: a template still carrying it (with no keys) means "the task's own evaluator"
_DEFAULT_EVALUATOR = "test_on_output"


def demo_requests(template: TaskTemplate, ids: list[str] | None = None) -> list[TaskRequest]:
    """The built-in demo tasks (all, or those in ``ids``) as TaskRequests shaped by ``template``."""
    if ids is not None:
        unknown = [i for i in ids if i not in DEMO_TASKS]
        if unknown:
            raise ValueError(f"unknown demo task(s) {unknown}; known: {', '.join(DEMO_TASKS)}")
        chosen = [DEMO_TASKS[i] for i in ids]
    else:
        chosen = demo_tasks()
    requests = []
    for task in chosen:
        default_eval = task.evaluator(refresh_runtime=template.evaluator.refresh_runtime,
                                      workdir=template.runtime.workdir)
        evaluator = with_task_outcome(template.evaluator, default_eval)
        if evaluator.strategy == default_eval.strategy:  # keep the task's test command, apply overrides over it
            config = {**default_eval.config.model_dump(), **evaluator.config.model_dump()}
            evaluator = evaluator.model_copy(update={"config": type(evaluator.config)(**config)})
        request = task.to_request(harness=template.agent.harness, model_name=template.agent.model_name,
                                  runtime=template.runtime, evaluator=evaluator, builder=template.builder,
                                  num_samples=template.num_samples, timeout_seconds=template.timeout_seconds)
        if template.agent.config:
            request = request.model_copy(update={"agent": template.agent})
        requests.append(TaskRequest.model_validate(request.model_dump()))  # re-validate the whole request
    return requests


def with_task_outcome(chosen: EvaluatorSpec, task_evaluator: EvaluatorSpec) -> EvaluatorSpec:
    """``evaluator=rubric`` without an ``outcome`` scores the task's own way (its tests) plus the judge: the task's
    evaluator becomes the rubric's outcome."""
    keys = chosen.config.model_dump()
    if chosen.strategy != "rubric" or "outcome" in keys:
        return chosen
    outcome = {"strategy": task_evaluator.strategy, "config": task_evaluator.config.model_dump()}
    return chosen.model_copy(update={"config": type(chosen.config)(**keys, outcome=outcome),
                                     "refresh_runtime": chosen.refresh_runtime or task_evaluator.refresh_runtime})


def _harbor_evaluator(task: HarborTask, template: TaskTemplate) -> EvaluatorSpec:
    """The task's ``harbor`` evaluator, with the evaluator group's keys over it; another evaluator named in the
    group (with keys, or not the default) is kept as it is."""
    chosen = with_task_outcome(template.evaluator, task.evaluator(refresh_runtime=template.evaluator.refresh_runtime))
    keys = chosen.config.model_dump()
    if chosen.strategy == "harbor":
        return task.evaluator(refresh_runtime=chosen.refresh_runtime, overrides=keys)
    if chosen.strategy == _DEFAULT_EVALUATOR and not keys:
        return task.evaluator(refresh_runtime=chosen.refresh_runtime)
    return chosen


def harbor_requests(template: TaskTemplate, path: str, ids: list[str] | None = None,
                    solution: Literal["reference", "none"] = "reference",
                    build_images: bool = True) -> TaskSet:
    """Harbor task directories under ``path`` (all, or those in ``ids``) as TaskRequests shaped by ``template``:
    the environment becomes the runtime (on runtime=docker the Dockerfile is built into the session image when
    missing), the ``harbor`` evaluator runs the task's tests, the oracle plays ``solution``. A task refused (its
    files, its env, a request that does not validate) is left out and named in the set's ``refused``; a set with no
    usable task is a ConfigError naming every refused one."""
    return harbor_task_requests(template, path, ids, solution, build_images)


def harbor_task_requests(template: TaskTemplate, path: str, ids: list[str] | None = None,
                         solution: Literal["reference", "none"] = "reference", build_images: bool = True,
                         runner: Runner = run_command) -> TaskSet:
    """:func:`harbor_requests` with the runner of the image commands (tests record them)."""
    if solution not in ("reference", "none"):
        raise ValueError(f"tasks.solution must be reference or none, not {solution!r}")
    tasks, refused = scan_tasks(path, ids)
    made: list[tuple[HarborTask, TaskRequest]] = []
    for task in tasks:  # every task is read before any image is built
        try:
            made.append((task, task.to_request(
                harness=template.agent.harness, model_name=template.agent.model_name, runtime=template.runtime,
                evaluator=_harbor_evaluator(task, template), builder=template.builder,
                num_samples=template.num_samples, timeout_seconds=template.timeout_seconds, solution=solution)))
        except ValidationError as exc:
            refused.append(RefusedTask(task.task_id, f"{task.path}: its request does not validate: {exc}"))
        except ValueError as exc:  # ConfigError (a refused file, an environment this runtime cannot run), caps
            refused.append(RefusedTask(task.task_id, str(exc)))
    if not made:
        raise refusal(path, refused, len(refused))
    requests = []
    for task, request in made:
        if build_images and request.runtime.backend == "docker" and not task.config.environment.docker_image:
            cli = os.environ.get("POLAR_DOCKER_CLI")  # the CLI the docker backend takes, too
            argv = shlex.split(cli) if cli else list(default_cli())
            assert request.runtime.image is not None
            ensure_image(argv, request.runtime.image, task.environment_dir, task.session_dockerfile(),
                         timeout=task.config.environment.build_timeout_sec, runner=runner)
        if template.agent.config:
            request = request.model_copy(update={"agent": template.agent})
        requests.append(request)
    return TaskSet(requests, refused)
