# elastictrain on Ray's image: the code reaches every pod through this image (never a bare `pip install
# elastictrain` from a public index: this project is not published there).
#   GPU: docker build -t YOUR-REGISTRY/elastictrain:0.1.0-gpu .
#   CPU: docker build --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu -t YOUR-REGISTRY/elastictrain:0.1.0-cpu .
# TORCH selects the PyTorch build (the CPU image can point pip at a CPU-only wheel index with PIP_EXTRA_ARGS).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}
ARG TORCH="torch==2.13.0"
ARG PIP_EXTRA_ARGS=""
# rayproject/ray runs as the non-root user `ray` (uid 1000, group users/100); keep it that way.
USER ray
WORKDIR /home/ray/elastictrain
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users elastictrain ./elastictrain
RUN pip install --no-cache-dir ${PIP_EXTRA_ARGS} "${TORCH}" \
 && pip install --no-cache-dir ${PIP_EXTRA_ARGS} ".[hf]"
# Job files and example tasks: `python -m elastictrain run jobs/<job>.yaml` works from this directory, and
# `task.entry: "examples.<module>:<function>"` imports from it (PYTHONPATH also reaches Ray's workers).
COPY --chown=ray:users jobs ./jobs
COPY --chown=ray:users examples ./examples
ENV PYTHONPATH=/home/ray/elastictrain
