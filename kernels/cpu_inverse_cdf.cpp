// Each row's token sampled at its temperature by inverse transform: with weights w_v = exp((l_v - max) / T),
// the token whose share of the row's running weight holds the row's draw in [0, 1), so token v with
// probability softmax(l / T)_v, and a token of logit -inf never. Nothing is written but the token.
//
// The running sums go block by block: a block's weights are summed in float32 vectors, the blocks' sums
// in float64, the same way in both passes (the total, then the walk to the draw), so the walk finds the
// block the total promised; within it, a float64 walk token by token over the same weights. Where
// rounding leaves a draw past every sum, or the row is not finite, the row's last token of positive
// weight (else its last token): a token in range, whatever the row holds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 64;

struct Row {
  const float* logits;
  int64_t vocab;
  float max;
  float scale;  // 1 / T

  // The weights of tokens [first, first + n), n <= kBlock, into out; returns their float32 sum.
  float block(int64_t first, int64_t n, float* out) const {
    constexpr int64_t W = Vec::size();
    const Vec vmax(max), vscale(scale);
    Vec acc(0.f);
    for (int64_t i = 0; i < n; i += W) {
      const int64_t count = std::min(W, n - i);
      const Vec w = ((Vec::loadu(logits + first + i, count) - vmax) * vscale).exp();
      const Vec kept = Vec::set(Vec(0.f), w, count);  // lanes past n count nothing
      kept.store(out + i, count);
      acc = acc + kept;
    }
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  }
};

float row_max(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec acc(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = at::vec::maximum(acc, Vec::loadu(x + i));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  for (; i < n; ++i) m = std::isnan(x[i]) ? x[i] : std::max(m, x[i]);
  return m;
}

int64_t row_token(const Row& row, double drawn) {
  float weights[kBlock];
  double total = 0;
  for (int64_t b = 0; b < row.vocab; b += kBlock) total += row.block(b, std::min(kBlock, row.vocab - b), weights);
  const double target = drawn * total;
  double running = 0;
  int64_t last_weighted = row.vocab - 1;
  bool seen = false;
  for (int64_t b = 0; b < row.vocab; b += kBlock) {
    const int64_t n = std::min(kBlock, row.vocab - b);
    const double block = row.block(b, n, weights);
    if (running + block > target) {  // the draw falls in this block
      for (int64_t i = 0; i < n; ++i) {
        running += weights[i];
        if (running > target) return b + i;  // the sum rose here: a positive weight
        if (weights[i] > 0.f) last_weighted = b + i, seen = true;
      }
      return last_weighted;  // the walk's own rounding fell short of the block's sum
    }
    running += block;
    for (int64_t i = n - 1; i >= 0 && block > 0; --i)
      if (weights[i] > 0.f) { last_weighted = b + i, seen = true; break; }
  }
  return seen ? last_weighted : row.vocab - 1;
}

at::Tensor inverse_cdf(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& drawn) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous (N, V) float32");
  TORCH_CHECK(logits.size(1) > 0, "an empty vocabulary");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(inv_temperature.dim() == 1 && inv_temperature.scalar_type() == at::kFloat &&
                  inv_temperature.is_contiguous() && inv_temperature.size(0) == rows,
              "inv_temperature: contiguous (N,) float32, a number per row");
  TORCH_CHECK(drawn.dim() == 1 && drawn.scalar_type() == at::kDouble && drawn.is_contiguous() &&
                  drawn.size(0) == rows, "drawn: contiguous (N,) float64, a number per row");
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* sp = inv_temperature.data_ptr<float>();
  const double* dp = drawn.data_ptr<double>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* x = lp + r * vocab;
      tp[r] = row_token(Row{x, vocab, row_max(x, vocab), sp[r]}, dp[r]);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("inverse_cdf(Tensor logits, Tensor inv_temperature, Tensor drawn) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("inverse_cdf", inverse_cdf); }
