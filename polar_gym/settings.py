"""Typed settings: the one configuration error, validation that names the offending key, and the reference table.

Every component is built from a pydantic settings model by a ``build_*`` function; whatever reads the settings (an
argparse CLI, a Hydra group, a test) validates into that model, so defaults live in one place and a bad key fails
the same way everywhere: with a :class:`ConfigError` whose message names the key by its config path
(``harness.config.bogus: extra inputs are not permitted``). A CLI turns it into its usual exit; ``launch`` exits 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

__all__ = ["ConfigError", "Problem", "error_problems", "flat_items", "reference_rows", "reference_table", "validate",
           "validation_problems"]

M = TypeVar("M", bound=BaseModel)

#: one problem: the config path of the key (empty: the whole section) and what is wrong with it
Problem = tuple[str, str]


def _join(prefix: str, key: str) -> str:
    return ".".join(p for p in (prefix, key) if p)


class ConfigError(ValueError):
    """A configuration that does not validate; every problem names its key by config path (``inference.engine``).

    One problem reads ``key: message``; several read ``title:`` followed by one indented ``key: message`` line each.
    """

    def __init__(self, message: str, *, key: str = "", problems: Iterable[Problem] | None = None,
                 title: str = "invalid config") -> None:
        self.problems: list[Problem] = list(problems) if problems is not None else [(key, message)]
        self.title = title
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"{key}: {message}" if key else message for key, message in self.problems]
        if len(lines) == 1:
            return lines[0]
        return f"{self.title}:\n" + "\n".join(f"  {line}" for line in lines)

    @property
    def keys(self) -> list[str]:
        """The config paths named, in order."""
        return [key for key, _ in self.problems]

    def under(self, prefix: str) -> ConfigError:
        """The same problems with every key below ``prefix`` (``upstreams`` -> ``inference.upstreams``)."""
        return self.renamed(lambda key: _join(prefix, key))

    def renamed(self, name: Callable[[str], str]) -> ConfigError:
        """The same problems with each key renamed (a CLI shows ``--upstream`` where a config says ``upstreams``)."""
        title = self.title
        return ConfigError("", problems=[(name(key), msg) for key, msg in self.problems], title=title)


def _message(error: Mapping[str, Any]) -> str:
    text = str(error["msg"])
    if text.startswith("Value error, "):  # a validator's own ValueError: its words, without pydantic's prefix
        text = text[len("Value error, "):]
    return text[:1].lower() + text[1:]


#: how pydantic names the members of a union in an error's location (``command.str``, ``command.list[str]``)
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "set", "tuple", "none"})


def _path(loc: Iterable[Any]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p)))


def error_problems(errors: Iterable[Mapping[str, Any]], prefix: str = "") -> list[Problem]:
    """One ``(config path, message)`` per key with pydantic errors (``ValidationError.errors()``), the path below
    ``prefix``; a union's members' messages are joined (``command: input should be a valid string or ...``)."""
    merged: dict[str, list[str]] = {}
    for err in errors:
        messages = merged.setdefault(_join(prefix, _path(err["loc"])), [])
        if _message(err) not in messages:
            messages.append(_message(err))
    return [(key, " or ".join(messages)) for key, messages in merged.items()]


def validation_problems(exc: ValidationError, prefix: str = "") -> list[Problem]:
    """One ``(config path, message)`` per error of ``exc``, the path below ``prefix``."""
    return error_problems(exc.errors(), prefix)


def validate(model: type[M], data: Any, where: str = "") -> M:
    """``data`` as ``model``, or a :class:`ConfigError` naming each bad key below ``where``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("", problems=validation_problems(exc, where),
                          title=f"invalid {where or model.__name__} config") from None


# -- the reference table (conf/README.md) --------------------------------------------------------------------------


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return str(value.model_dump() or {})
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def _nested(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def reference_rows(model: type[BaseModel], prefix: str = "", *,
                   skip: Iterable[str] = ()) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every field of ``model`` (nested models flattened), in declaration order;
    the meaning is the field's ``description``."""
    rows: list[tuple[str, str, str]] = []
    skipped = set(skip)
    for name, field in model.model_fields.items():
        if name in skipped:
            continue
        key = _join(prefix, field.alias or name)
        nested = _nested(field)
        if nested is not None and nested.model_fields:
            rows += reference_rows(nested, key)
            continue
        rows.append((key, _default(field), " ".join((field.description or "").split())))
    return rows


def reference_table(rows: Iterable[tuple[str, str, str]]) -> str:
    """A markdown table of ``reference_rows``."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    bar = "\\|"
    lines += [f"| `{key}` | `{default}` | {meaning.replace('|', bar)} |" for key, default, meaning in rows]
    return "\n".join(lines) + "\n"


def flat_items(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A nested config (mappings of mappings) as ``(dotted.key, leaf)`` pairs, so two configs compare key by key;
    an empty mapping is a leaf."""
    if isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from flat_items(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node
