"""The CUDA kernels compile, checked with NVRTC on any machine (no GPU needed).

Running them needs a CUDA device: the ``gpu``-marked tests compare them with the torch
reference there. This test catches syntax and type errors everywhere else.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from servers.proc import in_ci

import gpu.cuda

MODULES = sorted(m.name for m in pkgutil.iter_modules(gpu.cuda.__path__))


def _nvrtc() -> object:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # cupy or its NVRTC library missing
        if in_ci():  # the test extra installs both: a missing one is a broken setup
            pytest.fail(f"NVRTC unavailable: {exc}")
        pytest.skip(f"NVRTC unavailable: {exc}")
    return nvrtc


def test_every_cuda_module_has_its_source() -> None:
    assert MODULES, "gpu/cuda has no kernel modules"
    for name in MODULES:
        module = importlib.import_module(f"gpu.cuda.{name}")
        assert isinstance(getattr(module, "CUDA_SOURCE", None), str), name


@pytest.mark.parametrize("name", MODULES)
def test_cuda_source_compiles_with_nvrtc(name: str) -> None:
    nvrtc = _nvrtc()
    source = importlib.import_module(f"gpu.cuda.{name}").CUDA_SOURCE
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])  # type: ignore[attr-defined]
    try:
        nvrtc.compileProgram(  # type: ignore[attr-defined]
            prog, ["--gpu-architecture=compute_80", "--std=c++17"]
        )
    except Exception as exc:
        log = nvrtc.getProgramLog(prog)  # type: ignore[attr-defined]
        pytest.fail(f"{name}: {exc}\n{log}")
    assert len(nvrtc.getPTX(prog)) > 0  # type: ignore[attr-defined]
