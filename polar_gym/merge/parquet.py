"""Export rows (any of ``python -m polar_gym.merge``'s formats) as Parquet, which Hugging Face ``datasets``
(``load_dataset("parquet", data_files=...)``), pandas, polars and the trainers' data loaders read directly.

The columns' types come from the rows' pydantic model when there is one (``TraceLine``, ``SlimeSample``,
``SFTRecord``: the wire types are the single source): ``list[int]`` becomes ``list<int64>`` (ids, masks),
``list[float]`` ``list<double>`` (logprobs: exact, as captured), ints, floats, bools and strings themselves; a field
holding objects (messages, tools, metadata) is written as JSON text, since its shape varies row to row (a message's
``content`` is a string in one and a list of parts in the next) and Arrow needs one type a column. Rows without a
model (``nemo``, ``atif``) are typed from the first row group. Rows are written in row groups as they come, so an export
of many sessions holds one group in memory. pyarrow comes with ``datasets`` (the ``swebench`` and ``trl`` extras,
which the set-up installs); it is imported only here.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel

__all__ = ["JSON_COLUMNS_KEY", "ParquetRows", "arrow_schema", "read_parquet_rows"]

#: the Parquet file's key-value metadata entry listing the columns written as JSON text
JSON_COLUMNS_KEY = b"polar_gym.json_columns"


def _kind(value: Any) -> str:
    """``ints``, ``floats``, ``empty``, ``json`` or ``scalar``: how a column holding ``value`` is typed."""
    if isinstance(value, dict):
        return "json"
    if isinstance(value, list):
        if not value:
            return "empty"
        if any(isinstance(v, bool) for v in value):
            return "json"
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "ints"
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            return "floats"
        return "json"
    return "scalar"


def _arrow_type(annotation: Any) -> tuple[Any, bool]:
    """The Arrow type of a field's annotation, and whether it is written as JSON text."""
    import pyarrow as pa

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _arrow_type(args[0])
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return _arrow_type(kept[0]) if len(kept) == 1 else (pa.string(), True)
    if origin is typing.Literal and all(isinstance(a, str) for a in args):
        return pa.string(), False
    if origin is list and len(args) == 1:
        if typing.get_origin(args[0]) is typing.Literal or args[0] is str:  # a list of names
            return pa.list_(pa.string()), False
        item, _ = _arrow_type(args[0])
        if pa.types.is_integer(item) or pa.types.is_floating(item):
            return pa.list_(item), False
        return pa.string(), True
    simple = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
    if isinstance(annotation, type) and annotation in simple:
        return simple[annotation], False
    if isinstance(annotation, type) and issubclass(annotation, str):  # a str enum
        return pa.string(), False
    return pa.string(), True


def _plain(value: Any) -> Any:
    """What orjson cannot write itself: a pydantic model left in a row made with ``dict(model)``."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON")


def arrow_schema(model: type[BaseModel]) -> Any:
    """The Parquet schema of ``model``'s rows (see the module docstring); its JSON columns in the metadata."""
    import pyarrow as pa

    fields, json_columns = [], []
    for name, info in model.model_fields.items():
        kind, as_json = _arrow_type(info.annotation)
        fields.append(pa.field(name, kind))
        if as_json:
            json_columns.append(name)
    return pa.schema(fields, metadata={JSON_COLUMNS_KEY: orjson.dumps(json_columns)})


class ParquetRows:
    """A Parquet file written row group by row group: ``add`` rows, ``close`` (or use as a context manager).

    The columns and their types are fixed by the first group (a later row's extra keys are refused: every format's
    rows share their keys); a list column is typed by every value of the group (ints unless a float appears)."""

    def __init__(self, path: str | Path, *, model: type[BaseModel] | None = None, group_rows: int = 256,
                 compression: str = "zstd") -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - the set-up installs it
            raise RuntimeError("Parquet export needs pyarrow (pip install pyarrow, or datasets)") from exc
        self._pa, self._pq = pa, pq
        self.path, self.group_rows, self.compression = Path(path), group_rows, compression
        self._pending: list[dict[str, Any]] = []
        self._writer: Any = None
        self._schema: Any = arrow_schema(model) if model is not None else None
        self.rows = 0

    def __enter__(self) -> ParquetRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        self._pending.extend(rows)
        while len(self._pending) >= self.group_rows:
            self._flush(self._pending[:self.group_rows])
            del self._pending[:self.group_rows]

    def close(self) -> None:
        if self._pending or self._writer is None:
            self._flush(self._pending)
            self._pending = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _schema_for(self, rows: list[dict[str, Any]]) -> Any:
        pa = self._pa
        names = list(dict.fromkeys(k for row in rows for k in row))
        fields, json_columns = [], []
        for name in names:
            kinds = {_kind(v) for row in rows if (v := row.get(name)) is not None}
            if kinds and kinds <= {"ints"}:
                kind = pa.list_(pa.int64())
            elif kinds and kinds <= {"ints", "floats", "empty"}:  # only empty lists: logprobs not captured
                kind = pa.list_(pa.float64())
            elif kinds == {"scalar"}:
                kind = pa.array([row.get(name) for row in rows]).type
            else:
                kind = pa.string()
                if kinds:
                    json_columns.append(name)
            if pa.types.is_null(kind):  # no value yet: a nullable string
                kind = pa.string()
            fields.append(pa.field(name, kind))
        metadata = {JSON_COLUMNS_KEY: orjson.dumps(json_columns)}
        return pa.schema(fields, metadata=metadata)

    def _flush(self, rows: list[dict[str, Any]]) -> None:
        pa = self._pa
        if self._schema is None:
            self._schema = self._schema_for(rows)
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = self._pq.ParquetWriter(self.path, self._schema, compression=self.compression)
        json_columns = set(orjson.loads(self._schema.metadata[JSON_COLUMNS_KEY]))
        unknown = {k for row in rows for k in row} - set(self._schema.names)
        if unknown:
            raise ValueError(f"rows with columns the Parquet file does not have: {sorted(unknown)}")
        columns = {}
        for field in self._schema:
            values = [row.get(field.name) for row in rows]
            if field.name in json_columns:
                values = [None if v is None else orjson.dumps(v, default=_plain).decode() for v in values]
            columns[field.name] = pa.array(values, type=field.type)
        self._writer.write_table(pa.table(columns, schema=self._schema))
        self.rows += len(rows)


def read_parquet_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows a :class:`ParquetRows` wrote, with its JSON columns decoded again (what a reader of the export
    that wants the original objects does)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(JSON_COLUMNS_KEY)
    json_columns = set(orjson.loads(raw)) if raw else set()
    for row in table.to_pylist():
        yield {k: (orjson.loads(v) if k in json_columns and v is not None else v) for k, v in row.items()}
