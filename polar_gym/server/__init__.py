"""The rollout server: trainers submit tasks, gateways run their sessions, results come back (and by callback).

Modules: ``store`` (SQLite state), ``fleet`` (gateways and the least-loaded choice), ``core`` (the RolloutServer
facade) over ``tasks`` (expansion, views), ``dispatch``, ``watching`` (results, probes, gateway death), ``ledger``
(session state changes), ``callbacks`` (delivery with retries), ``links`` (HTTP pools, typed gateway clients) and
``counters`` (typed metrics); ``routes`` (the HTTP API's routers), ``app`` (the app assembling them), ``metrics``
(Prometheus families), ``client`` (trainer-side helpers).
"""

from polar_gym.schema import GatewayRegistration
from polar_gym.server.app import create_server_app
from polar_gym.server.client import CallbackReceiver, RolloutClient
from polar_gym.server.core import RolloutServer, ServerError
from polar_gym.server.counters import ServerCounters
from polar_gym.server.fleet import Fleet
from polar_gym.server.store import Store

__all__ = ["CallbackReceiver", "Fleet", "GatewayRegistration", "RolloutClient", "RolloutServer", "ServerCounters",
           "ServerError", "Store", "create_server_app"]
