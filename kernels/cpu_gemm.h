// Row-major sgemm for the CPU back end (kernels/*_cpu.cc only), run in
// OpenMP's threads:
//   c (M, N) = alpha * op(a) (M, K) @ op(b) (K, N) + beta * c
// op(x) is x or x^T per trans_x; lda, ldb, ldc are row strides as in
// cblas_sgemm.
//
// Why not let OpenBLAS thread its own GEMMs: Debian's OpenBLAS is the
// pthreads build, whose thread pool knows nothing of OpenMP's. Between
// parallel loops the OpenMP threads spin while OpenBLAS's threads work, and
// on a 2-core machine the two pools took turns starving each other (a third
// of the CPU time went to libgomp's spin loop). So OpenBLAS is set to one
// thread, once, and every parallel GEMM is split here into tasks of fixed
// shape. The split depends only on the matrix shape, never on the thread
// count, so each output element is computed by the same single-threaded
// call with any number of threads: GEMM results are bitwise independent of
// OMP_NUM_THREADS too. (One thread runs a large GEMM as one call, where
// OpenBLAS computes the same bits that way: GemmAsOneCall.)
#pragma once

#include <cblas.h>
#include <omp.h>

#include <algorithm>

namespace muster::kernels::cpu {

// Output rows per GEMM task, a function of M alone. OpenBLAS packs both
// operands in every call, so each task re-packs the whole of op(b): with
// one thread (a DDP rank) small tasks spent a quarter of the step packing.
// About kGemmRowsPerTask rows per task keeps that to a few percent, and at
// least two tasks keep two threads busy (512 rather than 256: at BT = 1024
// two tasks instead of four halve the re-packing of op(b)). Rounded up to
// 16 rows, a multiple of OpenBLAS's micro-tile, so only a task's last
// rows can fall in a partial tile.
constexpr int kGemmRowsPerTask = 512;

inline int GemmRowsPerTask(int M) {
  int tasks = (M + kGemmRowsPerTask - 1) / kGemmRowsPerTask;
  tasks = std::max(2, tasks + (tasks & 1));  // even, for two threads
  const int rows = (M + tasks - 1) / tasks;
  return (rows + 15) / 16 * 16;
}

// Below this many multiply-adds (M*N*K) OpenBLAS 0.3.21 may leave its
// blocked path for a kernel chosen by size: the "small matrix" kernels
// (M*N*K <= 1e6 on SkylakeX) or sgemm_direct (< 28*512*512, row-major NN).
// On the blocked path, C(i, j) is the same chain of FMAs whatever M is:
// K is split in blocks that depend on K alone, and each block's products
// are added in k order by the micro-kernel. So splitting rows there cannot
// change a bit, and tests/kernels/thread_count_test.cc checks it.
constexpr double kBlockedPathMinMadds = 8.0 * 1024 * 1024;

// Whether a GEMM runs as one call instead of GemmRowsPerTask(M) tasks:
// with one thread the tasks buy nothing and each re-packs op(b) (3-18%
// slower per GEMM at GPT block shapes). Only where the whole and every
// task take OpenBLAS's blocked path, so the bits stay those of the tasks.
inline bool GemmAsOneCall(int M, int N, int K, int threads) {
  const double task_madds = static_cast<double>(GemmRowsPerTask(M)) * N * K;
  return threads == 1 && task_madds >= kBlockedPathMinMadds;
}

// Sets OpenBLAS to one thread the first time any CPU kernel runs. The
// setting is process-wide; the CPU kernels are OpenBLAS's only callers.
inline void UseSingleThreadedBlas() {
  static const bool done = (openblas_set_num_threads(1), true);
  (void)done;
}

// One single-threaded GEMM; safe to call from inside a parallel loop.
inline void Sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* a,
                  int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

// One GEMM, its M rows split in blocks of GemmRowsPerTask(M) across OpenMP
// threads. Must not be called from inside a parallel loop.
inline void ParallelSgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                          const float* a, int lda, const float* b, int ldb, float beta, float* c,
                          int ldc) {
  if (M <= 0 || N <= 0) return;
  UseSingleThreadedBlas();
  if (GemmAsOneCall(M, N, K, omp_get_max_threads())) {
    Sgemm(trans_a, trans_b, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int rows_per_task = GemmRowsPerTask(M);
  const int tasks = (M + rows_per_task - 1) / rows_per_task;
  // Dynamic: on shared cores a thread may lose its core for a while.
#pragma omp parallel for schedule(dynamic, 1)
  for (int task = 0; task < tasks; ++task) {
    const int row = task * rows_per_task;
    const int rows = std::min(rows_per_task, M - row);
    // Row `row` of op(a) starts at row `row` of a, or column `row` if a is
    // transposed.
    const float* a_rows = trans_a ? a + row : a + static_cast<long>(row) * lda;
    Sgemm(trans_a, trans_b, rows, N, K, alpha, a_rows, lda, b, ldb, beta,
          c + static_cast<long>(row) * ldc, ldc);
  }
}

}  // namespace muster::kernels::cpu
