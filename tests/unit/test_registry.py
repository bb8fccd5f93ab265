"""The one plug-in loader (dotted paths, checked classes, typed registries) and the package version."""

from __future__ import annotations

import collections
import functools
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import polar_gym
from polar_gym.registry import HARNESSES, Registry, RegistryError, load_dotted

ROOT = Path(__file__).resolve().parents[2]


def test_load_dotted_takes_both_spellings_and_names_what_is_missing() -> None:
    assert load_dotted("collections:OrderedDict") is collections.OrderedDict
    assert load_dotted("collections.OrderedDict") is collections.OrderedDict
    with pytest.raises(RegistryError, match="not a dotted path"):
        load_dotted("OrderedDict")
    with pytest.raises(RegistryError, match="cannot import 'no_such_module_here'"):
        load_dotted("no_such_module_here:X")
    with pytest.raises(RegistryError, match="has no attribute 'Nope'"):
        load_dotted("collections:Nope")


def test_load_dotted_with_expected_accepts_only_that_class_or_a_subclass() -> None:
    assert load_dotted("collections:OrderedDict", dict) is collections.OrderedDict
    assert load_dotted("builtins:dict", dict) is dict
    with pytest.raises(RegistryError, match=r"not a subclass of builtins\.list"):
        load_dotted("collections:OrderedDict", list)
    with pytest.raises(RegistryError, match="not a subclass"):
        load_dotted("os.path:join", object)  # a function is not a class


def test_a_registry_loads_lazily_once_and_through_its_loader() -> None:
    loads: list[str] = []

    def load(path: str) -> type[dict[str, int]]:
        loads.append(path)
        return load_dotted(path, dict)

    reg: Registry[type[dict[str, int]]] = Registry("mapping", {"ordered": "collections:OrderedDict"}, load=load)
    assert loads == []  # naming a plug-in imports nothing
    assert reg.get("ordered") is collections.OrderedDict
    assert reg.get("ordered") is collections.OrderedDict
    assert loads == ["collections:OrderedDict"]  # cached after the first use
    assert reg.get("collections:defaultdict") is collections.defaultdict  # a dotted path works as a name
    with pytest.raises(RegistryError, match="not a subclass"):
        reg.get("collections:deque")
    with pytest.raises(RegistryError, match="unknown mapping 'plain'; known: ordered"):
        reg.get("plain")
    reg.register("counter", collections.Counter)
    assert reg.names() == ["counter", "ordered"]


def test_a_checked_registry_can_be_built_with_partial() -> None:
    reg: Registry[type[dict[str, int]]] = Registry("mapping", {"bad": "collections:deque"},
                                                   load=functools.partial(load_dotted, expected=dict))
    with pytest.raises(RegistryError, match=r"'collections:deque' is not a subclass of builtins\.dict"):
        reg.get("bad")


def test_the_built_in_registries_name_importable_plug_ins() -> None:
    assert HARNESSES.get("shell").name == "shell"


def test_the_version_is_pyprojects_read_from_the_package_metadata() -> None:
    written = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    try:
        installed = metadata.version("polar_gym")
    except metadata.PackageNotFoundError:
        pytest.skip("the clone is not installed here (bash scripts/setup.sh installs it editable)")
    assert installed == written
    assert polar_gym.__version__ == written


def test_a_bare_source_tree_says_its_version_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    monkeypatch.delitem(vars(polar_gym), "__version__", raising=False)
    assert polar_gym.__version__ == "0+unknown"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = polar_gym.nope
