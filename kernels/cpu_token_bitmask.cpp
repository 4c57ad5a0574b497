// A batch's grammar masks applied in place: each listed row of the logits keeps the tokens its mask
// allows (bit j of word w allows token 32 w + j) and every other token becomes -inf; tokens past the
// mask's width are refused too. Under a grammar most words allow nothing, so a word of zeros fills its
// 32 logits at once and a word of ones leaves them; only mixed words go bit by bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

constexpr float kRefused = -std::numeric_limits<float>::infinity();

void apply_row(float* logits, int64_t vocab, const int32_t* mask, int64_t words) {
  const int64_t covered = std::min(vocab, 32 * words);
  for (int64_t w = 0; 32 * w < covered; ++w) {
    const uint32_t bits = static_cast<uint32_t>(mask[w]);
    const int64_t first = 32 * w, n = std::min<int64_t>(32, covered - first);
    if (bits == 0xFFFFFFFFu) continue;
    float* x = logits + first;
    if (bits == 0) {
      std::fill(x, x + n, kRefused);
      continue;
    }
    for (int64_t j = 0; j < n; ++j)
      if (!((bits >> j) & 1u)) x[j] = kRefused;
  }
  std::fill(logits + covered, logits + vocab, kRefused);
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous (S, V) float32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows: contiguous (R,) int64");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0), "bitmask: contiguous (R, W) int32, a mask per row");
  const int64_t count = rows.size(0), vocab = logits.size(1), words = bitmask.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < logits.size(0), "rows: ", rp[r], " is not a row of the logits");
  float* lp = logits.data_ptr<float>();
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) apply_row(lp + rp[r] * vocab, vocab, mp + r * words, words);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("apply_token_bitmask", apply_token_bitmask); }
