"""``KvgateConnector``: vLLM's KV-connector (V1) on a kvgate Store.

vLLM loads it with::

    kv_transfer_config={
        "kv_connector": "KvgateConnector",
        "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvgate_config": {...}},  # or {"kvgate_url": ...}
    }

(``gateway.vllm.settings`` lists the extra config keys.) The scheduler side, in the engine
process, plans which chunks to load and save (``plan.Planner``) and asks the worker how many
leading chunks the store holds (``lookup``). The worker side owns the Store, on its own event
loop thread (``bridge.StoreThread``): before a forward pass it fetches the planned chunks and
writes their pages into the blocks vLLM allocated (``pages.scatter``); after it, it copies the
pages of every chunk that just filled (``pages.gather``) and hands the copies to the store
without waiting (both in ``worker.PagedWorker``). A chunk that cannot be loaded (a miss, a
corrupted object, a layout that does not match) is reported through
``get_block_ids_with_load_errors``, and vLLM recomputes those blocks (the connector sets
``kv_load_failure_policy`` to ``recompute``: vLLM's default would fail the request): a failure
costs time, never correctness.

Keys are kvgate ``Key``s (LMCache's key string): the model, the tensor-parallel size and rank,
the chunk's prefix hash, the cache dtype, and tags for the cache layout and the chunk size, so
a chunk is only ever loaded into a cache laid out as the one it came from.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from gateway.store import Store
from gateway.vllm.bridge import StoreThread
from gateway.vllm.lookup import SocketLookup, claim_socket, serve_lookups, socket_path
from gateway.vllm.plan import (
    ChunkMove,
    NewRequest,
    Planner,
    RunningRequest,
    saves_after_loads,
)
from gateway.vllm.reachable import say_if_unreachable
from gateway.vllm.settings import VllmSettings
from gateway.vllm.worker import PagedWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvgate.vllm")


@dataclass
class KvgateMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM's class is untyped
    """One step's plan, from the scheduler to the workers: chunks to load, chunks to save."""

    loads: dict[str, list[ChunkMove]] = field(default_factory=dict)
    saves: dict[str, list[ChunkMove]] = field(default_factory=dict)


class KvgateConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM's class is untyped
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        transfer = vllm_config.kv_transfer_config
        self.settings = VllmSettings.from_extra(transfer.kv_connector_extra_config)
        self.block_size: int = vllm_config.cache_config.block_size
        self.settings.check_block_size(self.block_size)
        self.socket = socket_path(str(transfer.engine_id))
        self._planner: Planner | None = None
        self._lookup: SocketLookup | None = None
        self._bridge: StoreThread | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's default answer to blocks a connector reports unloaded is to fail the
            # request ("fail", for transfers that have no other copy); for a cache the
            # answer is to compute them, as without kvgate. The scheduler reads the policy
            # after creating its connector, from this same config object.
            # (Under vLLM's MultiConnector each child has a copy of the config, and this does
            # not reach the scheduler: set the policy there yourself.)
            if transfer.kv_load_failure_policy != "recompute":
                log.info("kvgate: kv_load_failure_policy set to recompute")
            transfer.kv_load_failure_policy = "recompute"
            self._lookup = SocketLookup(self.socket, self.settings.lookup_timeout)
            self._planner = Planner(
                self.settings.chunk_size, self.block_size, self.settings.seed, self._lookup
            )
        else:
            self._start_worker(vllm_config)

    # -- worker side --------------------------------------------------------------------------

    def _start_worker(self, vllm_config: VllmConfig) -> None:
        settings = self.settings
        world_size = int(vllm_config.parallel_config.tensor_parallel_size)
        rank = _tensor_parallel_rank()
        if settings.url is None and world_size > 1:
            raise ValueError(
                "kvgate: with tensor parallelism every rank needs the same store: give "
                "kvgate_url (a running gateway) rather than a kvgate_config"
            )

        def make_store() -> Store:
            if settings.url is not None:
                options = {"token": settings.token} if settings.token else {}
                tier = {"url": settings.url, "timeout": settings.timeout, "options": options}
                memory = {"url": "memory://", "capacity": settings.local_memory}
                return Store({"tiers": [memory, tier], "prefault": False})
            return Store(settings.config)

        if rank == 0:
            claim_socket(self.socket, str(vllm_config.kv_transfer_config.engine_id))

        async def on_loop(store: Store) -> None:
            jobs = []
            if settings.url is not None and rank == 0:  # one line, not one per rank
                jobs.append(say_if_unreachable(store, settings.lookup_timeout))
            if rank == 0:  # the scheduler asks rank 0
                jobs.append(
                    serve_lookups(store, self.socket, self.worker.key, settings.lookup_timeout)
                )
            await asyncio.gather(*jobs)

        bridge = StoreThread(
            make_store,
            max_pending=settings.max_pending_saves,
            timeout=settings.timeout,
            on_loop=on_loop,
        )
        self.worker = PagedWorker(
            bridge,
            model_id=settings.model_id or _model_name(vllm_config.model_config),
            world_size=world_size,
            rank=rank,
            chunk_size=settings.chunk_size,
        )
        self._bridge = bridge
        self._load_errors: set[int] = set()
        self._step_failed: set[int] = set()  # this step's blocks whose load failed
        bridge.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = list(kv_caches.values())
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if not isinstance(num_blocks, int):
            num_blocks = int(caches[0].shape[0])
        self.worker.register(caches, num_blocks)
        assert self.worker.layout is not None
        log.info(
            "kvgate: %d layers of %s, chunks of %d tokens",
            len(caches),
            self.worker.layout.tag(),
            self.settings.chunk_size,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateMetadata)
        moves = [move for req_moves in meta.loads.values() for move in req_moves]
        self._step_failed = self.worker.load(moves)
        self._load_errors |= self._step_failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward pass

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # chunks are copied out once the whole step has run (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateMetadata)
        failed, self._step_failed = self._step_failed, set()
        self.worker.save(saves_after_loads(meta.loads, meta.saves, failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        if self._bridge is not None:
            self._bridge.close()
            worker = self.worker
            log.info(
                "kvgate: %d chunks loaded, %d not loaded, %d saved, %d saves skipped, %d failed",
                worker.loaded_chunks,
                worker.failed_chunks,
                worker.saved_chunks,
                self._bridge.skipped_saves,
                self._bridge.failed_saves,
            )
            self._bridge = None
        if self._lookup is not None:
            self._lookup.close()

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        prompt = list(request.prompt_token_ids or [])
        matched = self._planner.matched_tokens(
            request.request_id, prompt, lambda: request.all_token_ids, num_computed_tokens
        )
        return matched, False  # loaded synchronously, before the request's first forward

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        scheduled = scheduler_output.num_scheduled_tokens
        new = [
            NewRequest(r.req_id, r.block_ids[0], r.num_computed_tokens + scheduled.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        running = [
            RunningRequest(
                req_id,
                None if cached.new_block_ids[i] is None else cached.new_block_ids[i][0],
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
            )
            for i, req_id in enumerate(cached.req_ids)
        ]
        loads, saves = self._planner.step(new, running)
        return KvgateMetadata(loads, saves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        self._planner.finished(request.request_id)
        return False, None  # saves copy the pages out before the step ends: blocks are free


def _log_through_vllm() -> None:
    """kvgate's log lines (the connector's, the store's) in vLLM's log, at vLLM's level.

    vLLM configures its own ``vllm`` logger, not the root one, so in its processes kvgate's
    INFO lines went nowhere and its warnings out bare through Python's last-resort handler.
    Left alone where the application configured logging itself (a handler on the root or on
    ``kvgate``).
    """
    ours, theirs = logging.getLogger("kvgate"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):  # no parallel group: one rank
        return 0


def _model_name(model: Any) -> str:
    served = getattr(model, "served_model_name", None)
    if isinstance(served, list | tuple) and served:
        served = served[0]
    name = served if isinstance(served, str) and served else str(model.model)
    return name.replace("@", "_")
