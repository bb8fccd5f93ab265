"""The proxy's settings and the functions that build it from them: :class:`EngineSettings` -> :func:`build_engine`,
:class:`ProxySettings` -> :func:`build_service`. The standalone proxy's flags, the gateway's, the ``inference``
Hydra group and ``python -m polar_gym.env serve`` all validate into these models; a setting that cannot work raises
:class:`~polar_gym.settings.ConfigError` naming the field (a CLI renames it to its flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.images import ImageLimits
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.registry import ENGINES, PARSERS, RegistryError
from polar_gym.schema import OracleScript
from polar_gym.settings import ConfigError

__all__ = [
    "ENGINES_WITH_TOKENIZER",
    "TOKEN_IN_ENGINES",
    "EngineSettings",
    "ProxySettings",
    "build_engine",
    "build_service",
    "check_engine",
    "check_upstreams_given",
    "configured_prompt_mode",
    "describe_mode",
    "mode_line",
    "read_oracle_script",
    "resolve_prompt_mode",
    "resolve_tokenizer",
]

#: engines that render prompts themselves and so need a tokenizer directory
ENGINES_WITH_TOKENIZER = ("oracle",)
#: engines that can be fed exact prompt token IDs (prompt_mode token_in); sglang_generate is sglang, always token_in
TOKEN_IN_ENGINES = ("vllm", "sglang", "sglang_generate")


class EngineSettings(BaseModel):
    """Which engine the proxy forwards to and where it finds the model."""

    model_config = ConfigDict(extra="forbid")

    engine: str = Field(default="oracle", description="the proxy engine: oracle (a scripted policy, no model), vllm, "
                        "sglang, sglang_generate (sglang, always token_in), openai (not token-faithful), or a dotted "
                        "path pkg.module:Class")
    upstreams: list[str] = Field(default_factory=list, description="inference server base URLs (no trailing /v1; "
                                 "not for oracle)")
    await_upstreams: bool = Field(default=False, description="start without upstreams: they arrive later through "
                                  "the rollout server's /backends or /admin/upstreams (a trainer's policy server)")
    tokenizer: str | None = Field(default=None, description="tokenizer directory for oracle and token_in; set for "
                                  "vllm or sglang, it makes prompt_mode null mean token_in (null: the oracle and an "
                                  "explicit token_in use the Qwen tokenizer built by scripts/setup.sh)")
    oracle_script: str | None = Field(default=None, description="oracle only: a JSON file {commands: [...], "
                                      "final_answer: ...} played instead of each task's reference solution")
    upstream_model: str | None = Field(default=None, description="the model name sent upstream (harnesses send "
                                       "their own, e.g. claude-*, which the server lacks); null: the request's")
    upstream_timeout: float = Field(default=600.0, gt=0, description="seconds one upstream call may take")
    policy_version: str | int | None = Field(default=None, description="the policy version recorded with every "
                                             "completion (null: none)")
    drift_every: int = Field(default=0, ge=0, description="oracle only: sample non-canonical tokens every N calls "
                             "of a session (0: never)")
    prompt_mode: Literal["token_in", "chat"] | None = Field(
        default=None, description="vllm, sglang and oracle: token_in (the proxy renders prompts and sends the engine "
        "exact prefix token IDs: one contiguous chain per conversation) or chat (the engine renders messages); "
        "null: chosen by the config alone, never by what a cache holds: token_in for oracle and sglang_generate, "
        "for vllm and sglang token_in when a tokenizer directory is set, else chat; openai: chat")
    parser: str | None = Field(default=None, description="token_in only: the output parser turning sampled text "
                               "into reasoning, text and tool calls (qwen3, llama3_json, or pkg.module:Class); "
                               "null: qwen3 for the default Qwen tokenizer and for oracle")
    stream_passthrough: bool = Field(default=True, description="a harness's streamed call is streamed as the engine "
                                     "samples (vllm in both prompt modes, sglang token_in; captured as the same call "
                                     "not streamed); false, or other engines: the stream is synthesized from the "
                                     "whole answer")


class ProxySettings(EngineSettings):
    """A proxy service: the engine plus the journal, the sessions it serves and its limits."""

    capture_dir: Path | None = Field(default=None, description="journal directory (null: in memory)")
    fsync: bool = Field(default=False, description="fsync every journal write")
    strict: bool = Field(default=False, description="reject unknown request fields instead of logging them")
    model_names: list[str] | None = Field(default=None, description="served model names for /v1/models")
    max_tokens_cap: int | None = Field(default=None, ge=1, description="clamp every call's max_tokens to this "
                                       "(null: no clamp)")
    session_idle_seconds: float | None = Field(default=3600.0, gt=0, description="standalone (ad-hoc) sessions: "
                                               "forget what is kept in memory for a session unused this long (its "
                                               "journal stays on disk; null: only beyond max_adhoc_sessions)")
    max_adhoc_sessions: int = Field(default=256, ge=1, description="standalone (ad-hoc) sessions: at most this many "
                                    "are kept in memory with their journal files open; the least recently used "
                                    "beyond it is forgotten (its journal is on disk and reopens if it calls again)")
    max_images: int = Field(default=ImageLimits.max_images, ge=0, description="images one request may carry, its "
                            "whole conversation's (0: the model takes none); only inline (base64) images are taken, "
                            "never addresses")
    max_image_bytes: int = Field(default=ImageLimits.max_image_bytes, ge=1,
                                 description="bytes of one image, decoded")


def check_upstreams_given(settings: EngineSettings, *, more_coming: bool = False) -> None:
    """A model engine needs an upstream unless they arrive later (``await_upstreams``, or ``more_coming``: a launcher
    that starts inference jobs); raises ConfigError naming ``upstreams``."""
    if settings.engine != "oracle" and not settings.upstreams and not settings.await_upstreams and not more_coming:
        raise ConfigError(f"engine {settings.engine!r} needs at least one upstream URL (or await_upstreams)",
                          key="upstreams")


def resolve_tokenizer(settings: EngineSettings) -> Path | None:
    """The tokenizer directory the engine uses: the configured one, or (for engines that render prompts) the
    project's built Qwen tokenizer; ConfigError naming ``tokenizer`` when that one is not built."""
    if settings.engine not in ENGINES_WITH_TOKENIZER:
        return Path(settings.tokenizer) if settings.tokenizer else None
    if settings.tokenizer:
        if not Path(settings.tokenizer).is_dir():
            raise ConfigError(f"{settings.tokenizer} is not a directory (a tokenizer's files)", key="tokenizer")
        return Path(settings.tokenizer)
    default = tokenizer_dir()
    if not (default / ".complete").exists():
        raise ConfigError(f"engine {settings.engine} renders prompts itself; the default tokenizer {default} is "
                          "not built: run `bash scripts/setup.sh` or set a tokenizer directory", key="tokenizer")
    return default


def configured_prompt_mode(settings: EngineSettings) -> str:
    """The prompt mode the config asks for, read from the config alone (issue 41: a cache that another job fills
    must not switch a running fleet's mode): the explicit one, else token_in for the oracle and sglang_generate, and
    for vllm / sglang when a tokenizer directory is set; chat otherwise. Whether it can work is
    :func:`resolve_prompt_mode`'s question."""
    if settings.prompt_mode is not None:
        return settings.prompt_mode
    if settings.engine in ("oracle", "sglang_generate"):
        return "token_in"
    return "token_in" if settings.engine in TOKEN_IN_ENGINES and settings.tokenizer else "chat"


_TOKEN_IN_WAYS = ("run `bash scripts/setup.sh`, set a tokenizer directory (--tokenizer DIR / "
                  "inference.tokenizer=DIR), or use prompt_mode chat (--prompt-mode chat / inference.prompt_mode=chat)")


def _built_tokenizer(settings: EngineSettings) -> Path:
    """The project's built Qwen tokenizer for a token_in engine given no tokenizer: only for a Qwen (or unnamed)
    model, and only once it is built; ConfigError naming ``tokenizer`` otherwise."""
    model = settings.upstream_model
    if model is not None and "qwen" not in model.lower():
        raise ConfigError(f"prompt_mode token_in renders prompts in the proxy, and the built Qwen tokenizer does not "
                          f"fit the model {model!r}: set its tokenizer directory (--tokenizer DIR / "
                          "inference.tokenizer=DIR), or use prompt_mode chat (--prompt-mode chat / "
                          "inference.prompt_mode=chat)", key="tokenizer")
    default = tokenizer_dir()
    if not (default / ".complete").exists():
        raise ConfigError(f"prompt_mode token_in renders prompts in the proxy and no tokenizer is set; the built Qwen "
                          f"tokenizer {default} is not there: {_TOKEN_IN_WAYS}", key="tokenizer")
    return default


def resolve_prompt_mode(settings: EngineSettings) -> tuple[str, Path | None, str | None]:
    """(prompt mode, tokenizer directory, parser name) for a token-in capable engine, the mode being
    :func:`configured_prompt_mode`'s; ConfigError naming ``prompt_mode``, ``tokenizer`` or ``parser`` when token_in
    cannot work."""
    if settings.engine == "oracle":
        # the oracle always has a tokenizer and writes Qwen-style replies, which the qwen3 parser reads
        if settings.prompt_mode == "chat":
            return "chat", None, None
        return "token_in", resolve_tokenizer(settings), _checked_parser(settings.parser or "qwen3")
    if settings.engine not in TOKEN_IN_ENGINES:
        if settings.prompt_mode == "token_in":
            raise ConfigError(f"prompt_mode token_in needs engine {' or '.join(TOKEN_IN_ENGINES)}, not "
                              f"{settings.engine!r}", key="prompt_mode")
        return "chat", None, None
    if settings.prompt_mode == "chat" and settings.engine == "sglang_generate":
        raise ConfigError("engine sglang_generate is sglang fed token IDs (token_in); for chat use engine sglang",
                          key="prompt_mode")
    if configured_prompt_mode(settings) == "chat":
        return "chat", None, None
    if settings.tokenizer:
        if not Path(settings.tokenizer).is_dir():
            raise ConfigError(f"{settings.tokenizer} is not a directory (a tokenizer's files)", key="tokenizer")
        tokenizer = Path(settings.tokenizer)
    else:
        tokenizer = _built_tokenizer(settings)
    parser = settings.parser
    if parser is None:
        if settings.tokenizer is None or "qwen" in tokenizer.name.lower():
            parser = "qwen3"
        else:
            raise ConfigError(f"no output parser is known for the tokenizer {tokenizer}: set one (qwen3, "
                              "llama3_json, or pkg.module:Class), or use prompt_mode chat", key="parser")
    return "token_in", tokenizer, _checked_parser(parser)


def mode_line(role: str, settings: EngineSettings, mode: str, tokenizer: Path | None, parser: str | None) -> str:
    """A process's first log line: its engine, the prompt mode it resolved and why, and its upstreams (pure; the
    standalone proxy, the gateway node and the launcher print it so a run's mode is never a guess)."""
    if mode == "token_in":
        how = f"tokenizer {tokenizer}, parser {parser}"
    elif settings.engine == "oracle":
        how = "whole prompts rendered every call"
    elif settings.engine in TOKEN_IN_ENGINES:
        how = ("the engine renders the chat template; set --tokenizer DIR for token_in: exact prefixes across "
               "turns")
    else:
        how = "the engine renders the chat template"
    if settings.upstreams:
        where = "upstreams " + ", ".join(settings.upstreams)
    elif settings.await_upstreams:
        where = "upstreams to come (await_upstreams)"
    else:
        where = "no upstream" if settings.engine == "oracle" else "no upstream yet"
    return f"polar_gym {role}: engine {settings.engine}, prompt mode {mode} ({how}), {where}"


def describe_mode(settings: EngineSettings, role: str = "proxy") -> str:
    """:func:`mode_line` for ``settings`` as resolved (ConfigError when the mode cannot work)."""
    return mode_line(role, settings, *resolve_prompt_mode(settings))


def _checked_parser(parser: str) -> str:
    try:
        PARSERS.get(parser)
    except RegistryError as exc:
        raise ConfigError(str(exc), key="parser") from None
    return parser


def check_engine(settings: EngineSettings) -> tuple[Any, Path | None]:
    """What building the engine needs, checked without building it (no client, no tokenizer load): the engine class
    and the tokenizer directory; ConfigError naming the field that cannot work."""
    try:
        engine_cls = ENGINES.get(settings.engine)
    except RegistryError as exc:
        raise ConfigError(str(exc), key="engine") from None
    check_upstreams_given(settings)
    mode, tokenizer, _ = resolve_prompt_mode(settings)
    if mode == "token_in":
        return engine_cls, tokenizer
    return engine_cls, resolve_tokenizer(settings)


def read_oracle_script(path: str, key: str = "oracle_script") -> OracleScript:
    """The oracle script file ``path`` (ConfigError naming ``key`` when it cannot be read or validated)."""
    try:
        return OracleScript.model_validate_json(Path(path).read_text())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", key=key) from None


def build_engine(settings: EngineSettings) -> Engine:
    """The engine ``settings`` describe (raises ConfigError naming the field that cannot work), told the model's
    image placeholder token when it has the model's tokenizer."""
    engine = _build_engine(settings)
    _, tokenizer = check_engine(settings)
    if tokenizer is not None:
        from polar_gym.proxy.tokenizer import image_token_id_in

        engine.image_token_id = image_token_id_in(tokenizer)
    return engine


def _build_engine(settings: EngineSettings) -> Engine:
    engine_cls, tokenizer = check_engine(settings)
    pool = UpstreamPool(list(settings.upstreams), policy_version=settings.policy_version)
    if settings.engine == "oracle":
        from polar_gym.proxy.engines.oracle import OracleEngine
        from polar_gym.proxy.tokenizer import HFChatTokenizer

        assert tokenizer is not None  # resolve_tokenizer gives one for the oracle
        script = read_oracle_script(settings.oracle_script) if settings.oracle_script else None
        mode, _, parser = resolve_prompt_mode(settings)
        from polar_gym.proxy.parsers.base import parser_for

        return OracleEngine(HFChatTokenizer(tokenizer), pool, default_script=script,
                            drift_every=settings.drift_every, prompt_mode="token_in" if mode == "token_in" else "chat",
                            parser=parser_for(parser) if parser is not None else None)
    kwargs = {"timeout": settings.upstream_timeout, "upstream_model": settings.upstream_model}
    mode, tokenizer_path, parser = resolve_prompt_mode(settings)
    if mode == "token_in":
        from polar_gym.proxy.engines.tokenin import SGLangTokenInEngine, TokenInEngine, VLLMTokenInEngine
        from polar_gym.proxy.parsers.base import parser_for
        from polar_gym.proxy.tokenizer import HFChatTokenizer

        assert tokenizer_path is not None and parser is not None  # resolve_prompt_mode gives both for token_in
        token_cls: type[TokenInEngine] = VLLMTokenInEngine if settings.engine == "vllm" else SGLangTokenInEngine
        if settings.engine == "vllm":
            from polar_gym.proxy.engines.vision import VLLMVisionTokenInEngine, image_grid_in
            from polar_gym.proxy.tokenizer import image_token_id_in

            if image_token_id_in(tokenizer_path) is not None and image_grid_in(tokenizer_path) is not None:
                token_cls = VLLMVisionTokenInEngine  # a vision-language model: calls with images keep exact prefixes
        token_engine = token_cls(HFChatTokenizer(tokenizer_path), parser_for(parser), pool,
                                 timeout=settings.upstream_timeout, upstream_model=settings.upstream_model)
        token_engine.stream_passthrough = settings.stream_passthrough
        return token_engine
    if tokenizer is not None and settings.engine in ENGINES_WITH_TOKENIZER:
        from polar_gym.proxy.tokenizer import HFChatTokenizer

        engine = engine_cls(HFChatTokenizer(tokenizer), pool, **kwargs)
    else:
        engine = engine_cls(pool, **kwargs)
    if not isinstance(engine, Engine):
        raise ConfigError(f"{settings.engine!r} built {type(engine).__name__}, not a polar_gym Engine", key="engine")
    engine.stream_passthrough = engine.can_stream and settings.stream_passthrough  # vLLM's chat stream too
    return engine


def build_service(settings: ProxySettings, *, allow_adhoc: bool) -> ProxyService:
    """The proxy service ``settings`` describe; ``allow_adhoc`` serves unregistered keys as sessions of that name
    (the standalone proxy's default; a gateway serves registered sessions only)."""
    return ProxyService(build_engine(settings), CaptureJournal(settings.capture_dir, fsync=settings.fsync),
                        SessionRegistry(allow_adhoc=allow_adhoc, idle_seconds=settings.session_idle_seconds,
                                        max_adhoc=settings.max_adhoc_sessions),
                        strict=settings.strict, image_limits=ImageLimits(max_images=settings.max_images,
                                                                         max_image_bytes=settings.max_image_bytes),
                        model_names=settings.model_names, max_tokens_cap=settings.max_tokens_cap)
