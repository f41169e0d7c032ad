"""What every HTTP route shares: the Store, the limits, the body pool, the codec cache and the
key listings.

One ``ServiceState`` per app, built by ``gateway.http.app.create_app`` and reached from a
request as ``state_of(request)``; the routes hold no globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from starlette.requests import Request

from gateway.http.body import Codecs
from gateway.http.byte_budget import ByteBudget
from gateway.listing import KeyListings
from gateway.memory import BufferPool
from gateway.staging_allowance import StagingAllowance
from gateway.store import Store

DEFAULT_MAX_BODY = 1 << 30
DEFAULT_MAX_JSON = 16 << 20
DEFAULT_BODY_POOL = 256 << 20
MAX_BATCH_KEYS = 1024
MAX_LOOKUP_KEYS = 65536


@dataclass(slots=True)
class ServiceState:
    store: Store
    max_body: int = DEFAULT_MAX_BODY
    max_json: int = DEFAULT_MAX_JSON
    body_pool_size: int = DEFAULT_BODY_POOL
    body_pool: BufferPool | None = None  # built in the lifespan (prefaulting takes time)
    body_budget: ByteBudget | None = None  # bytes all request bodies may hold at once
    codecs: Codecs = field(default_factory=Codecs)
    ready: bool = False
    # What refused the service's start (opening the Store or a companion): ``kvgate serve``
    # reports it in one line instead of uvicorn's start-up traceback.
    startup_error: Exception | None = None
    listings: KeyListings = field(init=False)  # GET /v1/keys: the pages' snapshots
    # Plain bodies read into the store's pool (the put keeps them), bounded together.
    staging: StagingAllowance = field(init=False)

    def __post_init__(self) -> None:
        self.listings = KeyListings(self.store)
        self.staging = StagingAllowance(self.store)


def state_of(request: Request) -> ServiceState:
    return cast(ServiceState, request.app.state.kvgate)
