"""The gateway's OpenAPI schema says what its routes accept and answer.

FastAPI derives the schema from the request models; two things it cannot know
are added here: errors are answered 400 with OpenAI's body (``4XX`` in place of
the framework's 422), and this gateway's own limits (``--response-length`` bounds
``max_tokens``, ``--prompt-length`` the length of ``/generate``'s ``prompt_ids``, the
tokenizer's vocabulary its token ids, once the tokenizer has loaded). A client or
a fuzzer reading the schema then meets no refusal the schema hides.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI

from trajbus.gateway.config import GatewaySettings

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "Error",
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
MAX_TOKENS = ("max_tokens", "max_completion_tokens")


def _openai_errors(schema: dict[str, Any]) -> None:
    for operation in (op for path in schema["paths"].values() for op in path.values()):
        operation["responses"].pop("422", None)
        operation["responses"]["4XX"] = {"description": "OpenAI-shaped error", "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    models = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        models.pop(name, None)
    models["Error"] = ERROR_SCHEMA


def _limits(schema: dict[str, Any], settings: GatewaySettings) -> None:
    models = schema["components"]["schemas"]
    for model in ("GenerateRequest", "ChatCompletionRequest"):
        for field in MAX_TOKENS:
            integer = next(s for s in models[model]["properties"][field]["anyOf"] if s.get("type") == "integer")
            integer.pop("exclusiveMaximum", None)
            integer["maximum"] = settings.response_length
    models["GenerateRequest"]["properties"]["prompt_ids"]["maxItems"] = settings.prompt_length
    messages_max_tokens = models["MessagesRequest"]["properties"]["max_tokens"]  # Anthropic's: required
    messages_max_tokens.pop("exclusiveMaximum", None)
    messages_max_tokens["maximum"] = settings.response_length


def describe(app: FastAPI, settings: GatewaySettings, vocabulary: Callable[[], int | None]) -> None:
    """Have ``app.openapi()`` (``/openapi.json``) state OpenAI errors and this gateway's limits;
    ``vocabulary``: the tokenizer's size, None while it loads (the bound is added once known)."""
    framework_openapi = app.openapi
    vocabulary_stated = False

    def openapi() -> dict[str, Any]:
        nonlocal vocabulary_stated
        if app.openapi_schema is None:
            schema = framework_openapi()  # cached by FastAPI in app.openapi_schema: changed once, here
            _openai_errors(schema)
            _limits(schema, settings)
        size = None if vocabulary_stated else vocabulary()
        if size is not None:  # the engine refuses ids past it (400): the schema says so
            ids = app.openapi_schema["components"]["schemas"]["GenerateRequest"]["properties"]["prompt_ids"]
            ids["items"]["exclusiveMaximum"] = size
            vocabulary_stated = True
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
