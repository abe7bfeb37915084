"""What a worker's services may ask of their engine: typed commands that the engine thread
runs (``EngineLoop.submit``), one class each, in one place.

A command names its engine call and its arguments, and says whether it is new work,
refused with Overloaded while the queue is full (``is_new_work``), or cleanup and reads,
which are never refused. A command that must happen together with its engine call on the
engine thread takes a hook (``AddRequest.then``, ``DropRequest.then``): a prefill worker
hands a request's KV push to the layer relay there, so that the push sees exactly this
attempt's layers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from engine.engine_figures import OwnedBlocks, block_tables, owned_block_ids
from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoraAdapter
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams

T = TypeVar("T")


class EngineCommand(Generic[T]):
    """One call of the engine on its thread; ``run`` returns its result."""

    is_new_work: ClassVar[bool] = True

    def run(self, engine: LLMEngine) -> T:
        raise NotImplementedError


@dataclass(frozen=True)
class AddRequest(EngineCommand[None]):
    """Queues a request (``LLMEngine.add_request``); ``then`` runs right after, on the
    engine thread, before any step."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    is_prefill_only: bool = False
    num_output_tokens_sent: int = 0
    then: Callable[[], None] | None = None
    lora: str | None = None  # the LoRA adapter it runs under
    lora_digest: int | None = None  # its digest, as the router saw it

    def run(self, engine: LLMEngine) -> None:
        engine.add_request(
            self.request_id,
            self.prompt,
            self.params,
            is_prefill_only=self.is_prefill_only,
            num_output_tokens_sent=self.num_output_tokens_sent,
            lora=self.lora,
            lora_digest=self.lora_digest,
        )
        if self.then is not None:
            self.then()


@dataclass(frozen=True)
class Reserve(EngineCommand[tuple[list[int], int]]):
    """Blocks for a request whose KV is pushed here (``LLMEngine.reserve``): its block
    table, and how many prompt tokens were cached here."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    num_output_tokens_sent: int = 0
    lora: str | None = None  # the LoRA adapter it runs under
    lora_digest: int | None = None  # its digest, as the router saw it

    def run(self, engine: LLMEngine) -> tuple[list[int], int]:
        rid, num_sent = self.request_id, self.num_output_tokens_sent
        return engine.reserve(rid, self.prompt, self.params, num_sent, self.lora, self.lora_digest)


@dataclass(frozen=True)
class StartDecoding(EngineCommand[RequestDelta]):
    """Joins a reserved request to the batch with its first token and drafts
    (``LLMEngine.start_decoding``); the request's first delta."""

    request_id: str
    first_token: int
    draft_tokens: list[int]
    has_kv: bool = True

    def run(self, engine: LLMEngine) -> RequestDelta:
        return engine.start_decoding(
            self.request_id, self.first_token, self.draft_tokens, has_kv=self.has_kv
        )


@dataclass(frozen=True)
class PrefillReserved(EngineCommand[None]):
    """A co-located worker prefills, in place, a request its decode side reserved
    (``LLMEngine.prefill_reserved``)."""

    request_id: str
    prompt: list[int]

    def run(self, engine: LLMEngine) -> None:
        engine.prefill_reserved(self.request_id, self.prompt)


@dataclass(frozen=True)
class DropRequest(EngineCommand[None]):
    """Ends a request in the engine (``LLMEngine.drop_request``; ``stopped_after``: a
    stop string ended it there); ``then`` runs right after, on the engine thread.
    Cleanup: never refused."""

    is_new_work: ClassVar[bool] = False
    request_id: str
    then: Callable[[], None] | None = None
    stopped_after: int | None = None

    def run(self, engine: LLMEngine) -> None:
        engine.drop_request(self.request_id, stopped_after=self.stopped_after)
        if self.then is not None:
            self.then()


@dataclass(frozen=True)
class ReadBlockTables(EngineCommand[dict[str, list[int]]]):
    """The block tables of those of ``request_ids`` in the batch (``block_tables``)."""

    is_new_work: ClassVar[bool] = False
    request_ids: Collection[str]

    def run(self, engine: LLMEngine) -> dict[str, list[int]]:
        return block_tables(engine, self.request_ids)


@dataclass(frozen=True)
class ReadOwnedBlocks(EngineCommand[OwnedBlocks]):
    """Block ids held by requests (with their holders' count), and free ones holding a
    cached prefix (for audits)."""

    is_new_work: ClassVar[bool] = False

    def run(self, engine: LLMEngine) -> OwnedBlocks:
        return owned_block_ids(engine)


@dataclass(frozen=True)
class LoadLora(EngineCommand[int]):
    """Loads a LoRA adapter between steps (``LLMEngine.load_lora``); its digest."""

    is_new_work: ClassVar[bool] = False
    name: str
    path: str
    adapter: LoraAdapter | None = None  # read from ``path`` already (LLMEngine.read_lora)

    def run(self, engine: LLMEngine) -> int:
        engine.load_lora(self.name, self.path, self.adapter)
        return engine.lora_names[self.name][1]


@dataclass(frozen=True)
class UnloadLora(EngineCommand[None]):
    """Unloads a LoRA adapter between steps (``LLMEngine.unload_lora``)."""

    is_new_work: ClassVar[bool] = False
    name: str

    def run(self, engine: LLMEngine) -> None:
        engine.unload_lora(self.name)
