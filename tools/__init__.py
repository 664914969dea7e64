"""Developer tools, neither tests nor part of the installed package: `op_checks` (accuracy checks of the triton
ops at any shape, called by the kernel tests and benchmarks/gpu_check.py) and `compile_sm90` (every Triton kernel
compiled for sm_90 without a GPU, with its registers, spills and shared memory)."""
