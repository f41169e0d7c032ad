"""The HTTP face of a Store: the FastAPI app ``kvgate serve`` runs (``app.create_app``).

``app`` builds the app and owns its lifespan; ``objects``, ``batch``, ``keys`` and ``admin``
are its routes; ``state`` is what every request shares; ``body``, ``pace`` and
``byte_budget`` read request bodies within their limits, and ``head_limits`` bounds the
time a request's head may take and its size (uvicorn's protocol classes, for ``kvgate
serve``); ``auth`` checks the bearer token; ``log`` keeps secrets out of the access log;
``metrics`` and ``tier_state`` are what ``/metrics`` and ``/v1/tiers`` report. It imports the
core, never another wing.
"""

from gateway.http.app import create_app

__all__ = ["create_app"]
