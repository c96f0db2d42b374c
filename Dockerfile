# Training image: the same pinned closure as `make setup` (requirements.lock), CUDA-enabled torch.
#   docker build -t edgebayes . && docker run --gpus all -v $PWD/runs:/app/runs edgebayes pipeline
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends git make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-deps -r requirements.lock
COPY src ./src
COPY devices ./devices
COPY configs ./configs
COPY pipeline.yaml Makefile ./
RUN pip install --no-deps -e . && pip check
ENTRYPOINT ["edgebayes"]
CMD ["pipeline"]
