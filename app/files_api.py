"""OpenAI's /v1/files: upload (multipart, purpose "batch"), list, retrieve, content, delete.

Files live in Redis (common/file_store.py says why and what that limits). Another API key's
file answers 404, as if it did not exist.
"""
from __future__ import annotations

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request

from common.file_store import FileStore, StorageFull

from .context import settings
from .errors import APIError
from .listing import list_params, page_json

bp = Blueprint("files", __name__)

# Room for the multipart framing and the other form fields around the file itself.
_MULTIPART_OVERHEAD = 64 * 1024


def file_store() -> FileStore:
    return current_app.extensions["llmq"]["files"]


def no_such_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", "not_found_error", param="id")


def find_file(file_id: str) -> dict:
    obj = file_store().get(file_id, g.owner)
    if obj is None:
        raise no_such_file(file_id)
    return obj


@bp.before_request
def _allow_large_upload():
    # The app-wide body limit (LLMQ_MAX_BODY_BYTES) is for JSON requests; an upload may be as
    # big as a file may be, and is checked exactly below.
    if request.method == "POST" and request.path == "/v1/files":
        request.max_content_length = settings().file_max_bytes + _MULTIPART_OVERHEAD


def jsonl_lines(text: str) -> list[str]:
    """JSON Lines' lines: split at \n only (str.splitlines also splits at U+2028, U+2029 and
    U+0085, which JSON leaves raw inside strings), a \r before it dropped."""
    return [line.removesuffix("\r") for line in text.split("\n")]


@bp.post("/v1/files")
def upload_file():
    s = settings()
    purpose = request.form.get("purpose")
    if purpose != "batch":
        raise APIError(400, "'purpose' must be 'batch' (the only purpose this server takes)",
                       param="purpose")
    upload = request.files.get("file")
    if upload is None:
        raise APIError(400, "a multipart field 'file' is required", param="file")
    raw = upload.stream.read(s.file_max_bytes + 1)
    if len(raw) > s.file_max_bytes:
        raise APIError(413, f"the file is larger than {s.file_max_bytes} bytes "
                            "(LLMQ_FILE_MAX_BYTES)", param="file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the file must be UTF-8 text (JSON Lines)", param="file") from None
    num_lines = sum(1 for line in jsonl_lines(text) if line.strip())
    if num_lines == 0:
        raise APIError(400, "the file is empty", param="file")
    if num_lines > s.file_max_lines:
        raise APIError(400, f"the file has {num_lines} lines; at most {s.file_max_lines} "
                            "(LLMQ_FILE_MAX_LINES)", param="file")
    try:
        obj = file_store().put(g.owner, purpose, upload.filename or "upload.jsonl", text,
                               max_bytes=s.file_max_bytes_per_key,
                               max_files=s.file_max_files_per_key)
    except StorageFull as full:
        raise storage_full(full) from None
    return jsonify(obj)


def storage_full(full: StorageFull) -> APIError:
    """OpenAI answers a file past its storage quota with a 400 invalid_request_error ("You have
    exceeded your file storage quota ... Please delete old files"): not a 429, since waiting
    frees nothing unless files expire."""
    cap, var = ((settings().file_max_bytes_per_key, "LLMQ_FILE_MAX_BYTES_PER_KEY")
                if full.limit == "bytes" else
                (settings().file_max_files_per_key, "LLMQ_FILE_MAX_FILES_PER_KEY"))
    return APIError(400, f"this file would take your key's files to {full.would_hold} "
                         f"{full.limit}; at most {cap} ({var}): delete files you no longer "
                         "need, or wait for them to expire", param="file",
                    code="storage_limit_exceeded")


@bp.get("/v1/files")
def list_files():
    after, limit = list_params(10_000, 10_000)
    return page_json(file_store().list, g.owner, after, limit, request.args.get("purpose"))


@bp.get("/v1/files/<file_id>")
def retrieve_file(file_id: str):
    return jsonify(find_file(file_id))


@bp.get("/v1/files/<file_id>/content")
def file_content(file_id: str):
    content = file_store().content(file_id, g.owner)
    if content is None:
        raise no_such_file(file_id)
    return Response(content, mimetype="application/jsonl")


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str):
    if not file_store().delete(file_id, g.owner):
        raise no_such_file(file_id)
    return jsonify({"id": file_id, "object": "file", "deleted": True})


def init_app(app: Flask) -> None:
    ext = app.extensions["llmq"]
    ext["files"] = ext["store"].beside(FileStore, ext["settings"].file_ttl_s)
    app.register_blueprint(bp)
