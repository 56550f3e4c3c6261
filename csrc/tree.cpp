// Tree ops of DDTree (SPEC section 5). Filled in by the DDTree work.
#include <torch/extension.h>

namespace dflash {
void register_tree_ops(pybind11::module_& m) { (void)m; }
}  // namespace dflash
