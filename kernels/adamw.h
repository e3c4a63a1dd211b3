// AdamW with decoupled weight decay, as llm.c's gpt2_update:
//   g = grad_scale * gradient (the global-norm clip, folded in),
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   param -= lr * ((m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
//                  + weight_decay * param)
// One call updates one buffer of n parameters; the caller picks the
// hyperparameters per buffer, e.g. weight_decay = 0 for biases and
// layernorm gains. step counts updates from 1.
// Shapes: params, m, v, grads (n). m and v start at zero and belong to the
// caller (they are optimizer state to checkpoint).
// Aliasing: none of the four arrays may alias another.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

// Defaults are those of llm.c's CUDA trainer (GPT-3's betas), without decay.
struct AdamWHyper {
  float learning_rate = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  // Multiplies every gradient as it is read: the clip factor, so the
  // gradients need no pass of their own (1 leaves them exact).
  float grad_scale = 1.0f;
};

// 1 - beta^step, computed on the host once per call (in double, so late
// steps do not lose the small difference from 1).
inline float AdamWBiasCorrection(float beta, int step) {
  return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), step));
}

// One parameter; bias_correction1/2 are AdamWBiasCorrection(beta1/2, step).
MUSTER_HD void AdamWElem(float* param, float* m, float* v, float gradient, const AdamWHyper& hyper,
                         float bias_correction1, float bias_correction2) {
  const float grad = gradient * hyper.grad_scale;
  const float m_new = hyper.beta1 * *m + (1.0f - hyper.beta1) * grad;
  const float v_new = hyper.beta2 * *v + (1.0f - hyper.beta2) * grad * grad;
  const float m_hat = m_new / bias_correction1;
  const float v_hat = v_new / bias_correction2;
  *m = m_new;
  *v = v_new;
  *param -=
      hyper.learning_rate * (m_hat / (sqrtf(v_hat) + hyper.eps) + hyper.weight_decay * *param);
}

// ---- CPU back end (host pointers) ----
void AdamWUpdateCpu(float* params, float* m, float* v, const float* grads, size_t n,
                    const AdamWHyper& hyper, int step);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int AdamWUpdateCuda(float* params, float* m, float* v, const float* grads, size_t n,
                    const AdamWHyper& hyper, int step, void* stream);

}  // namespace muster::kernels
