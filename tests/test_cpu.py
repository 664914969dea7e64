"""fastbert.cpu: the CPU's model name and features, read from /proc/cpuinfo."""

from fastbert import cpu


def test_first_processor_flags_in_feature_order(tmp_path):
    """The first processor's flags (x86 lists its model name before them), kept among FEATURES in their order."""
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu amx_bf16 avx2 avx512f amx_tile sse\n"
                   "processor\t: 1\nmodel name\t: Another\nflags\t\t: fpu avx512_vnni\n")
    assert cpu.cpu_info(str(x86)) == ("Some Xeon", frozenset({"fpu", "amx_bf16", "avx2", "avx512f", "amx_tile", "sse"}))
    assert cpu.cpu_flags(str(x86)) == ("avx2", "avx512f", "amx_tile", "amx_bf16")


def test_arm_features_line_and_an_unreadable_file(tmp_path):
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp sve asimd\n")
    assert cpu.cpu_flags(str(arm)) == ("asimd", "sve")
    name, flags = cpu.cpu_info(str(tmp_path / "missing"))
    assert name and flags == frozenset() and cpu.cpu_flags(str(tmp_path / "missing")) == ()


def test_precision_and_amx_lists_are_features():
    assert set(cpu.INT8_DOT) | set(cpu.NATIVE_BF16) | {cpu.AMX} <= set(cpu.FEATURES)
    assert cpu.AMX_BF16 in cpu.FEATURES
