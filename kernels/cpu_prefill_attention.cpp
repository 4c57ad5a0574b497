// Prompt attention on the CPU: causal attention of a chunk of query rows over its sequence's keys, the
// cached prefix's and the chunk's own, in float32.
//
// Bound by arithmetic: a long prompt's scores are most of its attention's work. A task takes one KV head
// and a run of the chunk's query positions, the query heads sharing that KV head folded in as rows, so the
// keys and values are read once for all of them. It goes over the keys the run's last position sees in
// blocks: a block's scores are one matrix product (BLAS), then each row's exponentials over the keys its
// own position sees (the rest zeroed: at most the run's length, where the fused kernel computes whole
// blocks of 512 keys past the diagonal), then the values' weighted sums a second product, added to the
// earlier blocks' once those are rescaled to the new running maximum. Blocks bound a thread's scratch
// whatever the context (at 8,000 and 16,000 keys, blocks of 512 to 4,096 took the same time); a context of
// up to 2,048 keys is one block and needs no rescale. Threads take runs of tasks of about equal work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// BLAS's single-precision product, from the library PyTorch links (MKL in its x86 wheels), declared as
// PyTorch's own CPU BLAS calls declare it (32-bit sizes). Weak: where no library provides it, the op says
// so and the caller keeps PyTorch's own fused attention.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kTaskRows = 96;     // query rows (positions times the heads sharing a KV head) a task takes
constexpr int64_t kBlockKeys = 2048;  // keys a block's scores cover: 768 KB of them at 96 rows

// Row-major c (m x n) = a (m x k) times b (n x k) transposed, or times b (k x n), plus c times beta.
// BLAS is column-major: c transposed = b's side times a transposed.
void product(bool b_transposed, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
             float* c, int ldc) {
  const float one = 1.f;
  sgemm_(b_transposed ? "T" : "N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

float largest(const float* x, int64_t n) {
  const int64_t lanes = Vec::size();
  Vec top_lanes(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) top_lanes = at::vec::maximum(top_lanes, Vec::loadu(x + i));
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top_lanes);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// x[0:seen] becomes e^(x - top), x[seen:width] zeros; returns the exponentials' sum.
float exponentials(float* x, int64_t seen, int64_t width, float top) {
  const int64_t lanes = Vec::size();
  const Vec shift(top);
  Vec sum_lanes(0.f);
  int64_t i = 0;
  for (; i + lanes <= seen; i += lanes) {
    const Vec e = (Vec::loadu(x + i) - shift).exp_u20();
    e.store(x + i);
    sum_lanes = sum_lanes + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum_lanes);
  for (; i < seen; ++i) {
    x[i] = std::exp(x[i] - top);
    sum += x[i];
  }
  std::fill(x + seen, x + width, 0.f);
  return sum;
}

// One task's rows: its queries (scaled), running maxima and sums, weighted sums, and a block's scores.
struct Rows {
  std::vector<float> queries, outs, tops, sums, scores;
  Rows(int64_t rows, int64_t head_dim, int64_t keys)
      : queries(rows * head_dim), outs(rows * head_dim), tops(rows), sums(rows), scores(rows * keys) {}
};

struct Task {
  int64_t sequence, kv_head, first, last;  // the sequence's query positions first:last of the chunk
};

// Where each thread's run of tasks starts: a task belongs to the thread its work's middle falls to.
std::vector<size_t> shares_of(const std::vector<Task>& tasks, int64_t prefix, int64_t threads) {
  std::vector<int64_t> midpoints(tasks.size());
  int64_t before = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const int64_t work = (tasks[t].last - tasks[t].first) * (prefix + tasks[t].last);
    midpoints[t] = 2 * before + work;
    before += work;
  }
  std::vector<size_t> starts(threads + 1);
  for (int64_t s = 0; s <= threads; ++s)
    starts[s] = std::lower_bound(midpoints.begin(), midpoints.end(), 2 * before * s / threads) - midpoints.begin();
  starts[threads] = tasks.size();
  return starts;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(sgemm_ != nullptr, "prefill_attention: no BLAS sgemm_ in this PyTorch");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1 && q.stride(2) == q.size(3),
              "q: (n, L, Hq, D) float32, each position's heads contiguous");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.stride(3) == 1 && v.stride(3) == 1 &&
                  k.stride(2) == k.size(3) && v.stride(2) == v.size(3),
              "k, v: alike (n, C, Hkv, D) float32, each position's heads contiguous");
  const int64_t n = q.size(0), length = q.size(1), num_q_heads = q.size(2), head_dim = q.size(3);
  const int64_t context = k.size(1), num_kv_heads = k.size(2);
  TORCH_CHECK(k.size(0) == n && k.size(3) == head_dim && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 &&
                  context >= length,
              "k, v: (n, C >= L, Hkv, D) with Hkv dividing q's heads");
  at::Tensor out = at::empty({n, length, num_q_heads, head_dim}, q.options());
  if (out.numel() == 0) return out;
  const int64_t group = num_q_heads / num_kv_heads, prefix = context - length;
  const int64_t positions = std::max<int64_t>(1, kTaskRows / group);  // a task's query positions

  std::vector<Task> tasks;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < length; i += positions) tasks.push_back({s, h, i, std::min(length, i + positions)});
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks.size());
  const std::vector<size_t> starts = shares_of(tasks, prefix, threads);

  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t last_share) {
    Rows held(positions * group, head_dim, std::min(context, kBlockKeys));
    for (size_t t = starts[first_share]; t < starts[last_share]; ++t) {
      const Task& task = tasks[t];
      const int64_t rows = (task.last - task.first) * group, width = prefix + task.last;
      // Row (p, g): position first + p, the KV head's query head g, scaled once here.
      for (int64_t p = task.first; p < task.last; ++p) {
        const float* src = qp + task.sequence * q.stride(0) + p * q.stride(1) + task.kv_head * group * head_dim;
        float* dst = held.queries.data() + (p - task.first) * group * head_dim;
        for (int64_t i = 0; i < group * head_dim; ++i) dst[i] = src[i] * s;
      }
      std::fill_n(held.tops.begin(), rows, -std::numeric_limits<float>::infinity());
      std::fill_n(held.sums.begin(), rows, 0.f);
      const float* keys = kp + task.sequence * k.stride(0) + task.kv_head * head_dim;
      const float* values = vp + task.sequence * v.stride(0) + task.kv_head * head_dim;
      for (int64_t first_key = 0; first_key < width; first_key += kBlockKeys) {
        const int64_t n = std::min(kBlockKeys, width - first_key);
        product(true, rows, n, head_dim, held.queries.data(), head_dim, keys + first_key * k.stride(1), k.stride(1),
                0.f, held.scores.data(), n);
        for (int64_t r = 0; r < rows; ++r) {
          float* x = held.scores.data() + r * n;
          const int64_t seen = std::clamp<int64_t>(prefix + task.first + r / group + 1 - first_key, 0, n);
          const float top = std::max(held.tops[r], largest(x, seen));
          const float rescale = std::exp(held.tops[r] - top);  // 0 at the first block, 1 where nothing is seen
          held.sums[r] = held.sums[r] * rescale + exponentials(x, seen, n, top);
          held.tops[r] = top;
          if (first_key > 0 && rescale != 1.f)
            for (int64_t d = 0; d < head_dim; ++d) held.outs[r * head_dim + d] *= rescale;
        }
        product(false, rows, head_dim, n, held.scores.data(), n, values + first_key * v.stride(1), v.stride(1),
                first_key > 0 ? 1.f : 0.f, held.outs.data(), head_dim);
      }
      for (int64_t p = task.first; p < task.last; ++p) {
        float* dst = op + ((task.sequence * length + p) * num_q_heads + task.kv_head * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = (p - task.first) * group + g;
          const float inverse_sum = 1.f / held.sums[r];
          for (int64_t d = 0; d < head_dim; ++d) dst[g * head_dim + d] = held.outs[r * head_dim + d] * inverse_sum;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("cpu_prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("cpu_prefill_attention", prefill_attention); }
