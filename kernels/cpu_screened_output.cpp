// Each row's token from its logits screened in bfloat16, with float32 only where the screen cannot decide.
//
// A row's bfloat16 logit s_v is within e_v = slack * |h| * |w_v| + |s_v| / 256 of its float32 value x_v (the
// inputs' and the product's rounding, bounded by Cauchy-Schwarz, plus the output's own rounding). The slack
// also covers the rescoring's own float32 sums (x_v below: a dot product with the dense weight).
//
// A greedy row (temperature 0): a token whose s_v + e_v falls below the largest s_u - e_u of the row cannot
// hold the row's largest float32 logit. The others (one to a few of SmolLM2's 49,152, measured) are
// rescored, and the largest wins, the first of equals, as argmax picks: the argmax of float32 logits over
// the whole vocabulary. A row whose screen or state is not finite is rescored over every token (NaN counts
// as largest).
//
// A sampled row (temperature T, its logits untouched) draws from softmax(x / T) by rejection: proposals
// come from the envelope g_v = exp(x_v / T) for the tokens rescored in float32, exp((s_v + e_v) / T) >= the
// same for the others, by inverse transform (as cpu_inverse_cdf.cpp draws); a proposed token is kept with
// probability exp(x_v / T) / g_v, else the row proposes again. A kept token is v with probability exactly
// exp(x_v / T) / sum_u exp(x_u / T). Rescored are the tokens whose upper bound reaches within window * T of
// the row's greedy floor (the largest s_u - e_u), up to most_rescored of them: they hold most of a peaked
// row's weight, so few proposals are refused. A row that refuses every proposal it has numbers for, or is not
// finite, gets -1: its caller draws it from every float32 logit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kOutputRounding = 1.f / 256;  // bfloat16's unit roundoff is 2^-9: 2^-8 is a margin over it
constexpr int64_t kBlock = 64;
float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  if (i < n) acc = at::vec::fmadd(Vec::loadu(a + i, n - i), Vec::loadu(b + i, n - i), acc);  // loads zeros past n
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

float sum(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x, n);
}

// One row's screen, its state and the bounds on its float32 logits.
struct Row {
  const at::BFloat16* screen;
  const float* h;
  const float* weight;
  const float* norms;
  int64_t vocab, width;
  float scale;  // slack * |h|

  float exact(int64_t v) const { return dot(h, weight + v * width, width); }
  float bound(float s, float norm) const { return scale * norm + kOutputRounding * std::abs(s); }
  Vec bound(const Vec& s, const Vec& norm) const { return Vec(scale) * norm + Vec(kOutputRounding) * s.abs(); }
  float upper(int64_t v) const {
    const float s = static_cast<float>(screen[v]);
    return s + bound(s, norms[v]);
  }

  // The largest lower bound: no token's float32 logit is below it but the best's may equal it. NaN where
  // the screen holds one; infinite or NaN where it holds an infinity.
  float floor() const {
    constexpr int64_t W = Vec::size();
    Vec floor_v(-std::numeric_limits<float>::infinity());
    int64_t v = 0;
    for (; v + W <= vocab; v += W) {
      Vec s;
      at::vec::load_to_float(screen + v, s);
      floor_v = at::vec::maximum(floor_v, s - bound(s, Vec::loadu(norms + v)));
    }
    float low = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, floor_v);
    for (; v < vocab; ++v) {
      const float s = static_cast<float>(screen[v]);
      const float low_v = s - bound(s, norms[v]);
      low = std::isnan(low_v) ? low_v : std::max(low, low_v);
    }
    return low;
  }

  // Calls reach(v) for every token whose upper bound is at least `level`, in order.
  template <typename F>
  void reaching(float level, F&& reach) const {
    constexpr int64_t W = Vec::size();
    const Vec vlevel(level);
    int64_t v = 0;
    for (; v + W <= vocab; v += W) {
      Vec s;
      at::vec::load_to_float(screen + v, s);
      const Vec below = (s + bound(s, Vec::loadu(norms + v))) < vlevel;  // lanes ruled out: all ones, else 0
      int lanes = below.zero_mask();                                      // a bit per lane left at 0
      while (lanes) {
        reach(v + __builtin_ctz(lanes));
        lanes &= lanes - 1;
      }
    }
    for (; v < vocab; ++v)
      if (upper(v) >= level) reach(v);
  }
};

// The first index of the largest exact logit offered, or of the first NaN.
struct Best {
  int64_t token = -1;
  float logit = -std::numeric_limits<float>::infinity();

  void offer(int64_t v, float logit_v) {
    if (std::isnan(logit)) return;
    if (token < 0 || std::isnan(logit_v) || logit_v > logit) token = v, logit = logit_v;
  }
};

int64_t greedy_token(const Row& row) {
  Best best;
  const float floor = std::isfinite(row.scale) ? row.floor() : NAN;
  if (!std::isfinite(floor)) {
    for (int64_t v = 0; v < row.vocab; ++v) best.offer(v, row.exact(v));
    return best.token;
  }
  row.reaching(floor, [&](int64_t v) { best.offer(v, row.exact(v)); });
  return best.token;
}

// The envelope a sampled row proposes from: exp((x_v - top) / T) for the rescored tokens, exp((upper_v - top) / T)
// for the others, where top is the largest of those exponents' logits (so the total is about 1 or more).
struct Envelope {
  const Row& row;
  float inverse;  // 1 / T
  std::vector<int64_t> tokens;  // rescored, in order
  std::vector<float> logits;   // their float32 logits
  float top = -std::numeric_limits<float>::infinity();
  std::vector<float> blocks;  // each block's float32 sum of weights

  Envelope(const Row& row, float inverse, float floor, float window, size_t most_rescored)
      : row(row), inverse(inverse) {
    row.reaching(floor - window / inverse, [&](int64_t v) {
      if (tokens.size() < most_rescored) {
        tokens.push_back(v);
        logits.push_back(row.exact(v));
        top = std::max(top, logits.back());  // NaN leaves top as it is: caught by `finite`
      } else {
        top = std::max(top, row.upper(v));  // every token left out of the window is below the floor
      }
    });
  }

  bool finite() const {
    return std::isfinite(top) && std::all_of(logits.begin(), logits.end(), [](float x) { return !std::isnan(x); });
  }

  // The weights of block b into out (rescored tokens patched in from `next`, the first rescored token
  // not before the block); returns how many tokens the block holds.
  int64_t block(int64_t b, size_t& next, float* out) const {
    constexpr int64_t W = Vec::size();
    const int64_t first = b * kBlock, n = std::min(kBlock, row.vocab - first);
    const Vec vtop(top), vinverse(inverse);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(row.screen[first + i]);
    for (int64_t i = 0; i < n; i += W) {
      const int64_t count = std::min(W, n - i);
      const Vec s = Vec::loadu(out + i, count);
      const Vec upper = s + row.bound(s, Vec::loadu(row.norms + first + i, count));
      ((upper - vtop) * vinverse).exp().store(out + i, count);
    }
    for (; next < tokens.size() && tokens[next] < first + n; ++next)
      out[tokens[next] - first] = std::exp((logits[next] - top) * inverse);
    return n;
  }

  double total() {
    float weights[kBlock];
    size_t next = 0;
    double all = 0;
    blocks.resize((row.vocab + kBlock - 1) / kBlock);
    for (size_t b = 0; b < blocks.size(); ++b) all += blocks[b] = sum(weights, block(b, next, weights));
    return all;
  }

  // The token whose share of the running weight holds target (in [0, total)); -1 where rounding
  // leaves the target past every block's sum.
  int64_t walk(double target) const {
    double running = 0;
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (running + blocks[b] <= target) {
        running += blocks[b];
        continue;
      }
      float weights[kBlock];
      size_t next = std::lower_bound(tokens.begin(), tokens.end(), static_cast<int64_t>(b) * kBlock) - tokens.begin();
      const int64_t n = block(b, next, weights);
      int64_t last_weighted = -1;
      for (int64_t i = 0; i < n; ++i) {
        if ((running += weights[i]) > target) return b * kBlock + i;  // the sum rose here: a positive weight
        if (weights[i] > 0.f) last_weighted = b * kBlock + i;
      }
      return last_weighted;  // the walk's own rounding fell short of the block's sum
    }
    return -1;
  }

  // Probability of keeping proposed token v: 1 where it was rescored, exp((x_v - upper_v) / T) elsewhere.
  double keep(int64_t v) const {
    if (std::binary_search(tokens.begin(), tokens.end(), v)) return 1;
    return std::exp(static_cast<double>(row.exact(v) - row.upper(v)) * inverse);
  }
};

struct Draws {
  float window;
  size_t most_rescored;
  int64_t attempts;
};

// drawn holds two numbers in [0, 1) an attempt: the proposal's, then the keeping's.
int64_t sampled_token(const Row& row, float inverse, const double* drawn, const Draws& draws) {
  const float floor = std::isfinite(row.scale) ? row.floor() : NAN;
  if (!std::isfinite(floor)) return -1;
  Envelope envelope(row, inverse, floor, draws.window, draws.most_rescored);
  if (!envelope.finite()) return -1;
  const double total = envelope.total();
  if (!(total > 0) || !std::isfinite(total)) return -1;
  for (int64_t a = 0; a < draws.attempts; ++a) {
    const int64_t v = envelope.walk(drawn[2 * a] * total);
    if (v >= 0 && drawn[2 * a + 1] < envelope.keep(v)) return v;
  }
  return -1;
}

at::Tensor screened_tokens(const at::Tensor& screen, const at::Tensor& hidden, const at::Tensor& weight,
                           const at::Tensor& norms, double slack, const at::Tensor& temperature,
                           const at::Tensor& drawn, double window, int64_t most_rescored) {
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kBFloat16 && screen.is_contiguous(),
              "screen: contiguous (S, V) bfloat16");
  const int64_t rows = screen.size(0), vocab = screen.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(0) == rows, "hidden: contiguous (S, C) float32, a row per screened row");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == vocab && weight.size(1) == hidden.size(1),
              "weight: contiguous (V, C) float32");
  TORCH_CHECK(norms.dim() == 1 && norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.size(0) == vocab, "norms: contiguous (V,) float32");
  TORCH_CHECK(vocab > 0, "an empty vocabulary");
  TORCH_CHECK(slack >= 0 && std::isfinite(slack), "slack: finite, >= 0");
  TORCH_CHECK(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.size(0) == rows, "temperature: contiguous (S,) float32, 0 for a greedy row");
  TORCH_CHECK(drawn.dim() == 2 && drawn.scalar_type() == at::kDouble && drawn.is_contiguous() &&
                  drawn.size(0) == rows && drawn.size(1) % 2 == 0,
              "drawn: contiguous (S, 2 * attempts) float64, two numbers an attempt");
  TORCH_CHECK(window >= 0 && std::isfinite(window), "window: finite, >= 0");
  TORCH_CHECK(most_rescored >= 0, "most_rescored: >= 0");
  const float* tp = temperature.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && std::isfinite(tp[r]), "temperature: finite, >= 0");
  const int64_t width = hidden.size(1);
  const Draws draws{static_cast<float>(window), static_cast<size_t>(most_rescored), drawn.size(1) / 2};
  at::Tensor tokens = at::empty({rows}, screen.options().dtype(at::kLong));
  const at::BFloat16* sp = screen.data_ptr<at::BFloat16>();
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const double* dp = drawn.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* h = hp + r * width;
      double squares = 0;
      for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(h[i]) * h[i];
      const Row row{sp + r * vocab, h, wp, np, vocab, width, static_cast<float>(slack * std::sqrt(squares))};
      const float inverse = std::min(1.f / tp[r], std::numeric_limits<float>::max());
      out[r] = tp[r] == 0 ? greedy_token(row) : sampled_token(row, inverse, dp + r * drawn.size(1), draws);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("screened_tokens(Tensor screen, Tensor hidden, Tensor weight, Tensor norms, float slack, "
        "Tensor temperature, Tensor drawn, float window, int most_rescored) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("screened_tokens", screened_tokens); }
