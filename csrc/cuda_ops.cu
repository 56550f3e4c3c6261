// CUDA entry points compiled only in the CUDAExtension build.
#include <torch/extension.h>

namespace dflash {
void register_cuda_ops(pybind11::module_& m) {
  m.def("cuda_device_count", []() { return static_cast<int64_t>(torch::cuda::device_count()); },
        "Number of CUDA devices seen by the extension's CUDA runtime");
}
}  // namespace dflash
