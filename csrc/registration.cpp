// The schemas of the fused ops (embedding_layernorm, linear_activation, linear_residual_layernorm, attention) are
// declared once, with their fakes, by their specs in Python (fastbert/ops/<op>.py, registered by
// fastbert/cpp_backend.py before it imports this extension); the CPU kernels register their implementations
// (TORCH_LIBRARY_IMPL) beside their code in the other files. This block declares only the helper ops that exist in
// this extension alone. Importing `fastbert._C` runs these static registrations.
#include <Python.h>
#include <torch/library.h>

#include "fastbert.h"

TORCH_LIBRARY_FRAGMENT(fastbert, m) {
  // act(x + bias), activation in {"gelu", "gelu_tanh", "relu", "silu"}; x [..., N].
  m.def("cpp_bias_activation(Tensor x, Tensor? bias, str activation) -> Tensor");
  // LayerNorm(x + bias + residual); x, residual [..., N].
  m.def("cpp_bias_residual_layernorm(Tensor x, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor ln_bias, "
        "float eps) -> Tensor");
  // Rows of x [B, S, ...] at flat indices (b * S + s) -> [T, ...], and back (zeros at the other positions).
  m.def("cpp_unpad(Tensor x, Tensor indices) -> Tensor");
  m.def("cpp_pad(Tensor x, Tensor indices, int batch, int seqlen) -> Tensor");
  // x with each element kept with probability 1 - p and scaled to keep the mean, zero elsewhere; the mask a pure
  // function of (seed, p, flat index) (csrc/dropout.cpp), so the same call on the gradient is the backward.
  m.def("cpp_dropout(Tensor x, float p, int seed) -> Tensor");
}

namespace {

#define FASTBERT_STR2(x) #x
#define FASTBERT_STR(x) FASTBERT_STR2(x)

PyObject* compiled_capability(PyObject*, PyObject*) {
#if defined(CPU_CAPABILITY)
  return PyUnicode_FromString(FASTBERT_STR(CPU_CAPABILITY));
#else
  return PyUnicode_FromString("DEFAULT");
#endif
}

PyObject* vector_lanes(PyObject*, PyObject*) { return PyLong_FromLongLong(fastbert::kLanes); }

PyObject* bf16_attention_kernel(PyObject*, PyObject* head_dim) {
  const long long dim = PyLong_AsLongLong(head_dim);
  if (dim == -1 && PyErr_Occurred()) return nullptr;
  switch (fastbert::bf16_attention_kernel(at::kBFloat16, dim)) {
    case fastbert::Bf16Kernel::kAmx:
      return PyUnicode_FromString("amx");
    case fastbert::Bf16Kernel::kAvx512Bf16:
      return PyUnicode_FromString("avx512_bf16");
    case fastbert::Bf16Kernel::kNone:
      break;
  }
  return PyUnicode_FromString("vector");
}

PyMethodDef methods[] = {
    {"compiled_capability", compiled_capability, METH_NOARGS, "The at::vec CPU capability the kernels were built for."},
    {"vector_lanes", vector_lanes, METH_NOARGS, "fp32 lanes per at::vec::Vectorized<float> in this build."},
    {"bf16_attention_kernel", bf16_attention_kernel, METH_O,
     "Which kernel runs bf16 attention of this head dim here: amx, avx512_bf16 or vector."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fastbert's C++ CPU kernels (ops in torch.ops.fastbert).",
                          -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
