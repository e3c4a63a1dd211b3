// Built under --config=cuda only. It references the CUDA runtime, cuBLAS,
// NCCL and every CUDA launcher in kernels/, so a missing symbol fails the
// link in CI. Run on a GPU machine, it checks each op's CUDA back end
// against its CPU back end on small random tensors.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/crossentropy.h"
#include "kernels/encoder.h"
#include "kernels/gelu.h"
#include "kernels/grad_norm.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "kernels/residual.h"

namespace {

using namespace muster::kernels;  // NOLINT: a test driver over one API

// B batch, T time, C channels, NH heads, V vocabulary, Vp padded.
constexpr int B = 2, T = 16, C = 32, NH = 4, V = 50, Vp = 64;
constexpr size_t N = B * T;

std::vector<float> Random(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

// Device copies of host vectors, freed when the pool goes.
class DevicePool {
 public:
  ~DevicePool() {
    for (void* ptr : owned_) cudaFree(ptr);
  }
  template <typename Elem>
  Elem* Copy(const std::vector<Elem>& host) {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, host.size() * sizeof(Elem) + 1) != cudaSuccess) return nullptr;
    owned_.push_back(ptr);
    cudaMemcpy(ptr, host.data(), host.size() * sizeof(Elem), cudaMemcpyHostToDevice);
    return static_cast<Elem*>(ptr);
  }

 private:
  std::vector<void*> owned_;
};

std::vector<float> ToHost(const float* device, size_t n) {
  std::vector<float> host(n);
  cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost);
  return host;
}

// Prints the worst |gpu - cpu| relative to the tensor's scale; false when
// it is beyond float round-off or the launch failed.
bool Compare(const char* name, int status, const float* device, const std::vector<float>& want) {
  if (status != 0 || cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("%-22s launch failed (%d)\n", name, status);
    return false;
  }
  std::vector<float> got = ToHost(device, want.size());
  float worst = 0, scale = 1;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::fmax(worst, std::fabs(got[i] - want[i]));
    scale = std::fmax(scale, std::fabs(want[i]));
  }
  const bool ok = worst <= 1e-4f * scale;
  std::printf("%-22s max |gpu - cpu| = %g %s\n", name, worst, ok ? "" : "FAIL");
  return ok;
}

bool CheckOps(cublasHandle_t blas) {
  DevicePool pool;
  bool ok = true;
  auto inp = Random(N * C, 1), dout = Random(N * C, 2);

  auto gelu_out = std::vector<float>(N * C);
  GeluForwardCpu(gelu_out.data(), inp.data(), N * C);
  float* gelu_dev = pool.Copy(inp);
  ok &= Compare("gelu forward", GeluForwardCuda(gelu_dev, gelu_dev, N * C, nullptr), gelu_dev,
                gelu_out);

  // matmul: inp (N, C) -> (N, 3C)
  const int OC = 3 * C;
  auto weight = Random(OC * C, 3), bias = Random(OC, 4), mm_dout = Random(N * OC, 5);
  std::vector<float> mm_out(N * OC), dinp(N * C, 0.0f), dweight(OC * C, 0.0f), dbias(OC, 0.0f);
  MatmulForwardCpu(mm_out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  MatmulBackwardCpu(dinp.data(), dweight.data(), dbias.data(), mm_dout.data(), inp.data(),
                    weight.data(), N, C, OC);
  float *d_inp = pool.Copy(inp), *d_weight = pool.Copy(weight), *d_bias = pool.Copy(bias);
  float *d_mm_out = pool.Copy(mm_out), *d_mm_dout = pool.Copy(mm_dout);
  float* d_dinp = pool.Copy(std::vector<float>(N * C, 0.0f));
  float* d_dweight = pool.Copy(std::vector<float>(OC * C, 0.0f));
  float* d_dbias = pool.Copy(std::vector<float>(OC, 0.0f));
  ok &= Compare("matmul forward",
                MatmulForwardCuda(d_mm_out, d_inp, d_weight, d_bias, N, C, OC, blas, nullptr),
                d_mm_out, mm_out);
  int status = MatmulBackwardCuda(d_dinp, d_dweight, d_dbias, d_mm_dout, d_inp, d_weight, N, C, OC,
                                  blas, nullptr);
  ok &= Compare("matmul dinp", status, d_dinp, dinp);
  ok &= Compare("matmul dweight", status, d_dweight, dweight);
  ok &= Compare("matmul dbias", status, d_dbias, dbias);

  // layernorm
  auto gain = Random(C, 6);
  std::vector<float> ln_out(N * C), mean(N), rstd(N), ln_dinp(N * C, 0.0f), dgain(C, 0.0f),
      dshift(C, 0.0f);
  LayerNormForwardCpu(ln_out.data(), mean.data(), rstd.data(), inp.data(), gain.data(), bias.data(),
                      N, C);
  LayerNormBackwardCpu(ln_dinp.data(), dgain.data(), dshift.data(), dout.data(), inp.data(),
                       gain.data(), mean.data(), rstd.data(), N, C);
  float *d_ln_out = pool.Copy(ln_out), *d_mean = pool.Copy(mean), *d_rstd = pool.Copy(rstd);
  float *d_gain = pool.Copy(gain), *d_dout = pool.Copy(dout);
  float* d_ln_dinp = pool.Copy(std::vector<float>(N * C, 0.0f));
  float* d_dgain = pool.Copy(std::vector<float>(C, 0.0f));
  float* d_dshift = pool.Copy(std::vector<float>(C, 0.0f));
  ok &=
      Compare("layernorm forward",
              LayerNormForwardCuda(d_ln_out, d_mean, d_rstd, d_inp, d_gain, d_bias, N, C, nullptr),
              d_ln_out, ln_out);
  status = LayerNormBackwardCuda(d_ln_dinp, d_dgain, d_dshift, d_dout, d_inp, d_gain, d_mean,
                                 d_rstd, N, C, nullptr);
  ok &= Compare("layernorm dinp", status, d_ln_dinp, ln_dinp);
  ok &= Compare("layernorm dweight", status, d_dgain, dgain);
  ok &= Compare("layernorm dbias", status, d_dshift, dshift);

  // residual
  std::vector<float> sum(N * C), dsum1(N * C, 0.0f), dsum2(N * C, 0.0f);
  ResidualForwardCpu(sum.data(), inp.data(), dout.data(), N * C);
  ResidualBackwardCpu(dsum1.data(), dsum2.data(), dout.data(), N * C);
  float *d_sum = pool.Copy(sum), *d_dsum1 = pool.Copy(std::vector<float>(N * C, 0.0f));
  float* d_dsum2 = pool.Copy(std::vector<float>(N * C, 0.0f));
  ok &= Compare("residual forward", ResidualForwardCuda(d_sum, d_inp, d_dout, N * C, nullptr),
                d_sum, sum);
  status = ResidualBackwardCuda(d_dsum1, d_dsum2, d_dout, N * C, nullptr);
  ok &= Compare("residual dinp1", status, d_dsum1, dsum1);
  ok &= Compare("residual dinp2", status, d_dsum2, dsum2);

  // encoder
  std::vector<int> tokens(N);
  for (size_t i = 0; i < N; ++i) tokens[i] = (i * 7) % V;
  auto wte = Random(Vp * C, 7), wpe = Random(T * C, 8);
  std::vector<float> enc_out(N * C), dwte(Vp * C, 0.0f), dwpe(T * C, 0.0f);
  EncoderForwardCpu(enc_out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  EncoderBackwardCpu(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  int* d_tokens = pool.Copy(tokens);
  float *d_wte = pool.Copy(wte), *d_wpe = pool.Copy(wpe), *d_enc_out = pool.Copy(enc_out);
  float* d_dwte = pool.Copy(std::vector<float>(Vp * C, 0.0f));
  float* d_dwpe = pool.Copy(std::vector<float>(T * C, 0.0f));
  ok &= Compare("encoder forward",
                EncoderForwardCuda(d_enc_out, d_tokens, d_wte, d_wpe, B, T, C, nullptr), d_enc_out,
                enc_out);
  status = EncoderBackwardCuda(d_dwte, d_dwpe, d_dout, d_tokens, B, T, C, nullptr);
  ok &= Compare("encoder dwte", status, d_dwte, dwte);
  ok &= Compare("encoder dwpe", status, d_dwpe, dwpe);

  // attention: qkv (N, 3C) is the matmul output above
  std::vector<float> att_out(N * C), att(B * NH * T * T), dpreatt(att.size()), dqkv(N * OC, 0.0f);
  AttentionForwardCpu(att_out.data(), att.data(), mm_out.data(), B, T, C, NH);
  AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), mm_out.data(), att.data(), B, T, C,
                       NH);
  float *d_att_out = pool.Copy(att_out), *d_att = pool.Copy(att);
  float *d_dpreatt = pool.Copy(dpreatt), *d_dqkv = pool.Copy(std::vector<float>(N * OC, 0.0f));
  ok &= Compare("attention forward",
                AttentionForwardCuda(d_att_out, d_att, d_mm_out, B, T, C, NH, nullptr), d_att_out,
                att_out);
  ok &= Compare(
      "attention dqkv",
      AttentionBackwardCuda(d_dqkv, d_dpreatt, d_dout, d_mm_out, d_att, B, T, C, NH, nullptr),
      d_dqkv, dqkv);

  // cross-entropy over logits (N, Vp)
  auto logits = Random(N * Vp, 9);
  std::vector<float> losses(N), lse(N), dlogits(N * Vp);
  CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), tokens.data(), N, V, Vp);
  CrossEntropyBackwardCpu(dlogits.data(), logits.data(), lse.data(), tokens.data(), 0.5f, N, V, Vp);
  float *d_logits = pool.Copy(logits), *d_losses = pool.Copy(losses), *d_lse = pool.Copy(lse);
  ok &= Compare("crossentropy forward",
                CrossEntropyForwardCuda(d_losses, d_lse, d_logits, d_tokens, N, V, Vp, nullptr),
                d_losses, losses);
  ok &= Compare(
      "crossentropy dlogits",
      CrossEntropyBackwardCuda(d_logits, d_logits, d_lse, d_tokens, 0.5f, N, V, Vp, nullptr),
      d_logits, dlogits);

  // adamw, then the global norm and clipping of its gradient
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  auto params = Random(N * C, 10);
  std::vector<float> moment1(N * C, 0.0f), moment2(N * C, 0.0f);
  float *d_params = pool.Copy(params), *d_m = pool.Copy(moment1), *d_v = pool.Copy(moment2);
  AdamWUpdateCpu(params.data(), moment1.data(), moment2.data(), dout.data(), N * C, hyper, 1);
  ok &=
      Compare("adamw params", AdamWUpdateCuda(d_params, d_m, d_v, d_dout, N * C, hyper, 1, nullptr),
              d_params, params);

  std::vector<double> scratch(SumOfSquaresCudaScratch(N * C) + 1);
  double* d_scratch = pool.Copy(scratch);
  double* d_result = pool.Copy(std::vector<double>(1));
  status = SumOfSquaresCuda(d_result, d_scratch, d_dout, N * C, nullptr);
  double gpu_sum = 0;
  cudaMemcpy(&gpu_sum, d_result, sizeof(double), cudaMemcpyDeviceToHost);
  const double cpu_sum = SumOfSquaresCpu(dout.data(), N * C);
  std::printf("%-22s gpu %.17g cpu %.17g\n", "sum of squares", gpu_sum, cpu_sum);
  ok &= status == 0 && std::fabs(gpu_sum - cpu_sum) <= 1e-12 * cpu_sum;
  ScaleCpu(dout.data(), N * C, 0.5f);
  ok &= Compare("scale", ScaleCuda(d_dout, N * C, 0.5f, nullptr), d_dout, dout);
  return ok;
}

}  // namespace

int main() {
  int version = 0;
  ncclGetVersion(&version);
  std::printf("nccl %d\n", version);
  cublasHandle_t blas = nullptr;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "no usable GPU: cublasCreate failed\n");
    return 1;
  }
  const bool ok = CheckOps(blas);
  cublasDestroy(blas);
  std::printf(ok ? "all ops match\n" : "some ops differ\n");
  return ok ? 0 : 1;
}
