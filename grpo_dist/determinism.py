"""`deterministic: true`: the settings that make CUDA kernels give the same bits on every run, so that a resumed
GPU run can continue bit for bit (docs/fault-tolerance.md says what resume guarantees without it).

They must be set before the first CUDA kernel runs: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its
handle, so train.main applies them right after the config is read, before the process group, any model or any
tensor on the GPU. On a CPU they change nothing that matters: the CPU kernels used here are deterministic already.
"""

from __future__ import annotations

import os

import torch

# a cuBLAS workspace size under which its GEMMs are deterministic (CUDA >= 10.2; ":16:8" is the smaller option)
CUBLAS_WORKSPACE = ":4096:8"


def apply(enabled: bool) -> dict:
    """Switch deterministic mode on (enabled) and return what it set, for the log and the tests; off: nothing."""
    if not enabled:
        return {}
    # a value the user set (":16:8" saves ~24 MB per stream) is kept; cuBLAS refuses an invalid one itself
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    # warn_only: an op without a deterministic kernel warns (torch names it) and runs, rather than killing a long
    # run at its first step on a model path never tried on this GPU
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False  # benchmarking picks the fastest kernel per run: not always the same one
    return {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.benchmark": torch.backends.cudnn.benchmark}
