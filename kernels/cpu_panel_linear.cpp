// Float32 projections x W^T on the CPU over a weight laid out once in panels of columns.
//
// A panel holds NR of W's rows (the product's columns) for every input, input by input: (K, NR),
// contiguous, the panels one after the other. A tile of MR rows of x by a panel's NR columns keeps its
// sums in registers (MR x 3 vectors), each input adding one broadcast of x times the panel's three
// vectors there. A thread walks its share of the panels in order, every row block over each panel, so
// the weights stream from memory once a call; while it works on a panel it asks for the next one a few
// cache lines at a time, spread over the panel's work, so that its reads from memory overlap the
// arithmetic instead of waiting between panels, as oneDNN's packed products were measured to (a
// SmolLM2 layer's four products at 64 rows took 0.82 of oneDNN's time, 2-core Zen 4).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>

namespace {

// The registers, raw: held in at::vec's class, the sums went to the stack between steps.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg broadcast(float v) { return _mm512_set1_ps(v); }
inline Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg broadcast(float v) { return _mm256_set1_ps(v); }
inline Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "the panel projection needs AVX2 or AVX-512"
#endif

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
static_assert(sizeof(Reg) == kVec * sizeof(float), "at::vec's width is the registers'");
constexpr int64_t NR = 3 * kVec;                 // a panel's columns: three vectors
constexpr int MR = kVec >= 16 ? 8 : 4;           // a tile's rows: MR x 3 sums fill most of the registers
constexpr int64_t kUnroll = 8;                   // inputs a step; each step asks for a few lines ahead
constexpr int64_t kLine = 64;

// (N, K) -> (ceil(N / NR), K, NR), the last panel's missing columns zero.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight: a (N, K) float32 CPU tensor");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight: at least one row and one input");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + NR - 1) / NR;
  at::Tensor padded = at::zeros({panels * NR, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, NR, k}).transpose(1, 2).contiguous();
}

// The prefetch schedule over one panel's work: `per_step` lines of the next panel at each step.
struct Ahead {
  const char* next = nullptr;  // the next panel, or none
  int64_t lines = 0;           // its cache lines
  int64_t per_step = 0;
};

// c[0:rows, 0:cols] (+)= a[0:rows, :] . panel, rows <= MR. With `ahead`, this block's steps ask for
// the next panel's lines from `first_line` on.
template <int ROWS>
void tile(const float* a, int64_t lda, const float* panel, int64_t k, float* c, int64_t ldc, int64_t cols,
          const float* bias, const Ahead& ahead, int64_t first_line) {
  Reg sum[ROWS][3];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < 3; ++j) sum[i][j] = broadcast(0.0f);
  const char* line = ahead.next ? ahead.next + first_line * kLine : nullptr;
  const char* last = ahead.next ? ahead.next + ahead.lines * kLine : nullptr;
  int64_t step = 0;
  for (; step + kUnroll <= k; step += kUnroll) {
    for (int64_t p = 0; p < ahead.per_step && line < last; ++p, line += kLine) __builtin_prefetch(line, 0, 2);
#pragma GCC unroll 8
    for (int64_t u = 0; u < kUnroll; ++u) {
      const float* w = panel + (step + u) * NR;
      const Reg w0 = load(w), w1 = load(w + kVec), w2 = load(w + 2 * kVec);
#pragma GCC unroll 8
      for (int i = 0; i < ROWS; ++i) {
        const Reg x = broadcast(a[i * lda + step + u]);
        sum[i][0] = fmadd(x, w0, sum[i][0]);
        sum[i][1] = fmadd(x, w1, sum[i][1]);
        sum[i][2] = fmadd(x, w2, sum[i][2]);
      }
    }
  }
  for (; step < k; ++step) {
    const float* w = panel + step * NR;
    const Reg w0 = load(w), w1 = load(w + kVec), w2 = load(w + 2 * kVec);
    for (int i = 0; i < ROWS; ++i) {
      const Reg x = broadcast(a[i * lda + step]);
      sum[i][0] = fmadd(x, w0, sum[i][0]);
      sum[i][1] = fmadd(x, w1, sum[i][1]);
      sum[i][2] = fmadd(x, w2, sum[i][2]);
    }
  }
  std::array<float, NR> b{};
  if (bias != nullptr) std::copy(bias, bias + cols, b.begin());
  for (int i = 0; i < ROWS; ++i) {
    float* row = c + i * ldc;
    for (int j = 0; j < 3; ++j) {
      const Vec out = Vec(sum[i][j]) + Vec::loadu(b.data() + j * kVec);
      const int64_t left = cols - j * kVec;
      if (left >= kVec) out.store(row + j * kVec);
      else if (left > 0) out.store(row + j * kVec, left);
    }
  }
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                      const Ahead&, int64_t);

template <int... R>
constexpr std::array<Tile, sizeof...(R) + 1> tiles(std::integer_sequence<int, R...>) {
  return {nullptr, &tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, MR>{});

// x (..., K) times the weight packed by pack_panels from (N, K), plus bias (N) if given -> (..., N).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x: a float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "panels: (P, K, ", NR, ") float32, contiguous, from pack_panels");
  const int64_t k = panels.size(1), count = panels.size(0);
  TORCH_CHECK(k > 0 && count > 0, "panels: at least one panel of one input");
  TORCH_CHECK(x.size(-1) == k, "x: ", k, " inputs a row");
  TORCH_CHECK(n > (count - 1) * NR && n <= count * NR, "n: ", n, " does not fit ", count, " panels");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "bias: ", n, " contiguous float32 values");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const at::Tensor a2 = x.reshape({-1, k}).contiguous();
  const int64_t m = a2.size(0);
  if (m == 0) return out;
  const float* a = a2.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* c = out.data_ptr<float>();
  const int64_t blocks = (m + MR - 1) / MR;
  const int64_t lines = k * NR * static_cast<int64_t>(sizeof(float)) / kLine;
  const int64_t steps = std::max<int64_t>(1, k / kUnroll);  // prefetching steps a row block
  const int64_t per_step = (lines + blocks * steps - 1) / (blocks * steps);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = w + p * k * NR;
      const Ahead ahead{p + 1 < end ? reinterpret_cast<const char*>(panel + k * NR) : nullptr, lines, per_step};
      const int64_t cols = std::min(NR, n - p * NR);
      for (int64_t r = 0; r < blocks; ++r) {
        const int64_t rows = std::min<int64_t>(MR, m - r * MR);
        kTiles[rows](a + r * MR * k, k, panel, k, c + r * MR * n + p * NR, n, cols, b ? b + p * NR : nullptr,
                     ahead, r * steps * per_step);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) {
  m.impl("pack_panels", pack_panels);
  m.impl("panel_linear", panel_linear);
}
