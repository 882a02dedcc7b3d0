"""``build_replica``: one replica, from its resolved config to the HTTP app over it.

In order: the durable state (``DurableState``) is built once from ``config.store``; its KV tiers go
to the engine (``LLMEngine(config, store=...)``), its session and response backends to the session
service and the Responses API; the app is made over those services; with a registration, the
heartbeat starts. The engine's loop is not running yet: ``run_server`` runs it on the main thread
(``kvhive serve``), the Ray replica starts it on a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhive.config import EngineConfig
from kvhive.core.generation_defaults import GenerationConfigError, load_sampling_defaults
from kvhive.engine.async_engine import AsyncEngine
from kvhive.engine.client import EngineClient
from kvhive.engine.llm_engine import LLMEngine
from kvhive.launch.services import build_services
from kvhive.server.app import AppOptions, create_app
from kvhive.server.registration import ReplicaHeartbeat, start_heartbeat
from kvhive.server.responses import ResponsesAPI
from kvhive.sessions.backends import SessionBackend
from kvhive.sessions.durable import DurableState
from kvhive.sessions.service import SessionService

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvhive.core.replica_registry import RegistrationConfig
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import LoadedModel
    from kvhive.sessions.registry import Session


class EngineRefused(RuntimeError):
    """The engine cannot run this model or config (a missing file, a dtype this CPU lacks, tiers
    that cannot open): ``kvhive serve`` exits with status 2."""


@dataclass(frozen=True)
class Replica:
    """One replica's parts, each built once: the engine (loop not yet running), the client the
    services use, the session service, the Responses API, the app and the registry heartbeat."""

    engine: AsyncEngine
    client: EngineClient
    sessions: SessionService
    responses: ResponsesAPI
    app: FastAPI
    heartbeat: ReplicaHeartbeat | None
    session_backend: SessionBackend | None     # where session records persist (None: nowhere)

    def live_sessions(self) -> list[Session]:
        """The sessions this replica holds now, busy or idle (a drain hands them on)."""
        return self.sessions.live_sessions()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat (if any) and take this replica's record out of the registry."""
        if self.heartbeat is not None:
            self.heartbeat.stop(deregister=True)


def build_replica(config: EngineConfig, options: AppOptions, *,
                  registration: RegistrationConfig | None = None, model: LoadedModel | None = None,
                  tokenizer: Tokenizer | None = None, engine_class: type[AsyncEngine] = AsyncEngine) -> Replica:
    """The replica ``config`` (resolved: no ``dtype="auto"``) and ``options`` describe.

    ``model``/``tokenizer``: already loaded (else the engine loads ``config.model_path``'s).
    ``engine_class``: the AsyncEngine (sub)class to run the engine in. EngineRefused when the
    engine cannot run this model or config.
    """
    try:        # read before the model loads: a bad file refuses at once
        defaults = load_sampling_defaults(config.generation_config, config.model_path)
    except GenerationConfigError as exc:
        raise EngineRefused(f"--generation-config: {exc}") from exc
    durable = DurableState(config.store, config.served_model_name)
    engine = engine_class(open_engine(config, durable, model, tokenizer))
    client = EngineClient(engine)
    session_backend = durable.session_backend()
    services = build_services(client, options, session_backend, durable.response_backend(), defaults)
    app = create_app(services, options)
    heartbeat = None if registration is None else start_heartbeat(registration, config, client.fingerprint)
    return Replica(engine, client, services.generation.sessions, services.responses, app, heartbeat,
                   session_backend)


def open_engine(config: EngineConfig, durable: DurableState, model: LoadedModel | None = None,
                tokenizer: Tokenizer | None = None) -> LLMEngine:
    """The engine over ``durable``'s KV tiers (closed again if the engine cannot be built);
    EngineRefused for a model or config it cannot run."""
    store = None
    try:
        store = durable.tiered_store()
        engine = LLMEngine(config, loaded=model, tokenizer=tokenizer, store=store)
    except (ValueError, OSError) as exc:
        if store is not None:
            store.close()
        raise EngineRefused(str(exc)) from exc
    engine.warm_up()
    return engine
