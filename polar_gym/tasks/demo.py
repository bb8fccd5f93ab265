"""The built-in demo task set: tiny git repositories, each with a failing unittest and a reference solution.

Why these shapes: they let the whole loop (harness → gateway → oracle → evaluator) reach reward 1.0 on a laptop, with
nothing but the host's ``python3`` and ``git`` inside the sandbox. The reference solutions are plain POSIX shell
commands, each self-contained (it may run in a new shell whose cwd is the workdir) and free of editors, heredocs and
backslash escapes interpreted by the shell, so every harness's shell tool (``sh -c``, ``bash -lc``, argv arrays)
plays them the same way. They become the oracle engine's script (``oracle_script``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import shlex
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    EvaluatorSpec,
    OracleScript,
    PrepareAction,
    RuntimeSpec,
    TaskMetadata,
    TaskRequest,
)

__all__ = ["DEMO_TASKS", "TEST_COMMAND", "VISION_TASKS", "DemoTask", "demo_task", "demo_tasks", "solid_png"]

#: -B: no .pyc files, so an edit within the same second as a test run (same size, same mtime) is never masked
TEST_COMMAND = "python3 -B -m unittest -q"
_GITIGNORE = "__pycache__/\n*.pyc\n"
_INIT_REPO = ("git -c init.defaultBranch=main init -q && git config user.name polar && "
              "git config user.email polar@example.invalid && git add -A && git commit -q -m 'Initial commit'")


def _write_file(path: str, lines: list[str]) -> str:
    """A one-line POSIX command writing ``lines`` to ``path`` (printf with single-quoted arguments)."""
    for line in lines:
        if "'" in line:
            raise ValueError(f"reference lines must not contain single quotes: {line!r}")
    return "printf '%s\\n' " + " ".join(shlex.quote(line) for line in lines) + f" > {shlex.quote(path)}"


def _replace(path: str, old: str, new: str) -> str:
    """A one-line command replacing ``old`` by ``new`` in ``path`` (python3 -c; fails if ``old`` is absent and
    ``new`` is not there yet, so a wrong script is noticed)."""
    program = (f"import pathlib, sys; p = pathlib.Path({json.dumps(path)}); s = p.read_text(); "
               f"old = {json.dumps(old)}; new = {json.dumps(new)}; "
               'sys.exit(0 if new in s else "pattern not found") if old not in s else '
               "p.write_text(s.replace(old, new))")
    return f"python3 -c {shlex.quote(program)}"


@dataclass(frozen=True)
class DemoTask:
    """One demo task: a repository (``files``), what to ask, how to check, and a reference solution."""

    task_id: str
    instruction: str
    files: dict[str, str]
    solution: list[str]
    test_command: str = TEST_COMMAND
    final_answer: str = "The failing test passes now."
    metadata: dict[str, Any] = field(default_factory=dict)
    #: binary files (images), written by a prepare step in the sandbox
    binary_files: dict[str, bytes] = field(default_factory=dict)
    #: files the reference solution reads through the harness's read tool before its commands
    reads: list[str] = field(default_factory=list)

    def prepare_actions(self, workdir: str = "/workspace") -> list[PrepareAction]:
        """Upload every file into ``workdir`` and commit it as the repository's first commit."""
        files = {".gitignore": _GITIGNORE, **self.files}
        actions = [PrepareAction(type="upload_file", dst=posixpath.join(workdir, path), content=text)
                   for path, text in files.items()]
        for path, data in self.binary_files.items():  # file contents travel as text: decoded in the sandbox
            program = (f"import base64; open({json.dumps(path)}, 'wb').write(base64.b64decode("
                       f"{json.dumps(base64.b64encode(data).decode())}))")
            actions.append(PrepareAction(type="exec", command=f"cd {shlex.quote(workdir)} && python3 -c "
                                         f"{shlex.quote(program)}", timeout_seconds=60))
        actions.append(PrepareAction(type="exec", command=f"cd {shlex.quote(workdir)} && {_INIT_REPO}",
                                     timeout_seconds=60))
        return actions

    def evaluator(self, *, refresh_runtime: bool = False, workdir: str = "/workspace") -> EvaluatorSpec:
        """``test_on_output`` running the task's tests (at least one must run) in the repository."""
        config = {"command": self.test_command, "repo_dir": workdir, "timeout": 120, "framework": "unittest",
                  "min_tests": 1}
        return EvaluatorSpec(strategy="test_on_output", refresh_runtime=refresh_runtime, config=config)

    def oracle_script(self) -> OracleScript:
        """The reference solution as the oracle engine's script."""
        return OracleScript(commands=list(self.solution), reads=list(self.reads), final_answer=self.final_answer)

    def to_request(self, *, harness: str = "shell", model_name: str = "policy", runtime: RuntimeSpec | None = None,
                   evaluator: EvaluatorSpec | None = None, builder: BuilderSpec | None = None, num_samples: int = 1,
                   timeout_seconds: float = 600.0, refresh_runtime: bool = False) -> TaskRequest:
        """A TaskRequest whose runtime's prepare actions create the repository (any backend can run them).

        ``runtime`` supplies backend, image, network and workdir; its own prepare actions run first. The reference
        solution travels in ``metadata["oracle"]`` for the oracle engine.
        """
        base = runtime or RuntimeSpec()
        spec = base.model_copy(update={"prepare": [*base.prepare, *self.prepare_actions(base.workdir)]})
        meta = TaskMetadata(oracle=self.oracle_script().model_dump(),
                            demo_task=self.task_id, **self.metadata)
        return TaskRequest(
            task_id=self.task_id,
            instruction=self.instruction,
            num_samples=num_samples,
            timeout_seconds=timeout_seconds,
            runtime=spec,
            agent=AgentSpec(harness=harness, model_name=model_name),
            builder=builder or BuilderSpec(),
            evaluator=evaluator or self.evaluator(refresh_runtime=refresh_runtime, workdir=base.workdir),
            metadata=meta,
        )


_CALC = '''"""Tiny arithmetic helpers."""


def add(a, b):
    """Return the sum of a and b."""
    return a - b


def multiply(a, b):
    """Return the product of a and b."""
    return a * b
'''

_TEST_CALC = '''import unittest

from calc import add, multiply


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
        self.assertEqual(add(-1, 1), 0)

    def test_multiply(self):
        self.assertEqual(multiply(4, 5), 20)


if __name__ == "__main__":
    unittest.main()
'''

_TEXT_UTILS = '''"""Text helpers for building URLs."""


def slugify(title):
    """Turn a title into a URL slug: lowercase ASCII words and digits joined by single hyphens."""
    return title.replace(" ", "-")
'''

_TEST_TEXT_UTILS = '''import unittest

from text_utils import slugify


class SlugifyTest(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_spaces_and_punctuation(self):
        self.assertEqual(slugify("  Many   spaces here "), "many-spaces-here")
        self.assertEqual(slugify("Rock & Roll, 2nd edition!"), "rock-roll-2nd-edition")


if __name__ == "__main__":
    unittest.main()
'''

_TEST_STACK = '''import unittest

from stack import Stack


class StackTest(unittest.TestCase):
    def test_push_pop_order(self):
        s = Stack()
        s.push(1)
        s.push(2)
        self.assertEqual(len(s), 2)
        self.assertEqual(s.peek(), 2)
        self.assertEqual(s.pop(), 2)
        self.assertEqual(s.pop(), 1)
        self.assertEqual(len(s), 0)

    def test_empty(self):
        s = Stack()
        with self.assertRaises(IndexError):
            s.pop()
        with self.assertRaises(IndexError):
            s.peek()


if __name__ == "__main__":
    unittest.main()
'''

_STACK_README = "# stack\n\nA LIFO stack for the parser. `stack.py` is still to be written; see test_stack.py.\n"

_STORE = '''from inventory.pricing import line_total


class Store:
    """Items by name: (quantity, unit price)."""

    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        self.items[name] = (quantity, price)

    def total(self, discount=0.0):
        return sum(line_total(q, p, discount) for q, p in self.items.values())
'''

_PRICING = '''def line_total(quantity, unit_price, discount=0.0):
    """Price of a line: quantity times unit price, less a fractional discount (0.1 = 10 % off)."""
    return quantity * unit_price * discount
'''

_TEST_INVENTORY = '''import unittest

from inventory import Store
from inventory.pricing import line_total


class InventoryTest(unittest.TestCase):
    def test_line_total(self):
        self.assertAlmostEqual(line_total(3, 2.0), 6.0)
        self.assertAlmostEqual(line_total(10, 1.0, discount=0.25), 7.5)

    def test_adding_twice_accumulates(self):
        store = Store()
        store.add("apple", 2, 0.5)
        store.add("apple", 3, 0.5)
        self.assertEqual(store.items["apple"], (5, 0.5))

    def test_total(self):
        store = Store()
        store.add("pen", 4, 1.5)
        store.add("pad", 1, 3.0)
        self.assertAlmostEqual(store.total(), 9.0)
        self.assertAlmostEqual(store.total(discount=0.5), 4.5)


if __name__ == "__main__":
    unittest.main()
'''

DEMO_TASKS: dict[str, DemoTask] = {t.task_id: t for t in [
    DemoTask(
        task_id="demo-calc-add",
        instruction=("In this repository, `add` in calc.py returns the wrong result and the test in test_calc.py "
                     f"fails. Fix calc.py (not the tests). Run `{TEST_COMMAND}` to check."),
        files={"calc.py": _CALC, "test_calc.py": _TEST_CALC},
        solution=[_replace("calc.py", "return a - b", "return a + b"), TEST_COMMAND],
        final_answer="Fixed `add` in calc.py: it subtracted instead of adding. The tests pass.",
    ),
    DemoTask(
        task_id="demo-slugify",
        instruction=("`slugify` in text_utils.py should lowercase a title and join its ASCII words and digits with "
                     "single hyphens, dropping punctuation and extra spaces; test_text_utils.py fails. Fix "
                     f"text_utils.py. Run `{TEST_COMMAND}` to check."),
        files={"text_utils.py": _TEXT_UTILS, "test_text_utils.py": _TEST_TEXT_UTILS},
        solution=[_write_file("text_utils.py", [
            '"""Text helpers for building URLs."""', "", "import re", "", "",
            "def slugify(title):",
            '    """Turn a title into a URL slug: lowercase ASCII words and digits joined by single hyphens."""',
            '    return "-".join(re.findall(r"[a-z0-9]+", title.lower()))',
        ])],
        final_answer="Rewrote `slugify` to lowercase and join alphanumeric words with hyphens.",
    ),
    DemoTask(
        task_id="demo-stack-module",
        instruction=("test_stack.py tests a `Stack` class in stack.py, which does not exist yet. Create stack.py "
                     "with `push`, `pop` and `peek` (both raise IndexError when empty) and `len()` support. "
                     f"Run `{TEST_COMMAND}` to check."),
        files={"README.md": _STACK_README, "test_stack.py": _TEST_STACK},
        solution=[_write_file("stack.py", [
            "class Stack:", '    """Last in, first out."""', "",
            "    def __init__(self):", "        self._items = []", "",
            "    def push(self, item):", "        self._items.append(item)", "",
            "    def pop(self):", "        if not self._items:",
            '            raise IndexError("pop from an empty stack")',
            "        return self._items.pop()", "",
            "    def peek(self):", "        if not self._items:",
            '            raise IndexError("peek at an empty stack")', "        return self._items[-1]", "",
            "    def __len__(self):", "        return len(self._items)",
        ]), TEST_COMMAND],
        final_answer="Created stack.py with a list-backed Stack.",
    ),
    DemoTask(
        task_id="demo-inventory",
        instruction=("The inventory package has two bugs that make test_inventory.py fail: adding an item that is "
                     "already in the store must add to its quantity, and `line_total` must subtract the discount "
                     f"rather than multiply by it. Fix the package. Run `{TEST_COMMAND}` to check."),
        files={"inventory/__init__.py": "from inventory.store import Store\n\n__all__ = [\"Store\"]\n",
               "inventory/store.py": _STORE, "inventory/pricing.py": _PRICING,
               "test_inventory.py": _TEST_INVENTORY},
        solution=[
            _replace("inventory/pricing.py", "unit_price * discount", "unit_price * (1 - discount)"),
            _replace("inventory/store.py", "        self.items[name] = (quantity, price)",
                     "        held = self.items.get(name, (0, price))[0]\n"
                     "        self.items[name] = (held + quantity, price)"),
            TEST_COMMAND,
        ],
        final_answer="Fixed the discount in line_total and made Store.add accumulate quantities.",
    ),
]}


def solid_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour, written with the standard library (the same bytes every time)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


_TEST_COLOUR = f'''import hashlib
import unittest


class ColourTest(unittest.TestCase):
    def test_the_colour_is_named(self):
        with open("colour.txt") as f:
            answer = f.read().strip().lower()
        self.assertEqual(hashlib.sha256(answer.encode()).hexdigest(), "{hashlib.sha256(b"blue").hexdigest()}")


if __name__ == "__main__":
    unittest.main()
'''

#: tasks the agent must look at an image for (issue 42): kept out of :func:`demo_tasks`, which every harness's
#: oracle tests run; :func:`demo_task` finds them by id
VISION_TASKS: dict[str, DemoTask] = {t.task_id: t for t in [
    DemoTask(
        task_id="demo-colour-card",
        instruction=("card.png in this repository is a swatch of one colour. Look at it and write the colour's name "
                     "(red, green, blue or yellow), lowercase, in colour.txt. Run "
                     f"`{TEST_COMMAND}` to check."),
        files={"test_colour.py": _TEST_COLOUR},
        binary_files={"card.png": solid_png(96, 64, (30, 60, 220))},
        reads=["card.png"],
        solution=["echo blue > colour.txt", TEST_COMMAND],
        final_answer="card.png is blue; colour.txt says so.",
    ),
]}


def demo_tasks() -> list[DemoTask]:
    """Every demo task, in a stable order."""
    return list(DEMO_TASKS.values())


def demo_task(task_id: str) -> DemoTask:
    try:
        return DEMO_TASKS.get(task_id) or VISION_TASKS[task_id]
    except KeyError:
        raise KeyError(f"no demo task {task_id!r}; known: {', '.join([*DEMO_TASKS, *VISION_TASKS])}") from None
