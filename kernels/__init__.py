"""fastbert's Triton kernels, installed as `fastbert.kernels`: one module per fused op (kernel, launcher, torch op
``torch.ops.fastbert.triton_<op>``, autograd), `gemm` (the GEMM kernel and its epilogues, shared by the linear ops)
and `common` (interpreter switch, dropout arguments, reasons, helpers). Importing this package registers nothing:
`fastbert.backends.triton` imports the kernel modules and registers them as the ``triton`` backend."""
