"""What fastbert's build needs code for: the packages (fastbert's own, found, and the Triton kernels of kernels/,
linked as fastbert/kernels and installed as the namespace package `fastbert.kernels`: see CONTRIBUTING.md) and the
C++ extension `fastbert._C` (skipped with FASTBERT_SKIP_EXT=1; a failed build warns and leaves the eager backend).
Everything declarative (name, version, dependencies, extras, the `fastbert` command, py.typed) is in
pyproject.toml."""

import glob
import os
import platform
import warnings

from setuptools import find_packages, setup

# ---------------------------------------------------------------------------------------------- C++ extension
# at::vec::Vectorized picks its implementation from the CPU_CAPABILITY_* macro, so the kernels are compiled for
# the build host's vector ISA (AVX512 > AVX2 > scalar DEFAULT); FASTBERT_CPU_CAPABILITY=default|avx2|avx512
# overrides the detection (e.g. to build for older machines than the build host).
_CAPABILITY_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mbmi2",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
}


def _host_capability() -> str:
    forced = os.environ.get("FASTBERT_CPU_CAPABILITY", "").lower()
    if forced:
        if forced not in _CAPABILITY_FLAGS:
            raise ValueError(f"FASTBERT_CPU_CAPABILITY must be one of {sorted(_CAPABILITY_FLAGS)}, got {forced!r}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        return "avx512"
    if {"avx2", "fma", "f16c"} <= set(flags):
        return "avx2"
    return "default"


ext_modules = []
cmdclass = {}
if os.environ.get("FASTBERT_SKIP_EXT", "0").lower() not in ("1", "true", "yes"):
    sources = sorted(glob.glob("csrc/*.cpp"))
    if sources:
        from torch.utils.cpp_extension import BuildExtension, CppExtension

        class OptionalBuildExtension(BuildExtension.with_options(use_ninja=True)):
            """Build fastbert._C, but never fail the install: fastbert runs eager (and says why) without it."""

            def run(self):
                try:
                    super().run()
                except Exception as err:  # noqa: BLE001 - any compiler/toolchain failure leaves the eager backend
                    self._warn(err)

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as err:  # noqa: BLE001
                    self._warn(err)

            def _warn(self, err):
                if getattr(self, "_fastbert_failed", False):  # the failed compile also fails the copy step
                    return
                self._fastbert_failed = True
                message = (f"fastbert: building the C++ extension fastbert._C failed ({type(err).__name__}: {err}); "
                           "installing without it, the cpp backend will be unavailable and fastbert runs eager")
                warnings.warn(message, stacklevel=1)
                self.announce(message, level=3)

            def get_outputs(self):  # only what was actually built, so a failed build leaves nothing to copy
                return [path for path in super().get_outputs() if os.path.exists(path)]

        capability = _host_capability()
        compile_args = ["-O3", "-g0", "-fopenmp", "-DFASTBERT_CAPABILITY=" + capability] + _CAPABILITY_FLAGS[capability]
        ext_modules.append(CppExtension("fastbert._C", sources, extra_compile_args={"cxx": compile_args},
                                        extra_link_args=["-fopenmp"], depends=glob.glob("csrc/*.h")))
        cmdclass["build_ext"] = OptionalBuildExtension

setup(
    packages=find_packages(include=["fastbert", "fastbert.*"]) + ["fastbert.kernels"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
