// The greedy token of each row, from its logits screened in bfloat16 and its few contenders rescored in float32.
//
// A row's bfloat16 logit s_v is within e_v = slack * |h| * |w_v| + |s_v| / 256 of its float32 value (the
// inputs' and the product's rounding, bounded by Cauchy-Schwarz, plus the output's own rounding): a token
// whose s_v + e_v falls below the largest s_u - e_u of the row cannot hold the row's largest float32 logit.
// The others (one to a few of SmolLM2's 49,152, measured) are rescored as float32 dot products with the
// dense weight, and the largest wins, the first of equals, as argmax picks. The slack also covers the
// rescoring's own float32 sums, so the token is the argmax of float32 logits over the whole vocabulary.
// A row whose screen or state is not finite is rescored over every token (NaN counts as largest).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kOutputRounding = 1.f / 256;  // bfloat16's unit roundoff is 2^-9: 2^-8 is a margin over it

float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  if (i < n) acc = at::vec::fmadd(Vec::loadu(a + i, n - i), Vec::loadu(b + i, n - i), acc);  // loads zeros past n
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// The first index of the largest exact logit among `tokens`, or of the first NaN.
struct Best {
  int64_t token = -1;
  float logit = -std::numeric_limits<float>::infinity();

  void offer(int64_t v, float logit_v) {
    if (std::isnan(logit)) return;
    if (token < 0 || std::isnan(logit_v) || logit_v > logit) token = v, logit = logit_v;
  }
};

int64_t every_token(const float* h, const float* weight, int64_t vocab, int64_t width) {
  Best best;
  for (int64_t v = 0; v < vocab; ++v) best.offer(v, dot(h, weight + v * width, width));
  return best.token;
}

int64_t screened_row(const at::BFloat16* screen, const float* h, const float* weight, const float* norms,
                     int64_t vocab, int64_t width, float slack) {
  constexpr int64_t W = Vec::size();
  double squares = 0;
  for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(h[i]) * h[i];
  const float scale = static_cast<float>(slack * std::sqrt(squares));
  if (!std::isfinite(scale)) return every_token(h, weight, vocab, width);
  const Vec vscale(scale), vround(kOutputRounding);
  auto bound = [&](const Vec& s, const Vec& norm) { return vscale * norm + vround * s.abs(); };

  // Pass 1: the row's largest lower bound (a NaN screen makes it NaN; an infinite one, NaN or infinite).
  Vec floor_v(-std::numeric_limits<float>::infinity());
  int64_t v = 0;
  for (; v + W <= vocab; v += W) {
    Vec s;
    at::vec::load_to_float(screen + v, s);
    floor_v = at::vec::maximum(floor_v, s - bound(s, Vec::loadu(norms + v)));
  }
  float floor = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, floor_v);
  for (int64_t u = v; u < vocab; ++u) {
    const float s = static_cast<float>(screen[u]);
    const float low = s - (scale * norms[u] + kOutputRounding * std::abs(s));
    floor = std::isnan(low) ? low : std::max(floor, low);
  }
  if (!std::isfinite(floor)) return every_token(h, weight, vocab, width);

  // Pass 2: rescore every token whose upper bound reaches it, in order.
  Best best;
  const Vec vfloor(floor);
  for (v = 0; v + W <= vocab; v += W) {
    Vec s;
    at::vec::load_to_float(screen + v, s);
    const Vec below = (s + bound(s, Vec::loadu(norms + v))) < vfloor;  // lanes ruled out: all ones, else 0
    int reaching = below.zero_mask();                                    // a bit per lane left at 0
    while (reaching) {
      const int lane = __builtin_ctz(reaching);
      reaching &= reaching - 1;
      best.offer(v + lane, dot(h, weight + (v + lane) * width, width));
    }
  }
  for (; v < vocab; ++v) {
    const float s = static_cast<float>(screen[v]);
    if (s + (scale * norms[v] + kOutputRounding * std::abs(s)) >= floor)
      best.offer(v, dot(h, weight + v * width, width));
  }
  return best.token;
}

at::Tensor screened_argmax(const at::Tensor& screen, const at::Tensor& hidden, const at::Tensor& weight,
                           const at::Tensor& norms, double slack) {
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kBFloat16 && screen.is_contiguous(),
              "screen: contiguous (S, V) bfloat16");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(0) == screen.size(0), "hidden: contiguous (S, C) float32, a row per screened row");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == screen.size(1) && weight.size(1) == hidden.size(1),
              "weight: contiguous (V, C) float32");
  TORCH_CHECK(norms.dim() == 1 && norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.size(0) == screen.size(1), "norms: contiguous (V,) float32");
  TORCH_CHECK(screen.size(1) > 0, "an empty vocabulary");
  TORCH_CHECK(slack >= 0 && std::isfinite(slack), "slack: finite, >= 0");
  const int64_t rows = screen.size(0), vocab = screen.size(1), width = hidden.size(1);
  at::Tensor tokens = at::empty({rows}, screen.options().dtype(at::kLong));
  const at::BFloat16* sp = screen.data_ptr<at::BFloat16>();
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      tp[r] = screened_row(sp + r * vocab, hp + r * width, wp, np, vocab, width, static_cast<float>(slack));
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("screened_argmax(Tensor screen, Tensor hidden, Tensor weight, Tensor norms, float slack) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("screened_argmax", screened_argmax); }
