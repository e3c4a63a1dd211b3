// cuDNN's fused attention, driven through its backend descriptors
// (cudnn_attention.h says why not the C++ front end). The graphs below are
// the ones cuDNN's front end builds for causal, dropout-free training
// attention (its "composite" SDPA nodes), op for op and type for type:
// cuDNN's engines recognise a fused-attention pattern by its operations
// and their tensors' types, so a change here can make the heuristics
// return nothing.
#include "kernels/fast/cudnn_attention.h"

#include <cuda_runtime.h>
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace muster::kernels::fast {
namespace {

// The entry points used, from libcudnn.so.9 (cuDNN's dispatcher library,
// which loads its engine libraries itself). Loaded at run time so that
// the worker links and runs without cuDNN unless `attention: cudnn`.
struct CudnnApi {
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
  long version = 0;
  std::string error;  // why cuDNN is unusable; empty when loaded
};

// cuDNN 9: the graphs follow its rules (9.0 dropped the s_kv % 64 padding
// workaround; -inf as the mask value from 9.10, below).
constexpr long kMinVersion = 90000;

const CudnnApi& Api() {
  static const CudnnApi api = [] {
    CudnnApi a;
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      a.error = std::string(
                    "cannot load cuDNN 9 (libcudnn.so.9; put its folder on "
                    "LD_LIBRARY_PATH): ") +
                dlerror();
      return a;
    }
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && a.error.empty()) {
        a.error = std::string("libcudnn.so.9 lacks ") + name;
      }
    };
    resolve(a.GetVersion, "cudnnGetVersion");
    resolve(a.GetErrorString, "cudnnGetErrorString");
    resolve(a.GetLastErrorString, "cudnnGetLastErrorString");
    resolve(a.Create, "cudnnCreate");
    resolve(a.Destroy, "cudnnDestroy");
    resolve(a.SetStream, "cudnnSetStream");
    resolve(a.CreateDescriptor, "cudnnBackendCreateDescriptor");
    resolve(a.DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    resolve(a.Finalize, "cudnnBackendFinalize");
    resolve(a.SetAttribute, "cudnnBackendSetAttribute");
    resolve(a.GetAttribute, "cudnnBackendGetAttribute");
    resolve(a.Execute, "cudnnBackendExecute");
    if (!a.error.empty()) return a;
    a.version = static_cast<long>(a.GetVersion());
    if (a.version < kMinVersion) {
      a.error = "cuDNN " + std::to_string(a.version) + " is too old: cuDNN 9 is needed";
    }
    return a;
  }();
  return api;
}

// cuDNN's status and its own last message, as one string.
std::string CudnnMessage(cudnnStatus_t status) {
  const CudnnApi& api = Api();
  std::string text = api.GetErrorString(status);
  char last[1024] = {0};
  api.GetLastErrorString(last, sizeof(last));
  if (last[0] != '\0') text += std::string(" (") + last + ")";
  return text;
}

// An owned backend descriptor.
class Descriptor {
 public:
  Descriptor() = default;
  explicit Descriptor(cudnnBackendDescriptor_t d) : d_(d) {}
  ~Descriptor() {
    if (d_ != nullptr) Api().DestroyDescriptor(d_);
  }
  Descriptor(Descriptor&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Descriptor& operator=(Descriptor&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::vector<int64_t>;

// Builds one operation graph. The first failing call records what failed
// in *error, and every later call is then a no-op, so the graph code reads
// straight through and is checked once at the end.
class GraphBuilder {
 public:
  GraphBuilder(cudnnHandle_t handle, std::string* error) : handle_(handle), error_(error) {}

  bool ok() const { return error_->empty(); }

  // A tensor: uid (the variant pack's key for non-virtual ones), type,
  // dims and strides (4-D, elements).
  cudnnBackendDescriptor_t Tensor(int64_t uid, cudnnDataType_t type, const Dims& dims,
                                  const Dims& strides, bool is_virtual = false,
                                  bool by_value = false) {
    cudnnBackendDescriptor_t t = Create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const int64_t alignment = 16;
    const bool virt = is_virtual, value = by_value;
    Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor type");
    Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.size(), dims.data(), "tensor dims");
    Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.size(), strides.data(),
        "tensor strides");
    Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
    if (value) Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &value, "by value");
    Finalize(t, "tensor " + std::to_string(uid));
    return t;
  }

  // A virtual tensor with the next free uid.
  cudnnBackendDescriptor_t Virtual(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return Tensor(next_virtual_uid_++, type, dims, strides, /*is_virtual=*/true);
  }

  // y = mode(x[, b[, t]]), computed in `math`. axis: GEN_INDEX's.
  void Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    const std::string what = "pointwise " + std::to_string(static_cast<int>(mode));
    cudnnBackendDescriptor_t pw = Create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, what);
    if (axis >= 0) Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
    Finalize(pw, what);
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    const float one = 1.0f;
    SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, what);
    SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, what);
    if (b != nullptr) SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, what);
    if (t != nullptr) SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, what);
    SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, what);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, what);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, what);
    Finalize(op, what);
    ops_.push_back(op);
  }

  // c = a · b over the last two dims, batched over the first two; fp32 math.
  void Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              const std::string& what) {
    const cudnnDataType_t math = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm = Create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &math, what);
    Finalize(mm, what);
    Operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
               {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
               {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
               {CUDNN_ATTR_OPERATION_MATMUL_DESC, mm}},
              what);
  }

  // y = reduce(x) over the dims where y has 1; fp32 math.
  void Reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                 const std::string& what) {
    const cudnnDataType_t math = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t red = Create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    Set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &math, what);
    Set(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
    Finalize(red, what);
    Operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_REDUCTION_DESC, red},
               {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
               {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}},
              what);
  }

  // y: x seen with other dims and strides (a transpose, for the matmuls).
  void Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y, const std::string& what) {
    Operation(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}},
              what);
  }

  // The operation graph of every op added, finalized; null on failure.
  // It refers to the ops' and tensors' descriptors, so whoever keeps it
  // takes those too (TakeDescriptors).
  // With a null handle (CudnnAttentionCheckDescriptors, no GPU) it stops
  // short of the graph and returns null without an error.
  cudnnBackendDescriptor_t Graph() {
    if (handle_ == nullptr) return nullptr;
    cudnnBackendDescriptor_t graph = Create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "graph");
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_.size(),
        ops_.data(), "graph ops");
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "graph handle");
    Finalize(graph, "operation graph");
    return ok() ? graph : nullptr;
  }

  std::vector<Descriptor> TakeDescriptors() { return std::move(owned_); }

 private:
  // An operation of `type` whose attributes are all descriptors,
  // finalized and added to the graph.
  void Operation(
      cudnnBackendDescriptorType_t type,
      std::initializer_list<std::pair<cudnnBackendAttributeName_t, cudnnBackendDescriptor_t>>
          inputs,
      const std::string& what) {
    cudnnBackendDescriptor_t op = Create(type, what);
    for (const auto& [name, value] : inputs) SetDesc(op, name, value, what);
    Finalize(op, what);
    ops_.push_back(op);
  }

  cudnnBackendDescriptor_t Create(cudnnBackendDescriptorType_t type, const std::string& what) {
    if (!ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    const cudnnStatus_t s = Api().CreateDescriptor(type, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
      *error_ = "creating " + what + ": " + CudnnMessage(s);
      return nullptr;
    }
    owned_.emplace_back(d);
    return d;
  }
  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
           cudnnBackendAttributeType_t type, int64_t count, const void* value,
           const std::string& what) {
    if (!ok()) return;
    const cudnnStatus_t s = Api().SetAttribute(d, name, type, count, value);
    if (s != CUDNN_STATUS_SUCCESS) {
      *error_ = "setting attribute " + std::to_string(static_cast<int>(name)) + " of " + what +
                ": " + CudnnMessage(s);
    }
  }
  void SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
               cudnnBackendDescriptor_t value, const std::string& what) {
    Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  void Finalize(cudnnBackendDescriptor_t d, const std::string& what) {
    if (!ok()) return;
    const cudnnStatus_t s = Api().Finalize(d);
    if (s != CUDNN_STATUS_SUCCESS) *error_ = "finalizing " + what + ": " + CudnnMessage(s);
  }

  cudnnHandle_t handle_;
  std::string* error_;
  std::vector<Descriptor> owned_;  // every descriptor created, the graph's last
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = 1000;
};

// The non-virtual tensors' uids, the variant pack's keys.
enum Uid : int64_t {
  kQ = 1,
  kK,  // Kᵀ in both graphs, (B, NH, hs, T)
  kV,  // V in the forward, Vᵀ in the backward
  kO,
  kStats,
  kScale,     // by value
  kMaskFill,  // by value
  kdO,
  kdQ,
  kdK,
  kdV,
  kSoftmaxSum,
  kOne,  // by value
};

// The shapes, and the strides of the bf16 tensors inside qkv and out.
struct Shape {
  int64_t B, T, C, NH, hs;
  Dims Bhtd() const { return {B, NH, T, hs}; }
  Dims Bhdt() const { return {B, NH, hs, T}; }
  // q, k or v of (B, T, 3C), as (B, NH, T, hs) and transposed.
  Dims QkvStrides() const { return {T * 3 * C, hs, 3 * C, 1}; }
  Dims QkvStridesT() const { return {T * 3 * C, hs, 1, 3 * C}; }
  // out or dout, (B, T, C), as (B, NH, T, hs).
  Dims OutStrides() const { return {T * C, hs, C, 1}; }
  Dims Scores() const { return {B, NH, T, T}; }
  Dims ScoresStrides() const { return {NH * T * T, T * T, T, 1}; }
  Dims ScoresStridesT() const { return {NH * T * T, T * T, 1, T}; }
  Dims Rows() const { return {B, NH, T, 1}; }
  Dims RowsStrides() const { return {NH * T, T, 1, 1}; }
};

const Dims kScalar = {1, 1, 1, 1};

// The causal mask on scores s (B, NH, T, T) fp32: keys after the query's
// row get `fill` (the front end's gen-index, compare, select pattern).
cudnnBackendDescriptor_t CausalMask(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t s,
                                    cudnnBackendDescriptor_t fill) {
  cudnnBackendDescriptor_t row = g.Virtual(CUDNN_DATA_INT32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, row, 2);
  cudnnBackendDescriptor_t col = g.Virtual(CUDNN_DATA_INT32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, col, 3);
  cudnnBackendDescriptor_t keep = g.Virtual(CUDNN_DATA_BOOLEAN, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  cudnnBackendDescriptor_t masked = g.Virtual(CUDNN_DATA_FLOAT, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, fill, keep, masked);
  return masked;
}

// Forward: S = Q·Kᵀ · scale, masked; stats = max + log Σ exp(S − max);
// P = exp(S − max) / Σ, in bf16; O = P·V.
cudnnBackendDescriptor_t ForwardGraph(GraphBuilder& g, const Shape& sh) {
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  auto q = g.Tensor(kQ, bf16, sh.Bhtd(), sh.QkvStrides());
  auto kt = g.Tensor(kK, bf16, sh.Bhdt(), sh.QkvStridesT());
  auto v = g.Tensor(kV, bf16, sh.Bhtd(), sh.QkvStrides());
  auto o = g.Tensor(kO, bf16, sh.Bhtd(), sh.OutStrides());
  auto stats = g.Tensor(kStats, f32, sh.Rows(), sh.RowsStrides());
  auto scale = g.Tensor(kScale, f32, kScalar, kScalar, false, true);
  auto fill = g.Tensor(kMaskFill, f32, kScalar, kScalar, false, true);

  auto s = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Matmul(q, kt, s, "forward Q·Kᵀ");
  auto scaled = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, s, scale, nullptr, scaled);
  auto masked = CausalMask(g, sh, scaled, fill);
  auto max = g.Virtual(f32, sh.Rows(), sh.RowsStrides());
  g.Reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max, "softmax max");
  auto shifted = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_SUB, f32, masked, max, nullptr, shifted);
  auto e = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_EXP, f32, shifted, nullptr, nullptr, e);
  auto sum = g.Virtual(f32, sh.Rows(), sh.RowsStrides());
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum, "softmax sum");
  auto log_sum = g.Virtual(f32, sh.Rows(), sh.RowsStrides());
  g.Pointwise(CUDNN_POINTWISE_LOG, f32, sum, nullptr, nullptr, log_sum);
  g.Pointwise(CUDNN_POINTWISE_ADD, f32, max, log_sum, nullptr, stats);
  // The probabilities in the inputs' type: the second matmul takes bf16.
  auto p = g.Virtual(bf16, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_DIV, f32, e, sum, nullptr, p);
  g.Matmul(p, v, o, "forward P·V");
  return g.Graph();
}

// Backward: softmax_sum = Σ dO∘O per row; P = exp(S·scale − stats),
// masked; dV = Pᵀ·dO; dS = P ∘ (dO·Vᵀ − softmax_sum) · scale; dK = dSᵀ·Q;
// dQ = dS·K, written directly (no atomically-summed fp32 accumulator).
cudnnBackendDescriptor_t BackwardGraph(GraphBuilder& g, const Shape& sh) {
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  auto q = g.Tensor(kQ, bf16, sh.Bhtd(), sh.QkvStrides());
  auto kt = g.Tensor(kK, bf16, sh.Bhdt(), sh.QkvStridesT());
  auto vt = g.Tensor(kV, bf16, sh.Bhdt(), sh.QkvStridesT());
  auto o = g.Tensor(kO, bf16, sh.Bhtd(), sh.OutStrides());
  auto stats = g.Tensor(kStats, f32, sh.Rows(), sh.RowsStrides());
  auto scale = g.Tensor(kScale, f32, kScalar, kScalar, false, true);
  auto fill = g.Tensor(kMaskFill, f32, kScalar, kScalar, false, true);
  auto d_o = g.Tensor(kdO, bf16, sh.Bhtd(), sh.OutStrides());
  auto dq = g.Tensor(kdQ, bf16, sh.Bhtd(), sh.QkvStrides());
  auto dk = g.Tensor(kdK, bf16, sh.Bhtd(), sh.QkvStrides());
  auto dv = g.Tensor(kdV, bf16, sh.Bhtd(), sh.QkvStrides());
  auto softmax_sum = g.Tensor(kSoftmaxSum, f32, sh.Rows(), sh.RowsStrides());
  auto one = g.Tensor(kOne, f32, kScalar, kScalar, false, true);

  // softmax_sum (the front end multiplies by 1 where dropout would scale).
  auto d_o_o = g.Virtual(f32, sh.Bhtd(), {sh.NH * sh.T * sh.hs, sh.T * sh.hs, sh.NH * sh.hs, 1});
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, d_o, o, nullptr, d_o_o);
  auto row_sum = g.Virtual(f32, sh.Rows(), sh.RowsStrides());
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_sum, "dO·O");
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, row_sum, one, nullptr, softmax_sum);

  // P, recomputed from the saved stats.
  auto s = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Matmul(q, kt, s, "backward Q·Kᵀ");
  auto scaled = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, s, scale, nullptr, scaled);
  auto shifted = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_SUB, f32, scaled, stats, nullptr, shifted);
  auto masked = CausalMask(g, sh, shifted, fill);
  auto p = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_EXP, f32, masked, nullptr, nullptr, p);

  // dV = Pᵀ·dO.
  auto pt = g.Virtual(bf16, sh.Scores(), sh.ScoresStridesT());
  g.Reshape(p, pt, "Pᵀ");
  g.Matmul(pt, d_o, dv, "dV = Pᵀ·dO");

  // dS = P ∘ (dO·Vᵀ − softmax_sum) · scale.
  auto dp = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Matmul(d_o, vt, dp, "dP = dO·Vᵀ");
  auto dp_shifted = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_SUB, f32, dp, softmax_sum, nullptr, dp_shifted);
  auto ds_unscaled = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, dp_shifted, p, nullptr, ds_unscaled);
  auto ds = g.Virtual(f32, sh.Scores(), sh.ScoresStrides());
  g.Pointwise(CUDNN_POINTWISE_MUL, f32, ds_unscaled, scale, nullptr, ds);

  // dK = dSᵀ·Q.
  auto dst = g.Virtual(bf16, sh.Scores(), sh.ScoresStridesT());
  g.Reshape(ds, dst, "dSᵀ");
  g.Matmul(dst, q, dk, "dK = dSᵀ·Q");

  // dQ = dS·K, K being Kᵀ seen untransposed.
  auto k = g.Virtual(bf16, sh.Bhtd(), sh.QkvStrides());
  g.Reshape(kt, k, "K");
  g.Matmul(ds, k, dq, "dQ = dS·K");
  return g.Graph();
}

}  // namespace

struct CudnnAttention::Impl {
  struct Plan {
    std::vector<Descriptor> descriptors;  // the graph's, its ops' and tensors'
    cudnnBackendDescriptor_t graph = nullptr;
    Descriptor plan;  // destroyed before the graph it was built from
    int64_t workspace = 0;
    std::string engine;  // for Describe()
  };

  cudnnHandle_t handle = nullptr;
  std::map<std::tuple<bool, int, int, int, int>, Plan> plans;  // (backward, B, T, C, NH)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::string error;
  // By-value scalars, read by cuDNN when a graph runs.
  float scale = 1.0f;
  float fill = 0.0f;
  float one = 1.0f;

  ~Impl() {
    plans.clear();
    if (workspace != nullptr) cudaFree(workspace);
    if (handle != nullptr) Api().Destroy(handle);
  }

  bool Load() {
    if (handle != nullptr) return true;
    const CudnnApi& api = Api();
    if (!api.error.empty()) {
      error = api.error;
      return false;
    }
    const cudnnStatus_t s = api.Create(&handle);
    if (s != CUDNN_STATUS_SUCCESS) {
      handle = nullptr;
      error = "cudnnCreate: " + CudnnMessage(s);
      return false;
    }
    // cuDNN before 9.10 wants the lowest float rather than -inf as the
    // masked scores' value (as its front end does).
    fill = api.version < 91000 ? std::numeric_limits<float>::lowest()
                               : -std::numeric_limits<float>::infinity();
    return true;
  }

  // Checks the shape, loads cuDNN and sets the scale; the plan, or null
  // with `error` saying why.
  const Plan* Prepare(bool backward, int B, int T, int C, int NH) {
    error.clear();
    if (!CudnnAttentionSupports(ActType::kBf16, C, NH) || B <= 0 || T <= 0) {
      error = "cuDNN attention: unsupported shape (B " + std::to_string(B) + ", T " +
              std::to_string(T) + ", C " + std::to_string(C) + ", NH " + std::to_string(NH) + ")";
      return nullptr;
    }
    if (!Load()) return nullptr;
    scale = 1.0f / std::sqrt(static_cast<float>(C / NH));
    return Get(backward, B, T, C, NH);
  }

  // The plan for this shape and direction, built on first use.
  const Plan* Get(bool backward, int B, int T, int C, int NH) {
    const auto key = std::make_tuple(backward, B, T, C, NH);
    auto found = plans.find(key);
    if (found != plans.end()) return &found->second;
    const std::string what = std::string(backward ? "backward" : "forward") +
                             " B=" + std::to_string(B) + " T=" + std::to_string(T) +
                             " NH=" + std::to_string(NH) + " hs=" + std::to_string(C / NH);
    Plan plan;
    GraphBuilder builder(handle, &error);
    const Shape shape{B, T, C, NH, C / NH};
    plan.graph = backward ? BackwardGraph(builder, shape) : ForwardGraph(builder, shape);
    plan.descriptors = builder.TakeDescriptors();
    if (!error.empty()) {
      error = what + ": " + error;
      return nullptr;
    }
    if (!PickEngine(plan)) {
      error = what + ": " + error;
      return nullptr;
    }
    plan.engine = what + ": " + plan.engine;
    if (static_cast<size_t>(plan.workspace) > workspace_bytes) {
      if (workspace != nullptr) cudaFree(workspace);
      workspace = nullptr;
      workspace_bytes = 0;
      const cudaError_t e = cudaMalloc(&workspace, plan.workspace);
      if (e != cudaSuccess) {
        error = what + ": cannot allocate cuDNN's workspace of " + std::to_string(plan.workspace) +
                " bytes: " + cudaGetErrorString(e);
        return nullptr;
      }
      workspace_bytes = plan.workspace;
    }
    return &plans.emplace(key, std::move(plan)).first->second;
  }

  // The first engine cuDNN's heuristics offer for the graph that finalizes
  // into an execution plan and is deterministic.
  bool PickEngine(Plan& plan) {
    const CudnnApi& api = Api();
    std::string tried;
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      cudnnBackendDescriptor_t raw = nullptr;
      cudnnStatus_t s = api.CreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &raw);
      if (s != CUDNN_STATUS_SUCCESS) {
        error = "creating the heuristics: " + CudnnMessage(s);
        return false;
      }
      Descriptor heur(raw);
      cudnnBackendDescriptor_t graph = plan.graph;
      s = api.SetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                           CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      if (s == CUDNN_STATUS_SUCCESS) {
        s = api.SetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1,
                             &mode);
      }
      if (s == CUDNN_STATUS_SUCCESS) s = api.Finalize(heur.get());
      if (s != CUDNN_STATUS_SUCCESS) {
        tried += " heuristics mode " + std::to_string(static_cast<int>(mode)) + ": " +
                 CudnnMessage(s) + ";";
        continue;
      }
      int64_t count = 0;
      s = api.GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                           0, &count, nullptr);
      if (s != CUDNN_STATUS_SUCCESS || count <= 0) {
        tried += " heuristics mode " + std::to_string(static_cast<int>(mode)) + ": no engine;";
        continue;
      }
      std::vector<Descriptor> configs;
      std::vector<cudnnBackendDescriptor_t> raws;
      for (int64_t i = 0; i < count; ++i) {
        cudnnBackendDescriptor_t c = nullptr;
        if (api.CreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &c) != CUDNN_STATUS_SUCCESS) {
          break;
        }
        configs.emplace_back(c);
        raws.push_back(c);
      }
      int64_t got = 0;
      s = api.GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                           raws.size(), &got, raws.data());
      if (s != CUDNN_STATUS_SUCCESS) {
        tried += " reading the heuristics' results: " + CudnnMessage(s) + ";";
        continue;
      }
      for (int64_t i = 0; i < got; ++i) {
        int64_t index = -1;
        if (!Deterministic(raws[i], &index)) {
          tried += " engine " + std::to_string(index) + ": non-deterministic;";
          continue;
        }
        cudnnBackendDescriptor_t p = nullptr;
        if (api.CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &p) !=
            CUDNN_STATUS_SUCCESS) {
          continue;
        }
        Descriptor candidate(p);
        cudnnBackendDescriptor_t config = raws[i];
        s = api.SetAttribute(p, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
        if (s == CUDNN_STATUS_SUCCESS) {
          s = api.SetAttribute(p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config);
        }
        if (s == CUDNN_STATUS_SUCCESS) s = api.Finalize(p);
        if (s != CUDNN_STATUS_SUCCESS) {
          tried += " engine " + std::to_string(index) + ": " + CudnnMessage(s) + ";";
          continue;
        }
        int64_t bytes = 0, n = 0;
        s = api.GetAttribute(p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                             &bytes);
        if (s != CUDNN_STATUS_SUCCESS) {
          tried += " engine " + std::to_string(index) + " workspace: " + CudnnMessage(s) + ";";
          continue;
        }
        plan.plan = std::move(candidate);
        plan.workspace = bytes;
        plan.engine =
            "engine " + std::to_string(index) + ", workspace " + std::to_string(bytes) + " bytes";
        return true;
      }
    }
    error = "cuDNN has no deterministic engine for this graph:" + tried;
    return false;
  }

  // Whether an engine config's engine is free of the non-deterministic
  // note; *index: the engine's global index.
  static bool Deterministic(cudnnBackendDescriptor_t config, int64_t* index) {
    const CudnnApi& api = Api();
    cudnnBackendDescriptor_t raw = nullptr;
    if (api.CreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &raw) != CUDNN_STATUS_SUCCESS) {
      return false;
    }
    Descriptor engine(raw);
    int64_t n = 0;
    if (api.GetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                         &raw) != CUDNN_STATUS_SUCCESS) {
      return false;
    }
    api.GetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, index);
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int64_t count = 0;
    if (api.GetAttribute(raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                         CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes) != CUDNN_STATUS_SUCCESS) {
      return false;
    }
    for (int64_t i = 0; i < count; ++i) {
      if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return false;
    }
    return true;
  }

  int Run(const Plan& plan, const std::vector<int64_t>& uids, const std::vector<void*>& pointers,
          void* stream) {
    const CudnnApi& api = Api();
    cudnnStatus_t s = api.SetStream(handle, static_cast<cudaStream_t>(stream));
    if (s != CUDNN_STATUS_SUCCESS) {
      error = "cudnnSetStream: " + CudnnMessage(s);
      return kCudnnError;
    }
    cudnnBackendDescriptor_t raw = nullptr;
    s = api.CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &raw);
    if (s != CUDNN_STATUS_SUCCESS) {
      error = "creating a variant pack: " + CudnnMessage(s);
      return kCudnnError;
    }
    Descriptor pack(raw);
    void* ws = workspace;
    s = api.SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.size(),
                         uids.data());
    if (s == CUDNN_STATUS_SUCCESS) {
      s = api.SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                           pointers.size(), pointers.data());
    }
    if (s == CUDNN_STATUS_SUCCESS) {
      s = api.SetAttribute(raw, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    }
    if (s == CUDNN_STATUS_SUCCESS) s = api.Finalize(raw);
    if (s != CUDNN_STATUS_SUCCESS) {
      error = "building the variant pack: " + CudnnMessage(s);
      return kCudnnError;
    }
    s = api.Execute(handle, plan.plan.get(), raw);
    if (s != CUDNN_STATUS_SUCCESS) {
      error = "cudnnBackendExecute (" + plan.engine + "): " + CudnnMessage(s);
      return kCudnnError;
    }
    const cudaError_t launch = cudaGetLastError();
    return launch == cudaSuccess ? 0 : static_cast<int>(launch);
  }
};

CudnnAttention::CudnnAttention() : impl_(std::make_unique<Impl>()) {}
CudnnAttention::~CudnnAttention() = default;

namespace {
// Byte offsets of q, k and v inside a (B, T, 3C) bf16 row.
void* At(const void* base, int64_t elements) {
  return static_cast<char*>(const_cast<void*>(base)) + elements * 2;
}
}  // namespace

int CudnnAttention::Forward(void* out, float* stats, const void* qkv, int B, int T, int C, int NH,
                            void* stream) {
  Impl& m = *impl_;
  const Impl::Plan* plan = m.Prepare(false, B, T, C, NH);
  if (plan == nullptr) return kCudnnError;
  return m.Run(*plan, {kQ, kK, kV, kO, kStats, kScale, kMaskFill},
               {const_cast<void*>(qkv), At(qkv, C), At(qkv, 2 * C), out, stats, &m.scale, &m.fill},
               stream);
}

int CudnnAttention::Backward(void* dqkv, float* softmax_sum, const void* dout, const void* out,
                             const void* qkv, const float* stats, int B, int T, int C, int NH,
                             void* stream) {
  Impl& m = *impl_;
  const Impl::Plan* plan = m.Prepare(true, B, T, C, NH);
  if (plan == nullptr) return kCudnnError;
  return m.Run(*plan,
               {kQ, kK, kV, kO, kStats, kScale, kMaskFill, kdO, kdQ, kdK, kdV, kSoftmaxSum, kOne},
               {const_cast<void*>(qkv), At(qkv, C), At(qkv, 2 * C), const_cast<void*>(out),
                const_cast<float*>(stats), &m.scale, &m.fill, const_cast<void*>(dout), dqkv,
                At(dqkv, C), At(dqkv, 2 * C), softmax_sum, &m.one},
               stream);
}

std::string CudnnAttentionCheckDescriptors(int B, int T, int C, int NH) {
  if (!Api().error.empty()) return Api().error;
  const Shape shape{B, T, C, NH, C / NH};
  for (const bool backward : {false, true}) {
    std::string error;
    GraphBuilder builder(nullptr, &error);
    backward ? BackwardGraph(builder, shape) : ForwardGraph(builder, shape);
    if (!error.empty()) return std::string(backward ? "backward: " : "forward: ") + error;
  }
  return "";
}

const std::string& CudnnAttention::error() const { return impl_->error; }

bool CudnnAttentionLoads(std::string* why) {
  const CudnnApi& api = Api();
  if (why != nullptr) *why = api.error;
  return api.error.empty();
}

long CudnnAttention::version() const { return impl_->handle != nullptr ? Api().version : 0; }

std::string CudnnAttention::Describe() const {
  std::string text;
  for (const auto& [key, plan] : impl_->plans) text += plan.engine + "\n";
  return text;
}

size_t CudnnAttention::workspace_bytes() const { return impl_->workspace_bytes; }

}  // namespace muster::kernels::fast
