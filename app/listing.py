"""The query and answer of every list route (files, batches, jobs): OpenAI's `after` + `limit`
in, `{"object": "list", "data", "first_id", "last_id", "has_more"}` out."""
from __future__ import annotations

from flask import jsonify, request

from common.owner_index import UnknownCursor

from .errors import APIError


def list_params(default_limit: int, max_limit: int) -> tuple[str | None, int]:
    """`after` and `limit` of a list route, as OpenAI takes them."""
    after = request.args.get("after") or None
    try:
        limit = int(request.args.get("limit", default_limit))
    except ValueError:
        raise APIError(400, "'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= max_limit:
        raise APIError(400, f"'limit' must be between 1 and {max_limit}", param="limit")
    return after, limit


def page_json(page_fn, *args, **kwargs):
    """The page page_fn returns, as JSON; an unknown cursor is a 400."""
    try:
        return jsonify(page_fn(*args, **kwargs).as_json())
    except UnknownCursor as exc:
        raise APIError(400, str(exc), param="after") from None
