// Python bindings of dflash_kernels._C: one PYBIND11_MODULE for every C++ and
// CUDA entry point. Each family of ops lives in its own source file and
// declares its registration function here.
#include <torch/extension.h>

namespace dflash {
void register_tree_ops(pybind11::module_& m);
#ifdef DFLASH_WITH_CUDA
void register_cuda_ops(pybind11::module_& m);
#endif
}  // namespace dflash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dflash_kernels C++/CUDA host code";
#ifdef DFLASH_WITH_CUDA
  m.attr("built_with_cuda") = true;
  dflash::register_cuda_ops(m);
#else
  m.attr("built_with_cuda") = false;
#endif
  dflash::register_tree_ops(m);
}
