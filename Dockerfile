# primus_v4 on the ROCm Primus image: packed (THD) DeepSeek-V4 SFT on gfx942 (MI300X/MI308X)
# and gfx950 (MI355X). The image's ROCm torch is kept as is; this package is installed on top.
#   docker build -t primus-v4 .
#   docker build --build-arg BUILD_PRIMUS_TURBO=1 --build-arg PRIMUS_TURBO_REF=<commit> -t primus-v4 .
#   docker run --rm -it --network host --ipc host --device /dev/kfd --device /dev/dri \
#     --group-add video --security-opt seccomp=unconfined primus-v4
ARG BASE_IMAGE=rocm/primus:v26.5
FROM ${BASE_IMAGE}

# Off by default: the image already ships a primus-turbo, and the kernel seam falls back to the
# torch reference (logged) when it is absent or does not accept an op.
ARG BUILD_PRIMUS_TURBO=0
ARG PRIMUS_TURBO_REPO=https://github.com/AMD-AGI/Primus-Turbo.git
ARG PRIMUS_TURBO_REF=main

# Kernels built here (primus-turbo, torch extensions) target both supported architectures.
ENV PYTORCH_ROCM_ARCH="gfx942;gfx950" \
    GPU_ARCHS="gfx942;gfx950" \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The ref is a build argument chosen by the caller (a commit for reproducible images); pip
# resolves the build's own requirements against the image's pinned ROCm stack. `cd` instead of
# WORKDIR: the checkout is a conditional, throw-away directory removed in the same layer.
# hadolint ignore=DL3003
RUN if [ "${BUILD_PRIMUS_TURBO}" = "1" ]; then \
        git clone --recursive "${PRIMUS_TURBO_REPO}" /tmp/primus-turbo && \
        cd /tmp/primus-turbo && \
        git checkout "${PRIMUS_TURBO_REF}" && \
        git submodule update --init --recursive && \
        pip install --no-build-isolation . && \
        cd / && rm -rf /tmp/primus-turbo; \
    fi

WORKDIR /workspace/primus_v4
COPY . .

# The package is installed as a built wheel (presets and run configs are its package data), the
# way users install it; the checkout stays for the recipes in run_scripts/. The constraint pins
# torch (and its ROCm-built companions) to the versions already in the image, so resolving this
# package's requirements can never replace the ROCm torch with a CPU/CUDA wheel.
RUN pip freeze | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton-rocm)==' \
        > /tmp/image-torch-constraints.txt || true; \
    pip wheel --no-deps --wheel-dir /tmp/dist . && \
    pip install -c /tmp/image-torch-constraints.txt /tmp/dist/primus_v4-*.whl && \
    rm -rf /tmp/dist /tmp/image-torch-constraints.txt

RUN python -c "import torch, primus_v4; \
print('torch', torch.__version__, 'hip', torch.version.hip); \
print('primus_v4', primus_v4.__version__)" && \
    (python -c "import megatron.core as m; print('megatron-core', m.__version__)" || true) && \
    (python -c "import primus_turbo; print('primus_turbo', getattr(primus_turbo, '__version__', '?'))" \
        || echo "primus_turbo not installed (torch reference kernels will be used)") && \
    primus-v4 --version && \
    primus-v4 inspect model deepseek_v4_flash
