#include "kernels/grad_norm.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::RandomFloats;

double ReferenceSumOfSquares(const std::vector<float>& x) {
  long double sum = 0;
  for (float value : x) sum += static_cast<long double>(value) * value;
  return static_cast<double>(sum);
}

TEST_CASE("sum of squares matches the reference across chunk boundaries") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{10037}}) {
    auto x = RandomFloats(n, 1 + n, -3.0f, 3.0f);
    INFO("n = " << n);
    REQUIRE(SumOfSquaresCpu(x.data(), n) ==
            Approx(ReferenceSumOfSquares(x)).epsilon(1e-12).margin(1e-300));
  }
}

TEST_CASE("clip scale brings the global norm down to the limit") {
  REQUIRE(ClipScale(0.5, 1.0f) == 1.0f);
  REQUIRE(ClipScale(1.0, 1.0f) == 1.0f);
  REQUIRE(ClipScale(4.0, 1.0f) == 0.25f);

  // Two buffers, one global norm: after scaling, the norm is max_norm.
  auto first = RandomFloats(3000, 2, -2.0f, 2.0f);
  auto second = RandomFloats(5000, 3, -2.0f, 2.0f);
  const double norm = std::sqrt(SumOfSquaresCpu(first.data(), first.size()) +
                                SumOfSquaresCpu(second.data(), second.size()));
  const float max_norm = 1.0f;
  REQUIRE(norm > max_norm);
  const float scale = ClipScale(norm, max_norm);
  ScaleCpu(first.data(), first.size(), scale);
  ScaleCpu(second.data(), second.size(), scale);
  const double clipped = std::sqrt(SumOfSquaresCpu(first.data(), first.size()) +
                                   SumOfSquaresCpu(second.data(), second.size()));
  REQUIRE(clipped == Approx(max_norm).epsilon(1e-6));
}

TEST_CASE("scale multiplies every element") {
  auto x = RandomFloats(1000, 4);
  auto scaled = x;
  ScaleCpu(scaled.data(), scaled.size(), 0.375f);
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(scaled[i] == x[i] * 0.375f);
}

TEST_CASE("sum of squares is bitwise identical across runs and thread counts") {
  auto x = RandomFloats(1 << 20, 5);
  const double first = SumOfSquaresCpu(x.data(), x.size());
  const double again = SumOfSquaresCpu(x.data(), x.size());
  REQUIRE(std::memcmp(&first, &again, sizeof(double)) == 0);

  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double single = SumOfSquaresCpu(x.data(), x.size());
  omp_set_num_threads(3);
  const double three = SumOfSquaresCpu(x.data(), x.size());
  omp_set_num_threads(threads);
  REQUIRE(std::memcmp(&first, &single, sizeof(double)) == 0);
  REQUIRE(std::memcmp(&first, &three, sizeof(double)) == 0);

  auto scaled_once = x, scaled_twice = x;
  ScaleCpu(scaled_once.data(), x.size(), 0.3f);
  ScaleCpu(scaled_twice.data(), x.size(), 0.3f);
  REQUIRE(BitwiseEqual(scaled_once, scaled_twice));
}

}  // namespace
}  // namespace muster::kernels
