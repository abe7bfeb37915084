"""vLLM's routes for LoRA adapters at run time, on the router's HTTP API (only with
``--allow-runtime-lora``; behind the API's bearer token like every /v1/ route):

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: every live worker loads
  the adapter from that directory on its host (router.lora_admin); 200 with a line of
  text once they all have, and requests may name it.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: they unload it; 404 when no worker
  has it, 409 while requests run under it.

Refusals are OpenAI-shaped, with the field at fault named: 400 for a bad name, an
adapter a worker cannot serve (unreadable, a rank over its bound, another base) or a
name already loaded.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from router.http_api.errors import http_error
from router.http_api.protocol import HttpError
from router.lora_admin import LoraAdmin, is_in_use
from router.validation import UnknownModel


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and unused (names are unique)


def add_lora_routes(app: FastAPI, admin: LoraAdmin) -> None:
    """The two routes (see the module's docstring) over ``admin``."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> str:
        try:
            await admin.load(body.lora_name, body.lora_path)
        except Exception as e:
            raise http_error(e) from e
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> str:
        try:
            await admin.unload(body.lora_name)
        except UnknownModel as e:
            raise HttpError(404, str(e), param="lora_name", code="lora_not_found") from e
        except Exception as e:
            if is_in_use(e):
                raise HttpError(409, http_error(e).message, param="lora_name") from e
            raise http_error(e) from e
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
