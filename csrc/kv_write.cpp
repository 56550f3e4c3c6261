// dflash::kv_write_: write one pass's K/V rows into one layer of the preallocated cache, in place.
//
//   kv_write_(Tensor(a!) kv, int layer, Tensor rows, Tensor key, Tensor value) -> ()
//
// One sequence: kv [L, 2, Hkv, S, D] (layers, key/value, kv heads, positions, head dim), rows [T] int64
// (or int32) on kv's device (destination positions, distinct, < S), key / value [Hkv, T, D]:
//   kv[layer, 0, :, rows[t]] = key[:, t]     kv[layer, 1, :, rows[t]] = value[:, t]
// A batch of b independent sequences: kv [b, L, 2, Hkv, S, D] (row r's slice kv[r] is the one-sequence
// layout), rows [b, T] (each row's positions distinct, < S), key / value [b, Hkv, T, D]:
//   kv[r, layer, 0, :, rows[r, t]] = key[r, :, t]     kv[r, layer, 1, :, rows[r, t]] = value[r, :, t]
// (converted to kv's dtype). It is the write of the compiled (fixed-shape) rounds: the rows sit at the
// device-side cache length, so no host value changes per round. A C++ op rather than a Python
// torch.library.custom_op because the compiled CPU round calls it once per layer per pass and a Python
// custom op's dispatch costs there about as much as the tiny pair's whole attention; as an op
// with a mutable argument (a!) it is re-inplaced by inductor (the traced alternative, index_copy_ on a
// view of the cache, is functionalized into a copy of the WHOLE cache per layer). The fake (meta)
// implementation lives in dflash_kernels/ops.py. One implementation serves every device
// (CompositeExplicitAutograd: the device's own index kernels).
//
// Each form is one index-based write per key and per value, whatever b and T: the one-sequence form an
// index_copy_ along the positions; the batched form an index_put_ with the broadcast index triple
// (r [b, 1, 1], h [1, Hkv, 1], rows[r, t] [b, 1, T]) -> [b, Hkv, T], which pairs every (row, head, t)
// with its own element of key [b, Hkv, T, D]. No value of rows is read on the host (no sync) and the
// host does not loop over the batch; the writes never collide since the positions within a row are
// distinct and different rows (or heads) address different elements.
#include <torch/extension.h>
#include <torch/library.h>

namespace dflash {
namespace {

bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kLong || t.scalar_type() == at::kInt;
}

void kv_write_one_(at::Tensor& kv, int64_t layer, const at::Tensor& rows, const at::Tensor& key,
                   const at::Tensor& value) {
  TORCH_CHECK(rows.dim() == 1 && is_index_dtype(rows),
              "kv_write_: with a one-sequence kv [L, 2, Hkv, S, D], rows must be a 1-D [T] int64/int32 tensor, got ",
              rows.sizes(), " ", rows.scalar_type());
  const int64_t T = rows.size(0);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv.size(2) && t->size(1) == T && t->size(2) == kv.size(4),
                "kv_write_: key/value must be [Hkv=", kv.size(2), ", T=", T, ", D=", kv.size(4), "], got ", t->sizes());
  }
  at::Tensor slot = kv.select(0, layer);
  slot.select(0, 0).index_copy_(1, rows, key.to(kv.scalar_type()));
  slot.select(0, 1).index_copy_(1, rows, value.to(kv.scalar_type()));
}

void kv_write_batched_(at::Tensor& kv, int64_t layer, const at::Tensor& rows, const at::Tensor& key,
                       const at::Tensor& value) {
  const int64_t b = kv.size(0), heads = kv.size(3);
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == b && is_index_dtype(rows),
              "kv_write_: with a batched kv [b=", b, ", L, 2, Hkv, S, D], rows must be a 2-D [b=", b,
              ", T] int64/int32 tensor (each row's destination positions), got ", rows.sizes(), " ",
              rows.scalar_type());
  const int64_t T = rows.size(1);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == b && t->size(1) == heads && t->size(2) == T && t->size(3) == kv.size(5),
                "kv_write_: with a batched kv, key/value must be [b=", b, ", Hkv=", heads, ", T=", T, ", D=",
                kv.size(5), "], got ", t->sizes());
  }
  const auto index_options = rows.options().dtype(at::kLong);
  const at::Tensor batch = at::arange(b, index_options).view({b, 1, 1});
  const at::Tensor head = at::arange(heads, index_options).view({1, heads, 1});
  const at::Tensor pos = rows.to(at::kLong).unsqueeze(1);  // [b, 1, T]
  const c10::List<std::optional<at::Tensor>> index({batch, head, pos});
  at::Tensor slot = kv.select(1, layer);                     // [b, 2, Hkv, S, D]
  slot.select(1, 0).index_put_(index, key.to(kv.scalar_type()));    // [b, Hkv, S, D][r, h, rows[r, t]]
  slot.select(1, 1).index_put_(index, value.to(kv.scalar_type()));
}

void kv_write_(at::Tensor kv, int64_t layer, const at::Tensor& rows, const at::Tensor& key, const at::Tensor& value) {
  const bool one = kv.dim() == 5 && kv.size(1) == 2;
  const bool batched = kv.dim() == 6 && kv.size(2) == 2;
  TORCH_CHECK(one || batched,
              "kv_write_: kv must be [L, 2, Hkv, S, D] (one sequence) or [b, L, 2, Hkv, S, D] (a batch), got ",
              kv.sizes());
  const int64_t layers = kv.size(batched ? 1 : 0);
  TORCH_CHECK(layer >= 0 && layer < layers, "kv_write_: layer ", layer, " is outside [0, L=", layers, ")");
  TORCH_CHECK(rows.device() == kv.device(), "kv_write_: rows must be on kv's device ", kv.device(), ", got ",
              rows.device());
  if (batched) {
    kv_write_batched_(kv, layer, rows, key, value);
  } else {
    kv_write_one_(kv, layer, rows, key, value);
  }
}

}  // namespace
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("kv_write_(Tensor(a!) kv, int layer, Tensor rows, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(dflash, CompositeExplicitAutograd, m) {
  m.impl("kv_write_", &dflash::kv_write_);
}
