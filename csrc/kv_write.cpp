// dflash::kv_write_: write one pass's K/V rows into one layer of the preallocated cache, in place.
//
//   kv_write_(Tensor(a!) kv, int layer, Tensor rows, Tensor key, Tensor value) -> ()
//
// kv [L, 2, Hkv, S, D] (layers, key/value, kv heads, positions, head dim), rows [T] int64 on kv's
// device (destination positions, distinct, < S), key / value [Hkv, T, D]:
//   kv[layer, 0, :, rows[t]] = key[:, t]     kv[layer, 1, :, rows[t]] = value[:, t]
// (converted to kv's dtype). It is the write of the compiled (fixed-shape) rounds: the rows sit at the
// device-side cache length, so no host value changes per round. A C++ op rather than a Python
// torch.library.custom_op because the compiled CPU round calls it once per layer per pass and a Python
// custom op's dispatch costs ~60 us per call there, about the tiny pair's whole attention; as an op
// with a mutable argument (a!) it is re-inplaced by inductor (the traced alternative, index_copy_ on a
// view of the cache, is functionalized into a copy of the WHOLE cache per layer). The fake (meta)
// implementation lives in dflash_kernels/ops.py. One implementation serves every device
// (CompositeExplicitAutograd: two index_copy_ calls of the device's own kernels).
#include <torch/extension.h>
#include <torch/library.h>

namespace dflash {
namespace {

void kv_write_(at::Tensor kv, int64_t layer, const at::Tensor& rows, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "kv_write_: kv must be [L, 2, Hkv, S, D], got ", kv.sizes());
  TORCH_CHECK(layer >= 0 && layer < kv.size(0), "kv_write_: layer ", layer, " is outside [0, ", kv.size(0), ")");
  TORCH_CHECK(rows.dim() == 1 && (rows.scalar_type() == at::kLong || rows.scalar_type() == at::kInt),
              "kv_write_: rows must be a 1-D int64/int32 tensor, got ", rows.sizes(), " ", rows.scalar_type());
  TORCH_CHECK(rows.device() == kv.device(), "kv_write_: rows must be on kv's device ", kv.device(), ", got ",
              rows.device());
  const int64_t T = rows.size(0);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv.size(2) && t->size(1) == T && t->size(2) == kv.size(4),
                "kv_write_: key/value must be [Hkv=", kv.size(2), ", T=", T, ", D=", kv.size(4), "], got ", t->sizes());
  }
  at::Tensor slot = kv.select(0, layer);
  slot.select(0, 0).index_copy_(1, rows, key.to(kv.scalar_type()));
  slot.select(0, 1).index_copy_(1, rows, value.to(kv.scalar_type()));
}

}  // namespace
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("kv_write_(Tensor(a!) kv, int layer, Tensor rows, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(dflash, CompositeExplicitAutograd, m) {
  m.impl("kv_write_", &dflash::kv_write_);
}
