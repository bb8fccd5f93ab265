"""Gemini ``generateContent`` request models (only what the proxy reads).

Every model accepts both spellings of a field, ``inlineData`` and ``inline_data``, because real clients mix them:
google-genai 3.3 sends ``inlineData: {mime_type}`` and ``thinkingConfig: {include_thoughts}``. Free-form values
(function arguments and responses, schemas, labels) stay plain dicts so their keys are never renamed. Unknown
fields are kept (``extra="allow"``) and reported, not dropped in silence.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "KNOWN_IGNORED",
    "NOT_FORWARDED_GENERATION",
    "Blob",
    "CodeExecutionResult",
    "Content",
    "ExecutableCode",
    "FileData",
    "FunctionCallData",
    "FunctionCallingConfig",
    "FunctionDeclaration",
    "FunctionResponseData",
    "GenerateContentRequest",
    "GenerationConfig",
    "Part",
    "ThinkingConfig",
    "ToolConfig",
    "ToolSpec",
]

#: unmodelled top-level fields accepted and deliberately not forwarded (billing, no effect on tokens);
#: safetySettings, labels and model are modelled fields, read and likewise not forwarded
KNOWN_IGNORED = frozenset({"serviceTier", "service_tier"})

#: generationConfig fields Gemini knows that have no counterpart in the normalized request: noted, not forwarded
NOT_FORWARDED_GENERATION = (
    "presence_penalty", "frequency_penalty", "response_logprobs", "logprobs", "response_modalities",
    "media_resolution", "speech_config", "enable_enhanced_civic_answers", "image_config",
    "audio_transcription_config", "audio_timestamp",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", alias_generator=to_camel, validate_by_name=True,
                              validate_by_alias=True)


class Blob(_Model):
    mime_type: str
    data: str


class FileData(_Model):
    file_uri: str
    mime_type: str | None = None


class FunctionCallData(_Model):
    name: str
    args: dict[str, Any] | None = None
    id: str | None = None


class FunctionResponseData(_Model):
    name: str
    response: dict[str, Any] | None = None
    id: str | None = None
    parts: list[dict[str, Any]] | None = None


class ExecutableCode(_Model):
    language: str | None = None
    code: str = ""


class CodeExecutionResult(_Model):
    outcome: str | None = None
    output: str | None = None


class Part(_Model):
    text: str | None = None
    thought: bool | None = None
    thought_signature: str | None = None
    inline_data: Blob | None = None
    file_data: FileData | None = None
    function_call: FunctionCallData | None = None
    function_response: FunctionResponseData | None = None
    executable_code: ExecutableCode | None = None
    code_execution_result: CodeExecutionResult | None = None


class Content(_Model):
    role: str | None = None
    parts: list[Part] = Field(default_factory=list)


class FunctionDeclaration(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | bool | None = None


class ToolSpec(_Model):
    """One entry of ``tools``: function declarations, or a built-in tool (kept in ``model_extra``)."""

    function_declarations: list[FunctionDeclaration] | None = None


class FunctionCallingConfig(_Model):
    mode: str | None = None
    allowed_function_names: list[str] | None = None


class ToolConfig(_Model):
    function_calling_config: FunctionCallingConfig | None = None


class ThinkingConfig(_Model):
    include_thoughts: bool | None = None
    thinking_budget: int | None = None
    thinking_level: str | None = None


class GenerationConfig(_Model):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: float | None = Field(default=None, ge=0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    candidate_count: int | None = None
    seed: int | None = None
    response_mime_type: str | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: dict[str, Any] | bool | None = None
    thinking_config: ThinkingConfig | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_logprobs: bool | None = None
    logprobs: int | None = None
    response_modalities: list[str] | None = None
    media_resolution: str | None = None
    speech_config: dict[str, Any] | None = None
    enable_enhanced_civic_answers: bool | None = None
    image_config: dict[str, Any] | None = None
    audio_transcription_config: dict[str, Any] | None = None
    audio_timestamp: bool | None = None


class GenerateContentRequest(_Model):
    contents: list[Content] = Field(min_length=1)
    system_instruction: Content | str | None = None
    tools: list[ToolSpec] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None
    safety_settings: list[dict[str, Any]] | None = None
    cached_content: str | None = None
    labels: dict[str, Any] | None = None
    model: str | None = None
