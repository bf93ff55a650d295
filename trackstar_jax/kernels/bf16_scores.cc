// Exact scores of bfloat16 index rows against float32 queries, as an XLA FFI custom call
// (CPU). Built and registered by trackstar_jax/native.py; used by retrieval.py's
// "bf16_native" plan (few queries, where XLA:CPU's bf16 dot is compute-bound).
//
//   scores[q, r] = sum_j float32(rows[r, j]) * queries[q, j]      (float32 accumulation)
//
// A bfloat16 is the top half of the float32 with the same value, so widening is exact and
// costs two integer ops per 32 columns: a 32-bit word holding bf16 columns (2p, 2p+1)
// (little-endian) gives column 2p as `word << 16` and column 2p+1 as `word & 0xFFFF0000`.
// The query is de-interleaved once per call into its even and odd columns, and each row
// word-vector meets them in two FMAs. Products of a bf16 and a float32 and their float32
// sums are what a float32 dot computes (only the summation order differs), NaN/inf
// propagate (IEEE), and nothing is rounded to a narrower type.
//
// Dispatch: the AVX-512 (F + BW) path is compiled for that target with a function
// attribute and chosen at run time with __builtin_cpu_supports, so one .so runs on any
// x86-64 (the portable path is plain C++, auto-vectorised for the baseline ISA) and on
// other architectures (portable path only).
//
// Threads: the rows are cut into tiles that the calling thread and the tasks it schedules
// on XLA's intra-op thread pool claim from an atomic counter. The caller claims tiles until
// none is left and then waits only for tiles already being scored by running threads, so it
// never waits on a task that has not started (no deadlock when the pool is busy, e.g. with
// several fake devices executing at once, or when there is no pool: XLA then runs the task
// inline). Late tasks find no tile and return without touching the buffers.

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

// 16 words (32 bf16 columns) per step: one 512-bit vector of row words.
constexpr int64_t kWords = 16;

struct Problem {
  const uint16_t* rows;  // [b, d] bfloat16 bits
  const float* qe;       // [Q, P] even columns of the queries, zero-padded to P words
  const float* qo;       // [Q, P] odd columns
  float* out;            // [Q, b]
  int64_t b, d, nq, p;   // p = words per padded query row (multiple of kWords)
};

// ---------------------------------------------------------------------------------------
// Portable path
// ---------------------------------------------------------------------------------------

inline float Widen(uint16_t bits) {
  uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

void ScoreTileGeneric(const Problem& pr, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = pr.rows + r * pr.d;
    for (int64_t q = 0; q < pr.nq; ++q) {
      const float* qe = pr.qe + q * pr.p;
      const float* qo = pr.qo + q * pr.p;
      // kWords independent lanes: vectorisable without reassociating a single sum.
      float acc[kWords] = {};
      int64_t j = 0;
      for (; j + 2 * kWords <= pr.d; j += 2 * kWords) {
        for (int64_t l = 0; l < kWords; ++l) {
          acc[l] += Widen(x[j + 2 * l]) * qe[j / 2 + l];
          acc[l] += Widen(x[j + 2 * l + 1]) * qo[j / 2 + l];
        }
      }
      for (int64_t c = j; c < pr.d; ++c) {
        acc[(c - j) / 2] += Widen(x[c]) * ((c & 1) ? qo[c / 2] : qe[c / 2]);
      }
      float s = 0.f;
      for (int64_t l = 0; l < kWords; ++l) s += acc[l];
      pr.out[q * pr.b + r] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------
// AVX-512 path: NR rows x NQ queries per register block.
// ---------------------------------------------------------------------------------------

#ifdef TRACKSTAR_X86
#define TRACKSTAR_AVX512 __attribute__((target("avx512f,avx512bw")))
#define TRACKSTAR_AVX512_LAMBDA __attribute__((always_inline, target("avx512f,avx512bw")))

// NQ queries x NR rows: each widened row vector meets NQ query vectors (NQ*NR accumulators).
template <int NQ, int NR>
TRACKSTAR_AVX512 inline void BlockAvx512(const Problem& pr, int64_t r0, int64_t q0) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[NQ][NR];
  for (int q = 0; q < NQ; ++q)
    for (int r = 0; r < NR; ++r) acc[q][r] = _mm512_setzero_ps();
  const uint16_t* x[NR];
  for (int r = 0; r < NR; ++r) x[r] = pr.rows + (r0 + r) * pr.d;
  const float* qe[NQ];
  const float* qo[NQ];
  for (int q = 0; q < NQ; ++q) {
    qe[q] = pr.qe + (q0 + q) * pr.p;
    qo[q] = pr.qo + (q0 + q) * pr.p;
  }
  const int64_t full = pr.d / (2 * kWords);
  const int64_t tail = pr.d - full * 2 * kWords;  // < 32 columns, read with a masked load
  // One chunk of 32 columns (kept in one function so the main loop holds the accumulators
  // in registers; a loop that also handles the masked tail made GCC spill them every step).
  auto step = [&](int64_t c, __mmask32 m, bool masked) TRACKSTAR_AVX512_LAMBDA {
    __m512 ev[NR], od[NR];
    for (int r = 0; r < NR; ++r) {
      const __m512i v = masked ? _mm512_maskz_loadu_epi16(m, x[r] + c * 2 * kWords)
                               : _mm512_loadu_si512(x[r] + c * 2 * kWords);
      ev[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      od[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
    }
    for (int q = 0; q < NQ; ++q) {
      const __m512 e = _mm512_loadu_ps(qe[q] + c * kWords);
      const __m512 o = _mm512_loadu_ps(qo[q] + c * kWords);
      for (int r = 0; r < NR; ++r) {
        acc[q][r] = _mm512_fmadd_ps(ev[r], e, acc[q][r]);
        acc[q][r] = _mm512_fmadd_ps(od[r], o, acc[q][r]);
      }
    }
  };
  for (int64_t c = 0; c < full; ++c) step(c, 0, false);
  if (tail) step(full, static_cast<__mmask32>((1ull << tail) - 1), true);
  for (int q = 0; q < NQ; ++q)
    for (int r = 0; r < NR; ++r) pr.out[(q0 + q) * pr.b + r0 + r] = _mm512_reduce_add_ps(acc[q][r]);
}

// One query, one row: 4 independent accumulation chains (even / odd columns x 2 chunks), so
// the FMA latency is hidden without interleaving rows.
TRACKSTAR_AVX512 inline void Row1Avx512(const Problem& pr, int64_t r, int64_t q) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const uint16_t* x = pr.rows + r * pr.d;
  const float* qe = pr.qe + q * pr.p;
  const float* qo = pr.qo + q * pr.p;
  const int64_t full = pr.d / (2 * kWords);
  const int64_t tail = pr.d - full * 2 * kWords;
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    const __m512i v0 = _mm512_loadu_si512(x + c * 2 * kWords);
    const __m512i v1 = _mm512_loadu_si512(x + (c + 1) * 2 * kWords);
    a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), _mm512_loadu_ps(qe + c * kWords), a0);
    a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v0, hi_mask)), _mm512_loadu_ps(qo + c * kWords), a1);
    a2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), _mm512_loadu_ps(qe + (c + 1) * kWords), a2);
    a3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v1, hi_mask)), _mm512_loadu_ps(qo + (c + 1) * kWords), a3);
  }
  for (; c <= full; ++c) {  // at most one full chunk, then the masked tail
    if (c == full && tail == 0) break;
    const __mmask32 m = c < full ? ~__mmask32{0} : static_cast<__mmask32>((1ull << tail) - 1);
    const __m512i v = _mm512_maskz_loadu_epi16(m, x + c * 2 * kWords);
    a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), _mm512_loadu_ps(qe + c * kWords), a0);
    a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)), _mm512_loadu_ps(qo + c * kWords), a1);
  }
  pr.out[q * pr.b + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <int NQ>
TRACKSTAR_AVX512 void RowsAvx512(const Problem& pr, int64_t r0, int64_t r1, int64_t q0) {
  // One query: row by row (one sequential stream per thread; measured as fast as 2, 4 or 8
  // interleaved rows, with or without software prefetch). Several queries: 4 rows per block,
  // so NQ*4 accumulators + 8 widened vectors stay within the 32 vector registers.
  if (NQ == 1) {
    for (int64_t r = r0; r < r1; ++r) Row1Avx512(pr, r, q0);
    return;
  }
  constexpr int NR = 4;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) BlockAvx512<NQ, NR>(pr, r, q0);
  for (; r < r1; ++r) BlockAvx512<NQ, 1>(pr, r, q0);
}

TRACKSTAR_AVX512 void ScoreTileAvx512(const Problem& pr, int64_t r0, int64_t r1) {
  // Query groups of up to 4 over the same tile of rows (the tile stays in L2 between groups).
  int64_t q = 0;
  for (; q + 4 <= pr.nq; q += 4) RowsAvx512<4>(pr, r0, r1, q);
  switch (pr.nq - q) {
    case 3: RowsAvx512<3>(pr, r0, r1, q); break;
    case 2: RowsAvx512<2>(pr, r0, r1, q); break;
    case 1: RowsAvx512<1>(pr, r0, r1, q); break;
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

void ScoreTile(const Problem& pr, int64_t r0, int64_t r1) {
#ifdef TRACKSTAR_X86
  if (HasAvx512()) return ScoreTileAvx512(pr, r0, r1);
#endif
  ScoreTileGeneric(pr, r0, r1);
}

// ---------------------------------------------------------------------------------------
// Work sharing over XLA's intra-op thread pool
// ---------------------------------------------------------------------------------------

struct Shared {
  Problem pr;
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

ffi::Error Bf16ScoresImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::F32> queries,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions();
  const auto qd = queries.dimensions();
  const auto od = out->dimensions();
  if (rd.size() != 2 || qd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("trackstar_bf16_scores: rows, queries and scores must be 2-D");
  }
  const int64_t b = rd[0], d = rd[1], nq = qd[0];
  if (qd[1] != d || od[0] != nq || od[1] != b) {
    return ffi::Error::InvalidArgument("trackstar_bf16_scores: expected rows [b, d], queries [Q, d], scores [Q, b]");
  }
  if (b == 0 || nq == 0) return ffi::Error::Success();
  auto sh = std::make_shared<Shared>();
  // De-interleaved, zero-padded query columns (the padding meets masked-out row columns).
  const int64_t words = (d + 1) / 2;
  const int64_t p = (words + kWords - 1) / kWords * kWords;
  auto qbuf = std::make_shared<std::vector<float>>(static_cast<size_t>(2 * nq * p), 0.f);
  float* qe = qbuf->data();
  float* qo = qe + nq * p;
  const float* qs = queries.typed_data();
  for (int64_t q = 0; q < nq; ++q) {
    for (int64_t j = 0; j < d; ++j) {
      (j & 1 ? qo : qe)[q * p + j / 2] = qs[q * d + j];
    }
  }
  sh->pr = Problem{reinterpret_cast<const uint16_t*>(rows.typed_data()), qe, qo, out->typed_data(), b, d, nq, p};
  // Tiles of ~256 KB of rows (L2-resident while the query groups pass over them), at
  // least 8 rows; small inputs are one tile (no scheduling at all).
  sh->tile_rows = std::max<int64_t>(8, (int64_t{256} << 10) / std::max<int64_t>(2 * d, 1));
  sh->num_tiles = (b + sh->tile_rows - 1) / sh->tile_rows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), sh->num_tiles - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    // Each task keeps the shared state (and the query buffer) alive until it returns.
    pool.Schedule([sh, qbuf] { sh->Work(); });
  }
  sh->Work();
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done == sh->num_tiles; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrackstarBf16Scores, Bf16ScoresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // rows [b, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // queries [Q, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scores [Q, b]

// Which code path this CPU runs: 1 = AVX-512, 0 = portable (for logs, plans and tests).
extern "C" int TrackstarKernelIsa() { return HasAvx512() ? 1 : 0; }

// Test hook: 1 forces the portable path (so tests check it on AVX-512 machines too), 0 undoes it.
extern "C" void TrackstarForcePortable(int on) { force_portable.store(on != 0); }
