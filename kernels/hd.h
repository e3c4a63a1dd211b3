// MUSTER_HD marks math that both back ends run: nvcc compiles it for the
// device and the host; g++ sees a plain inline function. Keep each such
// function free of state so the CPU tests exercise exactly what a GPU runs.
#pragma once

#if defined(__CUDACC__)
#define MUSTER_HD __host__ __device__ __forceinline__
#else
#define MUSTER_HD inline
#endif
