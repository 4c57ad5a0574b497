// Prompt attention on the CPU: causal attention of a chunk of query rows over its sequence's keys, the
// cached prefix's and the chunk's own, in float32.
//
// Bound by arithmetic: a long prompt's scores are most of its attention's work. A task takes one KV head
// and a run of the chunk's query positions, the query heads sharing that KV head folded in as rows, so the
// keys and values are read once for all of them. Rows lie along the vector lanes (queries, scores and
// weighted sums are held transposed), so each key's score for a tile of rows is a vector, built in
// registers from the key's elements broadcast one by one: no key or value is ever copied or transposed,
// and the softmax's running maxima, sums and rescaling are lane-wise. The keys are taken in blocks: a
// block's scores (tiles of keys by rows), then each row's exponentials over the keys its own position
// sees (the rest zeroed), then the values' weighted sums (tiles of head dims by rows), added to the
// earlier blocks' once those are rescaled to the new running maximum. This replaced two BLAS products a
// block, whose packing of keys, values and scores took a quarter of the kernel's time (`perf`, one thread,
// SmolLM2's heads, 2-core Zen 4); against them it takes 0.82-0.84 of the time there, and about theirs on a
// 2-core Zen 3's AVX2 (docs/cpu-performance.md).
// Threads take runs of tasks of about equal work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// Tiles held in registers: 32 vector registers with AVX-512, 16 with AVX2 (NEON's 32 run the latter), and
// the keys a block's scores cover. Each was the fastest of those timed side by side: on a 2-core Zen 4 for
// AVX-512 (blocks of 256 or 1,024 keys 1-8 % slower); on a 2-core Zen 3 for AVX2, where a block's scores
// held in the first-level cache took 0.83-0.92 of the time that 512 keys in 2 x 6 tiles did
// (docs/cpu-performance.md).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRowVectors = 3;        // a tile's rows: 48
constexpr int kKeysAtOnce = 8;        // a scores tile: 8 keys x 3 row vectors = 24 sums
constexpr int kDimsAtOnce = 8;        // a values tile: 8 head dims x 3 row vectors
constexpr int64_t kBlockKeys = 512;   // 96 KB of scores at 48 rows, in the second-level cache
#else
constexpr int kRowVectors = 3;        // 24 rows with AVX2
constexpr int kKeysAtOnce = 4;        // 12 sums, 3 row vectors of queries and a key's element: 16 registers
constexpr int kDimsAtOnce = 4;
constexpr int64_t kBlockKeys = 128;   // 24 KB of scores at 48 rows, in the first-level cache
#endif
constexpr int64_t kTileRows = kRowVectors * kLanes;  // a task's rows are padded to whole tiles
constexpr int64_t kTaskRows = 48;                     // query rows (positions times the heads sharing a KV head)

// sT[j][r] = sum_d keys[j][d] * qT[d][r], for KEYS keys and one tile of rows.
template <int KEYS>
inline void scores_tile(const float* qT, int64_t padded, const float* keys, int64_t key_stride, int64_t head_dim,
                        float* sT) {
  Vec sums[KEYS][kRowVectors];
  for (int k = 0; k < KEYS; ++k)
    for (int v = 0; v < kRowVectors; ++v) sums[k][v] = Vec(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec queries[kRowVectors];
    for (int v = 0; v < kRowVectors; ++v) queries[v] = Vec::loadu(qT + d * padded + v * kLanes);
    for (int k = 0; k < KEYS; ++k) {
      const Vec element(keys[k * key_stride + d]);
      for (int v = 0; v < kRowVectors; ++v) sums[k][v] = at::vec::fmadd(element, queries[v], sums[k][v]);
    }
  }
  for (int k = 0; k < KEYS; ++k)
    for (int v = 0; v < kRowVectors; ++v) sums[k][v].store(sT + k * padded + v * kLanes);
}

// oT[d][r] += sum_j values[j][d] * pT[j][r] over n keys, for DIMS head dims and one tile of rows.
template <int DIMS>
inline void values_tile(const float* pT, int64_t padded, int64_t n, const float* values, int64_t value_stride,
                        float* oT) {
  Vec sums[DIMS][kRowVectors];
  for (int t = 0; t < DIMS; ++t)
    for (int v = 0; v < kRowVectors; ++v) sums[t][v] = Vec::loadu(oT + t * padded + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    Vec weights[kRowVectors];
    for (int v = 0; v < kRowVectors; ++v) weights[v] = Vec::loadu(pT + j * padded + v * kLanes);
    const float* value = values + j * value_stride;
    for (int t = 0; t < DIMS; ++t) {
      const Vec element(value[t]);
      for (int v = 0; v < kRowVectors; ++v) sums[t][v] = at::vec::fmadd(element, weights[v], sums[t][v]);
    }
  }
  for (int t = 0; t < DIMS; ++t)
    for (int v = 0; v < kRowVectors; ++v) sums[t][v].store(oT + t * padded + v * kLanes);
}

// body(size, i) over [0, n) in steps of SIZE (a compile-time constant, so a tile's sums stay in
// registers), what is left in steps of 4, 2 and 1.
template <int SIZE, typename Body>
void in_tiles(int64_t n, const Body& body) {
  int64_t i = 0;
  for (; i + SIZE <= n; i += SIZE) body(std::integral_constant<int, SIZE>{}, i);
  if constexpr (SIZE > 4)
    for (; i + 4 <= n; i += 4) body(std::integral_constant<int, 4>{}, i);
  if constexpr (SIZE > 2)
    for (; i + 2 <= n; i += 2) body(std::integral_constant<int, 2>{}, i);
  for (; i < n; ++i) body(std::integral_constant<int, 1>{}, i);
}

// One task's rows, transposed: queries (scaled), weighted sums and a block's scores, each row a lane; its
// running maxima and sums; and how many keys each row sees.
struct Rows {
  std::vector<float> qT, oT, sT, tops, sums, seen;
  Rows(int64_t padded, int64_t head_dim)
      : qT(head_dim * padded), oT(head_dim * padded), sT(kBlockKeys * padded), tops(padded), sums(padded),
        seen(padded) {}
};

// A block's scores become e^(score - running maximum), zero past what a row sees; the running maxima and
// sums and the weighted sums so far move to the new maxima. Keys from `diagonal` on are not seen by every row.
void softmax_block(Rows& held, int64_t padded, int64_t head_dim, int64_t first_key, int64_t n, int64_t diagonal) {
  const Vec minus_inf(-std::numeric_limits<float>::infinity());
  float* sT = held.sT.data();
  for (int64_t r = 0; r < padded; r += kLanes) {
    const Vec seen = Vec::loadu(held.seen.data() + r);
    const auto sees = [&](int64_t j) { return Vec(static_cast<float>(first_key + j)) < seen; };  // lanes seeing key j
    const Vec before = Vec::loadu(held.tops.data() + r);
    Vec top = before;
    for (int64_t j = 0; j < n; ++j) {
      const Vec x = Vec::loadu(sT + j * padded + r);
      top = at::vec::maximum(top, first_key + j < diagonal ? x : Vec::blendv(minus_inf, x, sees(j)));
    }
    // At the first block nothing is held yet (and e^(-inf - top) is not asked for).
    const Vec rescale = first_key > 0 ? (before - top).exp_u20() : Vec(0.f);
    Vec sum = first_key > 0 ? Vec::loadu(held.sums.data() + r) * rescale : Vec(0.f);
    for (int64_t j = 0; j < n; ++j) {
      Vec e = (Vec::loadu(sT + j * padded + r) - top).exp_u20();
      if (first_key + j >= diagonal) e = Vec::blendv(Vec(0.f), e, sees(j));
      e.store(sT + j * padded + r);
      sum = sum + e;
    }
    sum.store(held.sums.data() + r);
    top.store(held.tops.data() + r);
    if (first_key > 0)
      for (int64_t d = 0; d < head_dim; ++d) {
        float* o = held.oT.data() + d * padded + r;
        (Vec::loadu(o) * rescale).store(o);
      }
  }
}

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
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2) && !defined(__aarch64__)
  TORCH_CHECK(false, "prefill_attention: built without vector instructions, where PyTorch's fused attention is faster");
#endif
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
  const int64_t most_padded = (positions * group + kTileRows - 1) / kTileRows * kTileRows;

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
    Rows held(most_padded, head_dim);
    for (size_t t = starts[first_share]; t < starts[last_share]; ++t) {
      const Task& task = tasks[t];
      const int64_t rows = (task.last - task.first) * group, width = prefix + task.last;
      const int64_t padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
      // Row r: position first + r / group, the KV head's query head r % group. Padding rows (zero queries)
      // see every key, so that theirs are plain numbers too; they are not written out.
      std::fill_n(held.qT.begin(), head_dim * padded, 0.f);
      std::fill_n(held.oT.begin(), head_dim * padded, 0.f);
      std::fill_n(held.tops.begin(), padded, -std::numeric_limits<float>::infinity());
      for (int64_t r = 0; r < padded; ++r)
        held.seen[r] = static_cast<float>(r < rows ? prefix + task.first + r / group + 1 : width);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = qp + task.sequence * q.stride(0) + (task.first + r / group) * q.stride(1) +
                           (task.kv_head * group + r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) held.qT[d * padded + r] = src[d] * s;
      }
      const float* keys = kp + task.sequence * k.stride(0) + task.kv_head * head_dim;
      const float* values = vp + task.sequence * v.stride(0) + task.kv_head * head_dim;
      for (int64_t first_key = 0; first_key < width; first_key += kBlockKeys) {
        const int64_t count = std::min(kBlockKeys, width - first_key);
        const float* block_keys = keys + first_key * k.stride(1);
        in_tiles<kKeysAtOnce>(count, [&](auto size, int64_t j) {
          for (int64_t r = 0; r < padded; r += kTileRows)
            scores_tile<decltype(size)::value>(held.qT.data() + r, padded, block_keys + j * k.stride(1), k.stride(1),
                                               head_dim, held.sT.data() + j * padded + r);
        });
        softmax_block(held, padded, head_dim, first_key, count, prefix + task.first);
        const float* block_values = values + first_key * v.stride(1);
        in_tiles<kDimsAtOnce>(head_dim, [&](auto size, int64_t d) {
          for (int64_t r = 0; r < padded; r += kTileRows)
            values_tile<decltype(size)::value>(held.sT.data() + r, padded, count, block_values + d, v.stride(1),
                                               held.oT.data() + d * padded + r);
        });
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = op + ((task.sequence * length + task.first + r / group) * num_q_heads + task.kv_head * group +
                           r % group) * head_dim;
        const float inverse_sum = 1.f / held.sums[r];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = held.oT[d * padded + r] * inverse_sum;
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
