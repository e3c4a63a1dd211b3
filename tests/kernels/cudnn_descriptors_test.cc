// cuDNN attention's graphs (kernels/fast/cudnn_attention.cc) without a GPU:
// every tensor and operation descriptor of the forward and backward graph
// finalizes in the cuDNN found here, for GPT-2's shape and the test
// shapes of fast_cuda_test. cuDNN checks each descriptor's types, dims,
// strides and attributes as it is finalized; only the operation graph
// (which needs a handle, and so a GPU) and the engines are left to the
// GPU tests (fast_cuda_test's [cudnn] cases).
//
// Built under --config=cuda (kernels/fast needs it): manual, run by
// scripts/test.sh after the CUDA build. Where no libcudnn.so.9 can be
// loaded it warns and checks nothing.
#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/match.h"
#include "kernels/fast/cudnn_attention.h"

namespace muster::kernels::fast {
namespace {

TEST_CASE("cuDNN attention's descriptors finalize without a GPU") {
  struct Case {
    int B, T, C, NH;
  };
  const Case cases[] = {
      {8, 1024, 768, 12},  // GPT-2 124M
      {2, 200, 256, 4},    // head size 64, T no multiple of 64
      {2, 520, 256, 2},    // head size 128
      {4, 150, 64, 2},     // head size 32 (model_cuda_test's small model)
  };
  for (const Case& c : cases) {
    INFO("B=" << c.B << " T=" << c.T << " C=" << c.C << " NH=" << c.NH);
    REQUIRE(CudnnAttentionSupports(ActType::kBf16, c.C, c.NH));
    const std::string error = CudnnAttentionCheckDescriptors(c.B, c.T, c.C, c.NH);
    if (absl::StartsWith(error, "cannot load cuDNN")) {
      WARN("no cuDNN here, nothing checked: " << error);
      return;
    }
    INFO(error);
    CHECK(error.empty());
  }
}

}  // namespace
}  // namespace muster::kernels::fast
