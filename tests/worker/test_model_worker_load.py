"""ModelWorker.load: settings that shape what the engine is told about the model."""
from common.settings import Settings
from worker.model_worker import ModelWorker


def test_max_model_len_caps_the_context_the_engine_sees(tiny_model_dir):
    own = ModelWorker.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32"))
    assert own.info.max_model_len == 512                 # the tiny config's positions
    capped = ModelWorker.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32",
                                       max_model_len=100))
    assert capped.info.max_model_len == 100
    wider = ModelWorker.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32",
                                      max_model_len=10_000))
    assert wider.info.max_model_len == 512                # never beyond what the model has
