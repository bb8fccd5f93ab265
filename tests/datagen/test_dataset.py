"""The dataset task source: demo rows reuse the demo tasks, SWE-bench rows get swebench_harness, bad rows fail
naming their line, and conf/tasks/dataset.yaml composes into a launch job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from polar_gym.datagen import DatasetError, dataset_requests, load_dataset
from polar_gym.launch import CONF_DIR, ConfigError, build_job
from polar_gym.schema import EvaluatorSpec
from polar_gym.tasks import DEMO_TASKS
from tests.datagen._datagen_kit import EXAMPLE, template

SWEBENCH_ROW = {
    "instance_id": "getmoto__moto-5752", "repo": "getmoto/moto", "base_commit": "b2300f1", "version": "4.0",
    "problem_statement": "describe_parameters ignores a filter.", "FAIL_TO_PASS": ["tests/test_ssm.py::test_a"],
    "PASS_TO_PASS": ["tests/test_ssm.py::test_b"], "image": "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752",
}


def write_rows(tmp_path: Path, *rows: object) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_example_dataset_is_demo_tasks_under_distinct_fake_repos():
    rows = load_dataset(EXAMPLE)
    assert {r.demo for r in rows} == set(DEMO_TASKS)  # every demo task, some twice
    assert len({r.instance_id for r in rows}) == len(rows) and len({r.repo for r in rows}) >= 4
    requests = dataset_requests(template(), str(EXAMPLE))
    for row, request in zip(rows, requests, strict=True):
        demo = DEMO_TASKS[row.demo]
        meta = request.metadata.model_dump()
        assert request.task_id == row.instance_id and request.instruction == demo.instruction
        assert meta["repo"] == row.repo and meta["group_id"] == row.instance_id
        assert meta["oracle"]["commands"] == demo.solution  # the oracle engine can play it
        assert request.evaluator.strategy == "test_on_output"
        assert request.evaluator.config.model_dump()["command"] == demo.test_command
        assert [a.dst for a in request.runtime.prepare if a.type == "upload_file"][-1].endswith(".py")
        assert request.num_samples == 2


def test_limit_and_ids_select_rows_in_file_order():
    ids = ["umbrella__shop-9", "acme__calc-1"]
    assert [r.task_id for r in dataset_requests(template(), str(EXAMPLE), ids=ids)] == ids[::-1]
    assert [r.task_id for r in dataset_requests(template(), str(EXAMPLE), limit=2)] == ["acme__calc-1",
                                                                                       "globex__mathkit-7"]
    with pytest.raises(DatasetError, match="unknown instance_id"):
        dataset_requests(template(), str(EXAMPLE), ids=["nope"])


def test_a_swebench_row_gets_its_image_testbed_and_the_swebench_evaluator(tmp_path):
    path = write_rows(tmp_path, SWEBENCH_ROW)
    (request,) = dataset_requests(template(EvaluatorSpec(strategy="swebench_harness")), str(path))
    assert request.task_id == "getmoto__moto-5752" and request.instruction.startswith("describe_parameters")
    assert request.runtime.image == SWEBENCH_ROW["image"] and request.runtime.workdir == "/testbed"
    config = request.evaluator.config.model_dump()
    assert request.evaluator.strategy == "swebench_harness" and request.evaluator.refresh_runtime
    assert config["instance"]["FAIL_TO_PASS"] == SWEBENCH_ROW["FAIL_TO_PASS"]
    assert config["instance"]["base_commit"] == "b2300f1" and "image" in config["instance"]
    meta = request.metadata.model_dump()
    assert (meta["repo"], meta["base_commit"], meta["version"]) == ("getmoto/moto", "b2300f1", "4.0")


def test_a_swebench_row_under_the_default_test_evaluator_is_refused_with_a_hint(tmp_path):
    path = write_rows(tmp_path, SWEBENCH_ROW)
    with pytest.raises(DatasetError, match=r"rows.jsonl:1 \(getmoto__moto-5752\).*swebench_harness"):
        dataset_requests(template(), str(path))


def test_a_custom_row_gets_setup_in_its_workdir_and_its_test_command(tmp_path):
    row = {"instance_id": "x-1", "repo": "me/x", "instruction": "Make it pass.", "image": "python:3.12",
           "workdir": "/src", "setup": "pip install -e .", "test_command": "pytest -q"}
    (request,) = dataset_requests(template(), str(write_rows(tmp_path, row)))
    assert request.runtime.workdir == "/src" and request.runtime.image == "python:3.12"
    assert [a.command for a in request.runtime.prepare] == ["cd /src && pip install -e ."]
    assert request.evaluator.config.model_dump()["command"] == "pytest -q"
    assert request.evaluator.config.model_dump()["repo_dir"] == "/src"


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"rows.jsonl:2: not JSON"),
    ('["a", "list"]', r"rows.jsonl:2: a row must be a JSON object"),
    ('{"repo": "a/b", "instruction": "x"}', r"rows.jsonl:2: instance_id: Field required"),
    ('{"instance_id": "b", "instruction": "x"}', r"rows.jsonl:2: repo: Field required"),
    ('{"instance_id": "b", "repo": "a/b"}', r"rows.jsonl:2: .*needs an instruction"),
    ('{"instance_id": "b", "repo": "a/b", "demo": "demo-nope"}', r"rows.jsonl:2: .*unknown demo task 'demo-nope'"),
    ('{"instance_id": "a", "repo": "a/b", "instruction": "x"}', r"rows.jsonl:2: instance_id 'a' repeats line 1"),
])
def test_a_bad_row_fails_naming_its_line(tmp_path, line, message):
    path = write_rows(tmp_path, {"instance_id": "a", "repo": "a/a", "instruction": "ok"}, line)
    with pytest.raises(DatasetError, match=message):
        load_dataset(path)


def test_a_missing_file_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_dataset(tmp_path / "absent.jsonl")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_tasks_dataset_composes_into_a_launch_job(tmp_path):
    job = build_job(composed("tasks=dataset", f"tasks.path={EXAMPLE}", "tasks.limit=3", "num_samples=4",
                             f"out_dir={tmp_path}"))
    assert [r.task_id for r in job.requests] == ["acme__calc-1", "globex__mathkit-7", "acme__slugs-3"]
    assert {r.num_samples for r in job.requests} == {4} and {r.agent.harness for r in job.requests} == {"pi"}


def test_tasks_dataset_errors_surface_as_config_errors(tmp_path):
    bad = write_rows(tmp_path, '{"instance_id": "a"}')
    with pytest.raises(ConfigError, match=r"tasks: .*rows.jsonl:1: repo: Field required"):
        build_job(composed("tasks=dataset", f"tasks.path={bad}", f"out_dir={tmp_path}"))
