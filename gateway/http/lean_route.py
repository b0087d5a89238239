"""A FastAPI route served without the framework's per-call dependency solving, for the hot routes.

FastAPI documents a route from its endpoint's signature (the OpenAPI schema that clients and the fuzzer
read), and at every call solves that signature again: the body read by the standard library's ``json``,
then checked model by model, each parameter looked up and converted. For chat completions that costs 45-85 µs
a call more than this route (in-process, the same endpoint, a 10-turn conversation's body: 119-160 µs against
73-76 µs). ``LeanJsonRoute`` keeps the documentation and serves the call plainly: the body parsed and
checked from its bytes in one pass by pydantic's core (``model_validate_json``), the query parameters by a
model built once from the same signature (so their bounds are declared once), the path parameters as
matched. A refused body or query is FastAPI's ``RequestValidationError``, answered by the app's handler as
before (400 naming the field, ``gateway.errors``).

``LeanRoutes`` serves these routes from the ASGI stack, before FastAPI's router: that router walks its included
routers, wraps every call in two exit stacks and an exception wrapper, and matched a chat call in 57 µs more
than a bare Starlette route (in-process, the same endpoint: 67.5 against 10.5 µs). The lean routes need none of
it: they have no dependencies to close, and the app's exception handlers still answer what they raise.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Coroutine, Mapping, Sequence

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError, create_model
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

NOT_QUERY = ("body", "request")
"""The endpoint's parameters that are not its query: its JSON body (a pydantic model) and the request."""


class LeanJsonRoute(APIRoute):
    """The route of an endpoint ``endpoint(<path parameters>, body: <a pydantic model>, request: Request,
    <query parameters with their ``Query`` defaults>)`` that returns a ``Response``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint
        hints = typing.get_type_hints(endpoint)
        body: type[BaseModel] = hints["body"]
        query = create_model(f"{endpoint.__name__}_query", **{
            name: (hints[name], parameter.default) for name, parameter in inspect.signature(endpoint).parameters.items()
            if name not in NOT_QUERY and name not in self.param_convertors})
        try:  # a call without a query string (most) takes the defaults as they are
            defaults: dict[str, Any] | None = dict(query())
        except ValidationError:  # a required query parameter: every call is checked
            defaults = None

        async def handle(request: Request) -> Response:
            try:  # FastAPI's order: the query first
                values = dict(query.model_validate(request.query_params)) if request.scope["query_string"] \
                    or defaults is None else defaults
                parsed = body.model_validate_json(await request.body())
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from None
            return await endpoint(**request.path_params, body=parsed, request=request, **values)

        return handle


ExceptionHandler = Callable[[Request, Exception], Coroutine[Any, Any, Response]]


class LeanRoutes:
    """ASGI middleware, innermost of the app's own: a POST that a lean route's path matches is served by that
    route's handler here, as FastAPI's router would serve it (``scope["route"]`` and the path parameters set,
    an exception answered by the app's handler for it); any other request goes on to the framework.
    ``handlers``: the app's exception handlers (``FastAPI.exception_handlers``); the one for ``Exception`` (or 500)
    is left to the framework's outermost middleware, which answers and logs what reaches it."""

    def __init__(self, app: ASGIApp, routes: Sequence[LeanJsonRoute],
                 handlers: Mapping[Any, ExceptionHandler]) -> None:
        self.app = app
        self.handlers = {key: value for key, value in handlers.items() if key not in (500, Exception)}
        self.served = [(route, route.get_route_handler()) for route in routes]

    def handler(self, exc: Exception) -> ExceptionHandler | None:
        """The app's handler of ``exc`` as Starlette's ``ExceptionMiddleware`` looks it up: an HTTP exception's
        status code first, then the nearest class of ``exc`` that has one."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        return next((self.handlers[kind] for kind in type(exc).__mro__ if kind in self.handlers), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            for route, handle in self.served:
                found = route.path_regex.match(scope["path"])
                if found is not None:
                    scope["route"], scope["endpoint"] = route, route.endpoint
                    scope["path_params"] = {name: route.param_convertors[name].convert(value)
                                            for name, value in found.groupdict().items()}
                    return await self.serve(handle, scope, receive, send)
        await self.app(scope, receive, send)

    async def serve(self, handle: Callable[[Request], Coroutine[Any, Any, Response]], scope: Scope,
                    receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handle(request)
        except Exception as exc:
            handler = self.handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)  # a stream's failure once begun: its own events say it, as before
