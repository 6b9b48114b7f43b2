"""vLLM's sleep-mode routes: ``POST /sleep?level=1|2``, ``POST /wake_up[?tags=weights&tags=kv_cache]``,
``GET /is_sleeping``. They need ``--enable-sleep-mode`` (a 400 naming it otherwise) and, with
``--api-key``, the key. Requests that arrive while the engine sleeps wait until ``/wake_up``;
``/sleep`` while requests run is refused (409)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from pagedlm.server.errors import APIError
from pagedlm.server.serving_common import ServerState, check_engine, get_state

router = APIRouter()

_TAGS = ("weights", "kv_cache")


def _check_enabled(state: ServerState) -> None:
    check_engine(state)
    if not state.engine.model_config.enable_sleep_mode:
        raise APIError("sleep mode is off: start the server with --enable-sleep-mode to use /sleep, /wake_up and "
                       "/is_sleeping")


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> Any:
    state = get_state(request)
    _check_enabled(state)
    if level not in (1, 2):
        raise APIError(f"level={level} is invalid: 1 (weights to host memory, KV cache dropped) or 2 (both dropped)",
                       param="level")
    try:
        await state.engine.sleep(level)
    except (RuntimeError, ValueError) as e:  # e.g. requests still running
        raise APIError(f"cannot sleep now: {e}", status=409) from None
    return {"is_sleeping": True, "level": level}


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> Any:
    state = get_state(request)
    _check_enabled(state)
    unknown = sorted(set(tags or ()) - set(_TAGS))
    if unknown:
        raise APIError(f"tags {unknown} are unknown; allowed: {', '.join(_TAGS)}", param="tags")
    try:
        await state.engine.wake_up(tags)
    except (RuntimeError, ValueError) as e:  # e.g. kv_cache before weights
        raise APIError(f"cannot wake up: {e}", status=409) from None
    return {"is_sleeping": await state.engine.is_sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> Any:
    state = get_state(request)
    _check_enabled(state)
    return {"is_sleeping": await state.engine.is_sleeping()}
