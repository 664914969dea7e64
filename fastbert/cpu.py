"""The CPU's model name and features: the one reader of /proc/cpuinfo, and the one list of features that fastbert's
choices, tuning caches and results name (SIMD width and FMA, int8 dot products, native bfloat16, AMX tiles, Arm's
SIMD)."""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Collection

# Features that change which kernels are fast, as /proc/cpuinfo spells them (x86 ``flags``, Arm ``Features``).
FEATURES = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
            "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products accumulated in int32
AMX = "amx_tile"  # AMX tile registers: oneDNN wants its weights in VNNI tiles there
AMX_BF16 = "amx_bf16"  # bfloat16 matrix products on those tiles
NATIVE_BF16 = (AMX_BF16, "avx512_bf16")  # bfloat16 arithmetic in hardware (elsewhere torch emulates it)


@functools.cache
def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(model name, every feature flag) of the CPU, from ``path``'s first processor (x86 ``flags`` or Arm
    ``Features``); the platform's name and no flags where it cannot be read."""
    name, flags = platform.processor() or platform.machine(), frozenset()
    with contextlib.suppress(OSError):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")):
                    flags = frozenset(line.split(":", 1)[1].split())
                    if flags:  # the first processor's (x86 lists its model name before its flags)
                        break
    return name, flags


def cpu_flags(path: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The CPU's features among `FEATURES`, in that order (empty where ``path`` cannot be read)."""
    present = cpu_info(path)[1]
    return tuple(flag for flag in FEATURES if flag in present)


def native_bf16(flags: Collection[str] | None = None) -> tuple[str, ...]:
    """The features among `NATIVE_BF16` that ``flags`` (default: this CPU's) has: empty where torch emulates
    bfloat16. Native is not fast: `fastbert.quantization.auto_cpu_dtype` decides whether bfloat16 pays."""
    flags = cpu_flags() if flags is None else flags
    return tuple(flag for flag in NATIVE_BF16 if flag in flags)
