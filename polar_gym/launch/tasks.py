"""Task sources for the ``tasks`` config group: callables ``(template, **params) -> list[TaskRequest]``."""

from __future__ import annotations

from polar_gym.datagen.template import TaskTemplate
from polar_gym.schema import TaskRequest
from polar_gym.tasks import DEMO_TASKS, demo_tasks

__all__ = ["demo_requests"]


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
        evaluator = template.evaluator
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
