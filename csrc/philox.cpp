// dflash::philox_uint32: the counter-based words of the device-seeded samplers, on the CPU.
//
//   philox_uint32(Tensor seed, Tensor rows, Tensor cols) -> Tensor
//
// seed: one int64 element (its 64 bits are the key (k0, k1) = (low 32, high 32)); rows [R], cols [C]:
// non-negative ints < 2**32. Returns int64 [R, C] holding uint32 words: Philox-4x32-10 of the counter
// (cols[c], rows[r], 0, 0) under that key, word c0 after 10 rounds. Each round:
//   (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2  (64-bit products, exact in uint64_t)
//   c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0),  k += (W0, W1) mod 2**32
// The same integers as the pure-torch reference (dflash_kernels.reference.philox_uint32: int64 tensor ops,
// ~100 small ops per call) and the Triton kernels' uint32 arithmetic; this loop costs microseconds, so the
// CPU round's sampler is not bound by op dispatch. Integer arithmetic only: bit-exact by construction.
// The fake (shape) implementation is registered in dflash_kernels/noise.py, beside the stream's layout.
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdint>

namespace dflash {
namespace {

constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;

inline uint32_t philox_word(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1) {
  uint32_t c2 = 0, c3 = 0;
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t p0 = kM0 * c0, p1 = kM1 * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return c0;
}

at::Tensor philox_uint32(const at::Tensor& seed, const at::Tensor& rows, const at::Tensor& cols) {
  TORCH_CHECK(seed.numel() == 1, "philox_uint32: seed must hold one element, got ", seed.sizes());
  TORCH_CHECK(rows.dim() == 1 && cols.dim() == 1, "philox_uint32: rows and cols must be 1-D, got ", rows.sizes(),
              " and ", cols.sizes());
  TORCH_CHECK(seed.device().is_cpu() && rows.device().is_cpu() && cols.device().is_cpu(),
              "philox_uint32: the C++ op runs on CPU tensors");
  const uint64_t key = static_cast<uint64_t>(seed.to(at::kLong).reshape({}).item<int64_t>());
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const at::Tensor r = rows.to(at::kLong).contiguous(), c = cols.to(at::kLong).contiguous();
  const int64_t R = r.size(0), C = c.size(0);
  at::Tensor out = at::empty({R, C}, rows.options().dtype(at::kLong));
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* cp = c.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    const uint32_t c1 = static_cast<uint32_t>(rp[i]);
    for (int64_t j = 0; j < C; ++j) {
      op[i * C + j] = static_cast<int64_t>(philox_word(static_cast<uint32_t>(cp[j]), c1, k0, k1));
    }
  }
  return out;
}

}  // namespace
}  // namespace dflash

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("philox_uint32(Tensor seed, Tensor rows, Tensor cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("philox_uint32", &dflash::philox_uint32);
}
