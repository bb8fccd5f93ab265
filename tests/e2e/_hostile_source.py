"""A ``tasks`` plug point for tests/e2e/test_hostile_tasks.py: the Harbor tasks under ``path`` plus runtime requests
a Harbor task directory cannot produce (its env is refused at load), built like a trainer would send them: the good
task's request with the verifier's exec env set to what a host's dynamic loader reads (``LD_PRELOAD`` of the host
library by absolute path, of ``./evil.so`` that the tests write into the session first, ``LD_AUDIT``). They reach the
backend, whose refusal must end each as a per-session error (the launch runs it as
``tasks._target_=tests.e2e._hostile_source:hostile_requests``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch.tasks import harbor_requests
from polar_gym.schema import TaskRequest
from polar_gym.tasks.harbor import pack_files
from polar_gym.tasks.refused import TaskSet

__all__ = ["REQUESTS", "hostile_requests"]

#: task id -> the verifier env of the request (``{lib}``: the host library's absolute path) and whether its tests
#: first copy the library into the session (``tests/`` of the preload-written task)
REQUESTS: dict[str, tuple[dict[str, str], bool]] = {
    "request-preload-host": ({"LD_PRELOAD": "{lib}"}, False),
    "request-preload-written": ({"LD_PRELOAD": "./evil.so"}, True),
    "request-audit-host": ({"LD_AUDIT": "{lib}"}, False),
}


def hostile_requests(template: TaskTemplate, path: str, lib: str, ids: list[str] | None = None,
                     solution: Literal["reference", "none"] = "reference", build_images: bool = True) -> TaskSet:
    tasks = harbor_requests(template, path, ids, solution, build_images)
    good = next(r for r in tasks.requests if r.task_id == "good")
    written = pack_files(Path(path) / "preload-written" / "tests")
    extra: list[TaskRequest] = []
    for task_id, (env, writes) in REQUESTS.items():
        config = {**good.evaluator.config.model_dump(), "env": {k: v.format(lib=lib) for k, v in env.items()}}
        if writes:
            config["tests"] = written
        evaluator = good.evaluator.model_copy(update={"config": type(good.evaluator.config)(**config)})
        extra.append(TaskRequest.model_validate(
            good.model_copy(update={"task_id": task_id, "evaluator": evaluator}).model_dump()))
    return TaskSet([*tasks.requests, *extra], tasks.refused)
