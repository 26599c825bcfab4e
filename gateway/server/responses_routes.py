"""OpenAI's Responses API: POST /v1/responses (plain, streamed or in the background), GET and DELETE
/v1/responses/{id}, POST .../cancel and GET .../input_items. Thin: the body is decoded by the service
(gateway/responses/service.py), whose errors name the item at fault (``input[3].call_id``)."""

from __future__ import annotations

from typing import Annotated, Literal

from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, QueryParameter

from gateway.auth import owner
from gateway.domain_errors import Invalid
from gateway.responses.service import ResponsesService
from gateway.streaming import streamed_or_whole
from wire.responses import DeletedResponse, InputItemList
from wire.responses import Response as ResponseBody

JSON = "application/json"


@post("/v1/responses", status_code=200)
async def create_response(request: Request, state: State) -> Response:
    service: ResponsesService = state.responses
    prepared = await service.prepare(await request.body(), owner(request))
    if prepared.request.background:
        if prepared.request.stream:
            raise Invalid("a background response is not streamed here: poll GET /v1/responses/{id}", param="stream")
        return Response(await service.start_background(prepared), media_type=JSON)
    return await streamed_or_whole(request.receive, service.stream(prepared) if prepared.request.stream else None,
                                   lambda: service.create(prepared))


@get("/v1/responses/{response_id:str}")
async def get_response(response_id: FromPath[str], request: Request, state: State) -> ResponseBody:
    return (await state.responses.store.fetch(owner(request), response_id)).response


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(response_id: FromPath[str], request: Request, state: State) -> DeletedResponse:
    await state.responses.delete(owner(request), response_id)
    return DeletedResponse(id=response_id)


@post("/v1/responses/{response_id:str}/cancel", status_code=200)
async def cancel_response(response_id: FromPath[str], request: Request, state: State) -> ResponseBody:
    return await state.responses.cancel(owner(request), response_id)


@get("/v1/responses/{response_id:str}/input_items")
async def list_input_items(response_id: FromPath[str], request: Request, state: State,
                           limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
                           order: FromQuery[Literal["asc", "desc"]] = "desc",
                           after: FromQuery[str | None] = None) -> InputItemList:
    items = list((await state.responses.store.fetch(owner(request), response_id)).input)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise Invalid(f"after: no item {after!r} in this response's input", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=len(items) > limit)


RESPONSES_ROUTES = [create_response, get_response, delete_response, cancel_response, list_input_items]
