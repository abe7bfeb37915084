"""A worker's LoRA calls, both roles alike: its adapters as the wire names them, and
LoadLora and UnloadLora (tandem.v1 worker.proto), which load or unload an adapter on
the engine's thread between steps, then publish the worker's figures at once, so that
routers route to the adapter as soon as the call answers. Off unless the worker was
started with --allow-runtime-lora (``EngineConfig.enable_lora``)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoraAdapter
from ledger.membership import Membership
from serving.engine_commands import LoadLora, UnloadLora
from serving.engine_loop import EngineLoop, confine_torch
from serving.lora_setup import check_load_request, hex_digest, lora_digests
from serving.rpc import PermissionDenied
from tandem.v1 import worker_pb2 as pb


class LoraCalls:
    """LoadLora and UnloadLora over ``engine``, and ``loras`` (see the module's docstring)."""

    engine: LLMEngine
    engine_loop: EngineLoop[Any]
    membership: Membership
    served_name: str

    @property
    def loras(self) -> dict[str, str]:
        """The engine's LoRA adapters: name -> digest (serving.lora_setup)."""
        return lora_digests(self.engine.lora_names)

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Any) -> pb.LoadLoraReply:
        self._check_runtime_lora()
        name = request.lora_name
        check_load_request(name, request.lora_path, self.served_name)
        if name in self.engine.lora_names:  # before reading its files
            raise ValueError(f"lora_name: {name!r} is already loaded")
        # Read and checked on a thread of its own, while the engine steps; put in between
        # steps. LoraError, a ValueError naming the field: INVALID_ARGUMENT (serving.rpc).
        adapter = await asyncio.to_thread(_read, self.engine, name, request.lora_path)
        digest = await self.engine_loop.call(LoadLora(name, request.lora_path, adapter))
        self.membership.publish_figures()
        return pb.LoadLoraReply(lora_digest=hex_digest(digest))

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Any) -> pb.UnloadLoraReply:
        self._check_runtime_lora()
        # LoraInUse: FAILED_PRECONDITION; LoraNotLoaded: NOT_FOUND (serving.rpc)
        await self.engine_loop.call(UnloadLora(request.lora_name))
        self.membership.publish_figures()
        return pb.UnloadLoraReply()

    def _check_runtime_lora(self) -> None:
        if not self.engine.config.enable_lora:
            raise PermissionDenied(
                "lora_name: loading adapters at run time is off on this worker (start it "
                "with --allow-runtime-lora)"
            )


def _read(engine: LLMEngine, name: str, path: str) -> LoraAdapter:
    """``engine.read_lora`` on a thread of asyncio's, its parallel regions on it alone (as
    the asyncio thread's: serving.engine_loop.confine_torch)."""
    confine_torch()
    return engine.read_lora(name, path)
