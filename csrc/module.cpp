// Python bindings of dflash_kernels._C: one PYBIND11_MODULE for every C++
// entry point. Each family of ops lives in its own source file and declares
// its registration function here.
#include <torch/extension.h>

namespace dflash {
void register_tree_ops(pybind11::module_& m);
}  // namespace dflash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dflash_kernels C++ host code";
  dflash::register_tree_ops(m);
}
