"""The two bases of every wire type: closed models (requests, records) and open ones (free-form sections, answers a
newer peer may extend)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["_Model", "_Open"]


class _Model(BaseModel):
    """Wire types reject unknown fields so a typo in a config fails loudly instead of being ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Open(BaseModel):
    """Free-form sections (metadata, evaluator config) keep whatever the caller sends."""

    model_config = ConfigDict(extra="allow")
