"""Which model serves a request: its `model` (an alias resolved) is one of the served models,
else a 404 `model_not_found` as OpenAI answers; one that no live worker serves is a 503 with
Retry-After (with several models: a lone model's requests wait in its queue, as ever)."""
from __future__ import annotations

from common.settings import ServedModel

from .context import engine, settings
from .errors import APIError

# How soon a client may retry a model with no live worker: a worker starting takes ~10 s.
RETRY_AFTER_S = 10


def routed_model(name: str | None) -> ServedModel:
    """The model a request names (None: the default); a 404 for a name nothing serves."""
    model = settings().resolve_model(name)
    if model is None:
        raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error",
                       param="model", code="model_not_found")
    return model


def ready_model(name: str | None) -> ServedModel:
    """routed_model, and a 503 when several models are served and none of this one's workers
    is alive (the queue of a model nobody serves would hold its requests for nothing)."""
    model = routed_model(name)
    if len(settings().served_models()) > 1 and not engine().is_served(model.name):
        raise APIError(503, f"The model `{model.name}` has no live worker; retry later.",
                       "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)},
                       param="model", code="model_not_ready")
    return model


def model_object(model: ServedModel) -> dict:
    """A model as /v1/models lists it, with what its live workers report."""
    workers = engine().workers_of(model.name)
    lens = [int(w["max_model_len"]) for w in workers
            if w.get("max_model_len", "").isdigit() and int(w["max_model_len"]) > 0]
    backend = next((w["backend"] for w in workers if w.get("backend")), settings().backend)
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "llmq",
            "root": model.source, "max_model_len": min(lens) if lens else None,
            "backend": backend}


def listed_models() -> list[ServedModel]:
    """What /v1/models lists: the models a live worker serves; with one model, that model
    whatever its workers (a client lists it before the first worker is up)."""
    models = settings().served_models()
    if len(models) == 1:
        return list(models)
    return [m for m in models if engine().workers_of(m.name)]
