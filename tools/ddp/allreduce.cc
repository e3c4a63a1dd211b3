#include "tools/ddp/allreduce.h"

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>

#include "absl/strings/str_cat.h"
#include "parallel/local_ranks.h"

namespace muster::tools {
namespace {

using Clock = std::chrono::steady_clock;

// About 64 MB through each rank per timed series, 5 to 200 iterations.
int IterationsFor(size_t bytes) {
  return static_cast<int>(std::clamp<size_t>((64u << 20) / bytes, 5, 200));
}

// gloo's side: a context connected through gloo's own in-memory store
// (the store only matters while connecting) and gloo::allreduce with the
// ring algorithm and gloo's sum, exactly what parallel/gloo/ops.cc calls.
class DirectGloo {
 public:
  static absl::StatusOr<std::unique_ptr<DirectGloo>> Connect(gloo::rendezvous::Store& store,
                                                             int rank, int size) {
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(std::chrono::seconds(60));
      context->connectFullMesh(store, device);
      return std::unique_ptr<DirectGloo>(new DirectGloo(std::move(context)));
    } catch (const std::exception& error) {
      return absl::UnavailableError(
          absl::StrCat("gloo rank ", rank, " of ", size, ": connectFullMesh: ", error.what()));
    }
  }

  absl::Status AllReduce(std::vector<float>& data) {
    try {
      gloo::AllreduceOptions options(context_);
      options.setOutput(data.data(), data.size());
      options.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      options.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      options.setTag(tag_++);
      gloo::allreduce(options);
      return absl::OkStatus();
    } catch (const std::exception& error) {
      return absl::UnavailableError(absl::StrCat("gloo::allreduce: ", error.what()));
    }
  }

 private:
  explicit DirectGloo(std::shared_ptr<gloo::rendezvous::Context> context)
      : context_(std::move(context)) {}
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint32_t tag_ = 0;
};

// Seconds per call of `reduce` over `iterations` calls, after 2 untimed.
absl::StatusOr<double> TimeSeries(int iterations, const std::function<absl::Status()>& reduce) {
  for (int warmup = 0; warmup < 2; ++warmup) {
    if (absl::Status status = reduce(); !status.ok()) return status;
  }
  auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    if (absl::Status status = reduce(); !status.ok()) return status;
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
}

}  // namespace

absl::StatusOr<std::vector<AllreduceFigures>> MeasureAllreduce(int ranks,
                                                               const std::vector<size_t>& sizes) {
  rdzv::InMemoryStore store;
  gloo::rendezvous::HashStore gloo_store;
  // [size][rank] seconds per allreduce.
  std::vector<std::vector<double>> ours(sizes.size(), std::vector<double>(ranks));
  std::vector<std::vector<double>> theirs(sizes.size(), std::vector<double>(ranks));
  auto groups = parallel::ConnectLocalGroups(&store, ranks);
  if (!groups.ok()) return groups.status();
  absl::Status status =
      parallel::FirstError(parallel::OnEveryRank(ranks, [&](int rank) -> absl::Status {
        parallel::ProcessGroup* group = (*groups)[rank].get();
        auto gloo = DirectGloo::Connect(gloo_store, rank, ranks);
        if (!gloo.ok()) return gloo.status();
        // Sizes interleave ours and gloo's, so a burst of load from elsewhere
        // on the machine hits both sides of a row alike.
        for (size_t s = 0; s < sizes.size(); ++s) {
          std::vector<float> data(sizes[s] / sizeof(float), 1.0f);
          const int iterations = IterationsFor(sizes[s]);
          auto ours_seconds = TimeSeries(iterations, [&] {
            return group->AllReduce(absl::MakeSpan(data), parallel::ReduceOp::kSum)->Wait();
          });
          if (!ours_seconds.ok()) return ours_seconds.status();
          auto gloo_seconds = TimeSeries(iterations, [&] { return (*gloo)->AllReduce(data); });
          if (!gloo_seconds.ok()) return gloo_seconds.status();
          ours[s][rank] = *ours_seconds;
          theirs[s][rank] = *gloo_seconds;
        }
        return absl::OkStatus();
      }));
  if (!status.ok()) return status;

  std::vector<AllreduceFigures> figures;
  const double bus_factor = 2.0 * (ranks - 1) / ranks;
  for (size_t s = 0; s < sizes.size(); ++s) {
    AllreduceFigures row;
    row.bytes = sizes[s];
    row.iterations = IterationsFor(sizes[s]);
    const double ours_s = *std::max_element(ours[s].begin(), ours[s].end());
    const double gloo_s = *std::max_element(theirs[s].begin(), theirs[s].end());
    row.ours_us = ours_s * 1e6;
    row.gloo_us = gloo_s * 1e6;
    row.ours_busbw_gbs = bus_factor * sizes[s] / ours_s / 1e9;
    row.gloo_busbw_gbs = bus_factor * sizes[s] / gloo_s / 1e9;
    figures.push_back(row);
  }
  return figures;
}

}  // namespace muster::tools
