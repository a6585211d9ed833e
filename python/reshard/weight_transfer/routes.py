"""An HTTP middleware for ``vllm serve``: bad bodies of the backend's routes refused with 400
before they reach a worker, and ``/pause`` held as a lease."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import fields as dataclasses_fields
from typing import Any, Optional

from .._core import ArgumentError
from .info import ReshardInitInfo, ReshardUpdateInfo

logger = logging.getLogger(__name__)


# The routes whose bodies the backend reads, with the body's field and the info class.
_CHECKED = {
    "/init_weight_transfer_engine": ("init_info", ReshardInitInfo),
    "/update_weights": ("update_info", ReshardUpdateInfo),
}


def _refusal(body: Any, field_name: str, cls) -> Optional[str]:
    """Why a request's body is no ``cls`` (None: it is one)."""
    if not isinstance(body, dict) or field_name not in body:
        return f"{field_name}: missing from the request's body"
    infos = body[field_name]
    for info in infos if isinstance(infos, list) else [infos]:
        if not isinstance(info, dict):
            return f"{field_name}: {info!r:.60} is not an object"
        known = {f.name for f in dataclasses_fields(cls)}
        unknown = sorted(set(info) - known)
        if unknown:
            fields = ", ".join(sorted(known))
            return f"{field_name}.{unknown[0]}: not a field of {cls.__name__} (fields: {fields})"
        try:
            cls(**info)
        except TypeError as e:
            return f"{field_name}: {e}"
        except ArgumentError as e:
            return f"{field_name}.{e}"
    return None


#: Seconds a ``/pause`` holds the server without a ``/resume`` before the server resumes
#: itself (``RESHARD_PAUSE_LEASE``; default 120): a trainer killed between the two must not
#: leave it paused.
DEFAULT_PAUSE_LEASE = 120.0
_PAUSES = {"n": 0}


def _pause_lease() -> float:
    raw = os.environ.get("RESHARD_PAUSE_LEASE")
    try:
        value = float(raw) if raw is not None else DEFAULT_PAUSE_LEASE
    except ValueError:
        value = -1.0
    if not 0 < value < 1e7:
        raise ArgumentError(f"RESHARD_PAUSE_LEASE: {raw!r:.40} is invalid: a positive number of seconds")
    return value


async def _lease(app, n: int, seconds: float) -> None:
    """Resumes the server ``seconds`` after the pause numbered ``n`` unless a ``/resume`` (or
    a later pause) came since; the prefix cache is reset first (a commit may have landed)."""
    import asyncio

    await asyncio.sleep(seconds)
    if _PAUSES["n"] != n:
        return
    engine = app.state.engine_client
    logger.warning("reshard: no /resume %.0f s after /pause: the server resumes itself", seconds)
    try:
        await engine.reset_prefix_cache()
    finally:
        await engine.resume_generation()


async def check_requests(request, call_next):
    """An HTTP middleware for ``vllm serve`` (``--middleware reshard.vllm_backend.check_requests``):
    a bad ``/init_weight_transfer_engine`` or ``/update_weights`` body is refused with 400,
    naming the field, before it reaches a worker (vLLM itself answers a worker's refusal with
    500); and a ``/pause`` is a lease: without a ``/resume`` within ``RESHARD_PAUSE_LEASE``
    seconds the server resets its prefix cache and resumes by itself."""
    path = request.url.path
    if request.method == "POST" and path in ("/pause", "/resume"):
        _PAUSES["n"] += 1
        answer = await call_next(request)
        if path == "/pause" and answer.status_code == 200:
            import asyncio

            asyncio.get_running_loop().create_task(_lease(request.app, _PAUSES["n"], _pause_lease()))
        return answer
    checked = _CHECKED.get(path)
    if checked is None or request.method != "POST":
        return await call_next(request)
    from fastapi.responses import JSONResponse

    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        problem = f"the request's body is no JSON: {e}"
    else:
        problem = _refusal(body, *checked)
    if problem is not None:
        return JSONResponse(
            status_code=400, content={"error": {"message": problem, "type": "BadRequestError", "code": 400}}
        )
    return await call_next(request)
