"""scripts/test.sh's heavy run keeps tests that share one session resource on one xdist worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import SHARED_GROUP, VISION_GROUP, xdist_group_of


@dataclass
class FakeItem:
    nodeid: str
    markers: tuple[str, ...] = ()
    fixturenames: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path("/repo") / self.nodeid.split("::", 1)[0]

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return pytest.Mark(name, (), {}) if name in self.markers else None


@pytest.mark.parametrize(("item", "group"), [
    (FakeItem("tests/engine/test_x.py::t", ("engine",), ["vllm_server"]), SHARED_GROUP),
    (FakeItem("tests/docs/test_doc_commands.py::t[trl.md:64]", ("engine",)), "tests/docs/test_doc_commands.py"),
    (FakeItem("tests/engine/test_vlm_vllm.py::t", ("engine",), ["vllm_vlm_server"]), VISION_GROUP),
    (FakeItem("tests/proxy/test_images.py::t", ("slow",), ["tmp_path", "vllm_vlm_server"]), VISION_GROUP),
    (FakeItem("tests/env/test_gym.py::t", ("slow",), ["tmp_path", "vllm_server"]), SHARED_GROUP),  # by its fixture
    (FakeItem("tests/trainer/test_y.py::t", ("slow",), ["vllm_train_server"]), SHARED_GROUP),
    (FakeItem("tests/launch/test_slurm_real.py::t", ("slurm", "slow")), SHARED_GROUP),
    (FakeItem("tests/launch/t.py::t", ("slurm",), ["vllm_train_server"]), SHARED_GROUP),  # the cluster and the engine
    (FakeItem("tests/unprivileged/test_user_docker.py::t", ("slow",)), SHARED_GROUP),  # one user clone
    (FakeItem("tests/e2e/test_harnesses_e2e.py::t[pi]", ("slow",)), "tests/e2e/test_harnesses_e2e.py"),
])
def test_each_heavy_test_lands_in_the_group_of_what_it_shares(item: FakeItem, group: str) -> None:
    assert xdist_group_of(item) == group  # type: ignore[arg-type]

