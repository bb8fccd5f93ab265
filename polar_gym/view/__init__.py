"""The trace viewer: a local page over a run's folder (``python -m polar_gym.view OUT_DIR``) and the same page
mounted by the rollout server for a live run. See polar_gym.view.router for the routes and the security rules."""

from polar_gym.view.app import allowed_hosts, create_view_app
from polar_gym.view.model import RowFilter, SessionData, filter_rows, session_payload, session_row, trace_tokens
from polar_gym.view.router import PREFIX, SECURITY_HEADERS, ViewerAuth, viewer_router
from polar_gym.view.source import OutDirSource, ViewSource
from polar_gym.view.tokens import TokenText, find_tokenizer

__all__ = ["PREFIX", "SECURITY_HEADERS", "OutDirSource", "RowFilter", "SessionData", "TokenText", "ViewSource",
           "ViewerAuth", "allowed_hosts", "create_view_app", "filter_rows", "find_tokenizer", "session_payload",
           "session_row", "trace_tokens", "viewer_router"]
