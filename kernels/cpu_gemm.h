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
// OMP_NUM_THREADS too, one thread included. (One thread used to run a
// large GEMM as one call, where that gave the tasks' bits. On the earlier
// machines it did; on an AMD EPYC, with OpenBLAS 0.3.21's Zen or Haswell
// kernels, a row's bits depend on how M is split: one call of 1024 rows
// against two of 512 changed 2.5% of the outputs, all in rows 448 and
// after. There the tasks timed no slower than one call, 1024 to 4096
// rows. tests/kernels/thread_count_test.cc checks 1, 2 and 3 threads.)
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
