// Exact scores of index rows (bfloat16 or float32) against float32 queries, as XLA FFI
// custom calls on CPU. Built and registered by trackstar_jax/native.py; used by
// retrieval.py's "native" plan (few queries: XLA:CPU's bf16 dot is compute-bound there, and
// its float32 matvec reads below the machine's read rate).
//
//   scores[q, r] = sum_j float32(rows[r, j]) * queries[q, j]      (float32 accumulation)
//
// Rows are read in chunks of 32 columns as two 16-lane float32 vectors, "lo" and "hi":
//   * bfloat16: one 512-bit load of 16 words, each holding columns (2l, 2l+1) (little-endian);
//     lo = word << 16 (column 2l), hi = word & 0xFFFF0000 (column 2l+1). A bf16 is the top
//     half of the float32 with the same value, so this widening is exact and costs two
//     integer ops per 32 columns.
//   * float32: lo = columns 0..15, hi = columns 16..31.
// The query is rearranged once per call into the matching lo / hi layout (zero-padded to
// whole chunks), and each row vector meets it in FMAs. Products and float32 sums are what a
// float32 dot computes (only the summation order differs), NaN/inf propagate (IEEE), and
// nothing is rounded to a narrower type. The last partial chunk is read with masked loads
// (masked-out columns read as zero and meet zero query padding).
//
// Dispatch: the AVX-512 (F + BW) path is compiled for that target with a function attribute
// and chosen at run time with __builtin_cpu_supports, so one .so runs on any x86-64 (the
// portable path is plain C++, vectorised by the compiler for the baseline ISA) and on other
// architectures (portable path only).
//
// Threads: the rows are cut into tiles that the calling thread and the tasks it schedules on
// XLA's intra-op thread pool claim from an atomic counter. The caller claims tiles until none
// is left and then waits only for tiles already being scored by running threads, so it never
// waits on a task that has not started (no deadlock when the pool is busy, e.g. with several
// fake devices executing at once, or when there is no pool: XLA then runs the task inline).
// Late tasks find no tile and return without touching the buffers.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TRACKSTAR_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 32;  // columns per step
constexpr int64_t kLanes = 16;  // float32 lanes per vector (lo and hi per chunk)

// Where column w (0..31) of a chunk sits: vector (0 = lo, 1 = hi) and lane.
template <typename T>
struct Layout;
template <>
struct Layout<uint16_t> {  // bfloat16 bits: word l = columns (2l, 2l+1)
  static constexpr int Half(int64_t w) { return static_cast<int>(w & 1); }
  static constexpr int64_t Lane(int64_t w) { return w >> 1; }
  static float Value(uint16_t bits) {
    const uint32_t w = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
  }
};
template <>
struct Layout<float> {  // float32: columns 0..15, then 16..31
  static constexpr int Half(int64_t w) { return static_cast<int>(w >> 4); }
  static constexpr int64_t Lane(int64_t w) { return w & 15; }
  static float Value(float v) { return v; }
};

template <typename T>
struct Problem {
  const T* rows;        // [b, d]
  const float* qlo;     // [Q, p] query columns in the rows' lo layout, zero-padded
  const float* qhi;     // [Q, p] ... hi layout
  float* out;           // [Q, b]
  int64_t b, d, nq, p;  // p = kLanes * number of chunks
};

// ---------------------------------------------------------------------------------------
// Portable path
// ---------------------------------------------------------------------------------------

template <typename T>
void ScoreTileGeneric(const Problem<T>& pr, int64_t r0, int64_t r1) {
  using L = Layout<T>;
  const int64_t full = pr.d / kChunk;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = pr.rows + r * pr.d;
    for (int64_t q = 0; q < pr.nq; ++q) {
      const float* qlo = pr.qlo + q * pr.p;
      const float* qhi = pr.qhi + q * pr.p;
      float acc[kLanes] = {};  // independent lanes: vectorisable without reassociating one sum
      for (int64_t c = 0; c < full; ++c) {
        for (int64_t w = 0; w < kChunk; ++w) {
          const int64_t l = L::Lane(w);
          acc[l] += L::Value(x[c * kChunk + w]) * (L::Half(w) ? qhi : qlo)[c * kLanes + l];
        }
      }
      for (int64_t w = 0; w < pr.d - full * kChunk; ++w) {
        const int64_t l = L::Lane(w);
        acc[l] += L::Value(x[full * kChunk + w]) * (L::Half(w) ? qhi : qlo)[full * kLanes + l];
      }
      float s = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
      pr.out[q * pr.b + r] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------
// AVX-512 path
// ---------------------------------------------------------------------------------------

#ifdef TRACKSTAR_X86
#define TRACKSTAR_AVX512 __attribute__((target("avx512f,avx512bw")))
#define TRACKSTAR_AVX512_INLINE __attribute__((always_inline, target("avx512f,avx512bw")))

// Chunk of 32 columns at x as (lo, hi) float32 vectors; `m` selects the columns to read.
TRACKSTAR_AVX512_INLINE inline void LoadChunk(const uint16_t* x, bool masked, __mmask32 m, __m512& lo, __m512& hi) {
  const __m512i v = masked ? _mm512_maskz_loadu_epi16(m, x) : _mm512_loadu_si512(x);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
TRACKSTAR_AVX512_INLINE inline void LoadChunk(const float* x, bool masked, __mmask32 m, __m512& lo, __m512& hi) {
  lo = masked ? _mm512_maskz_loadu_ps(static_cast<__mmask16>(m), x) : _mm512_loadu_ps(x);
  hi = masked ? _mm512_maskz_loadu_ps(static_cast<__mmask16>(m >> 16), x + kLanes) : _mm512_loadu_ps(x + kLanes);
}

// NQ queries x NR rows: each row vector meets NQ query vectors (NQ*NR accumulators).
template <typename T, int NQ, int NR>
TRACKSTAR_AVX512 inline void BlockAvx512(const Problem<T>& pr, int64_t r0, int64_t q0) {
  __m512 acc[NQ][NR];
  for (int q = 0; q < NQ; ++q)
    for (int r = 0; r < NR; ++r) acc[q][r] = _mm512_setzero_ps();
  const T* x[NR];
  for (int r = 0; r < NR; ++r) x[r] = pr.rows + (r0 + r) * pr.d;
  const float* qlo[NQ];
  const float* qhi[NQ];
  for (int q = 0; q < NQ; ++q) {
    qlo[q] = pr.qlo + (q0 + q) * pr.p;
    qhi[q] = pr.qhi + (q0 + q) * pr.p;
  }
  const int64_t full = pr.d / kChunk;
  const int64_t tail = pr.d - full * kChunk;
  // One chunk (a separate inlined step, so that the main loop keeps the accumulators in
  // registers: a loop that also handled the masked tail made GCC spill them every step).
  auto step = [&](int64_t c, bool masked, __mmask32 m) TRACKSTAR_AVX512_INLINE {
    __m512 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) LoadChunk(x[r] + c * kChunk, masked, m, lo[r], hi[r]);
    for (int q = 0; q < NQ; ++q) {
      const __m512 ql = _mm512_loadu_ps(qlo[q] + c * kLanes);
      const __m512 qh = _mm512_loadu_ps(qhi[q] + c * kLanes);
      for (int r = 0; r < NR; ++r) {
        acc[q][r] = _mm512_fmadd_ps(lo[r], ql, acc[q][r]);
        acc[q][r] = _mm512_fmadd_ps(hi[r], qh, acc[q][r]);
      }
    }
  };
  for (int64_t c = 0; c < full; ++c) step(c, false, 0);
  if (tail) step(full, true, static_cast<__mmask32>((1ull << tail) - 1));
  for (int q = 0; q < NQ; ++q)
    for (int r = 0; r < NR; ++r) pr.out[(q0 + q) * pr.b + r0 + r] = _mm512_reduce_add_ps(acc[q][r]);
}

// One query, one row: 4 independent accumulation chains (lo / hi x 2 chunks), so the FMA
// latency is hidden without interleaving rows (one sequential stream per thread measured as
// fast as 2, 4 or 8 interleaved rows, with or without software prefetch).
template <typename T>
TRACKSTAR_AVX512 inline void Row1Avx512(const Problem<T>& pr, int64_t r, int64_t q) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const T* x = pr.rows + r * pr.d;
  const float* qlo = pr.qlo + q * pr.p;
  const float* qhi = pr.qhi + q * pr.p;
  const int64_t full = pr.d / kChunk;
  const int64_t tail = pr.d - full * kChunk;
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    __m512 lo0, hi0, lo1, hi1;
    LoadChunk(x + c * kChunk, false, 0, lo0, hi0);
    LoadChunk(x + (c + 1) * kChunk, false, 0, lo1, hi1);
    a0 = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(qlo + c * kLanes), a0);
    a1 = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(qhi + c * kLanes), a1);
    a2 = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(qlo + (c + 1) * kLanes), a2);
    a3 = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(qhi + (c + 1) * kLanes), a3);
  }
  for (; c < full || (c == full && tail); ++c) {  // at most one full chunk, then the masked tail
    __m512 lo, hi;
    LoadChunk(x + c * kChunk, c == full, static_cast<__mmask32>((1ull << tail) - 1), lo, hi);
    a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(qlo + c * kLanes), a0);
    a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(qhi + c * kLanes), a1);
  }
  pr.out[q * pr.b + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <typename T, int NQ>
TRACKSTAR_AVX512 void RowsAvx512(const Problem<T>& pr, int64_t r0, int64_t r1, int64_t q0) {
  if (NQ == 1) {
    for (int64_t r = r0; r < r1; ++r) Row1Avx512(pr, r, q0);
    return;
  }
  // 4 rows per block: NQ*4 accumulators + 8 row vectors stay within the 32 vector registers.
  constexpr int NR = 4;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) BlockAvx512<T, NQ, NR>(pr, r, q0);
  for (; r < r1; ++r) BlockAvx512<T, NQ, 1>(pr, r, q0);
}

template <typename T>
TRACKSTAR_AVX512 void ScoreTileAvx512(const Problem<T>& pr, int64_t r0, int64_t r1) {
  // Query groups of up to 4 over the same tile of rows (the tile stays in L2 between groups).
  int64_t q = 0;
  for (; q + 4 <= pr.nq; q += 4) RowsAvx512<T, 4>(pr, r0, r1, q);
  switch (pr.nq - q) {
    case 3: RowsAvx512<T, 3>(pr, r0, r1, q); break;
    case 2: RowsAvx512<T, 2>(pr, r0, r1, q); break;
    case 1: RowsAvx512<T, 1>(pr, r0, r1, q); break;
    default: break;
  }
}
#endif  // TRACKSTAR_X86

std::atomic<bool> force_portable{false};  // test hook (TrackstarForcePortable)

bool HasAvx512() {
#ifdef TRACKSTAR_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has && !force_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

template <typename T>
void ScoreTile(const Problem<T>& pr, int64_t r0, int64_t r1) {
#ifdef TRACKSTAR_X86
  if (HasAvx512()) return ScoreTileAvx512(pr, r0, r1);
#endif
  ScoreTileGeneric(pr, r0, r1);
}

// ---------------------------------------------------------------------------------------
// Work sharing over XLA's intra-op thread pool
// ---------------------------------------------------------------------------------------

template <typename T>
struct Shared {
  Problem<T> pr;
  std::vector<float> query;  // qlo then qhi, owned here so late tasks never see it freed
  int64_t tile_rows = 0, num_tiles = 0;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;  // guarded by mu

  // Claims and scores tiles until none is left.
  void Work() {
    for (;;) {
      const int64_t t = next.fetch_add(1);
      if (t >= num_tiles) return;
      const int64_t r0 = t * tile_rows;
      ScoreTile(pr, r0, std::min(pr.b, r0 + tile_rows));
      std::lock_guard<std::mutex> lock(mu);
      if (++done == num_tiles) cv.notify_all();
    }
  }
};

template <typename T, ffi::DataType kRowType>
ffi::Error ScoresImpl(ffi::ThreadPool pool, ffi::Buffer<kRowType> rows, ffi::Buffer<ffi::F32> queries,
                      ffi::ResultBuffer<ffi::F32> out) {
  using L = Layout<T>;
  const auto rd = rows.dimensions();
  const auto qd = queries.dimensions();
  const auto od = out->dimensions();
  if (rd.size() != 2 || qd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("trackstar scores: rows, queries and scores must be 2-D");
  }
  const int64_t b = rd[0], d = rd[1], nq = qd[0];
  if (qd[1] != d || od[0] != nq || od[1] != b) {
    return ffi::Error::InvalidArgument("trackstar scores: expected rows [b, d], queries [Q, d], scores [Q, b]");
  }
  if (b == 0 || nq == 0) return ffi::Error::Success();
  auto sh = std::make_shared<Shared<T>>();
  const int64_t p = (d + kChunk - 1) / kChunk * kLanes;
  sh->query.assign(static_cast<size_t>(2 * nq * p), 0.f);
  float* qlo = sh->query.data();
  float* qhi = qlo + nq * p;
  const float* qs = queries.typed_data();
  for (int64_t q = 0; q < nq; ++q) {
    for (int64_t j = 0; j < d; ++j) {
      const int64_t c = j / kChunk, w = j % kChunk;
      (L::Half(w) ? qhi : qlo)[q * p + c * kLanes + L::Lane(w)] = qs[q * d + j];
    }
  }
  sh->pr = Problem<T>{reinterpret_cast<const T*>(rows.untyped_data()), qlo, qhi, out->typed_data(), b, d, nq, p};
  // Tiles of ~256 KB of rows (L2-resident while the query groups pass over them), at least
  // 8 rows; small inputs are one tile (no scheduling at all).
  sh->tile_rows = std::max<int64_t>(8, (int64_t{256} << 10) / std::max<int64_t>(d * int64_t{sizeof(T)}, 1));
  sh->num_tiles = (b + sh->tile_rows - 1) / sh->tile_rows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), sh->num_tiles - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([sh] { sh->Work(); });  // each task keeps the shared state alive
  }
  sh->Work();
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done == sh->num_tiles; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrackstarBf16Scores, (ScoresImpl<uint16_t, ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // rows [b, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // queries [Q, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scores [Q, b]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrackstarF32Scores, (ScoresImpl<float, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rows [b, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // queries [Q, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scores [Q, b]

// Which code path this CPU runs: 1 = AVX-512, 0 = portable (for logs, plans and tests).
extern "C" int TrackstarKernelIsa() { return HasAvx512() ? 1 : 0; }

// Test hook: 1 forces the portable path (so tests check it on AVX-512 machines too), 0 undoes it.
extern "C" void TrackstarForcePortable(int on) { force_portable.store(on != 0); }
