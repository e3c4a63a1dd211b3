#include "tools/bench_ddp_ranks.h"

#include <thread>
#include <vector>

#include "parallel/gloo_group.h"

namespace muster::tools {

absl::Status RunRanksAsThreads(int ranks, const std::function<absl::Status(int rank)>& fn) {
  std::vector<absl::Status> results(ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] { results[rank] = fn(rank); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& result : results) {
    if (!result.ok()) return result;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<parallel::ProcessGroup>> JoinGlooGroup(
    rdzv::Store* store, const std::string& name, int rank, int size) {
  rdzv::PrefixStore scoped(store, name + "/");
  parallel::GlooOptions options;
  options.timeout = absl::Seconds(60);
  return parallel::CreateGlooGroup(&scoped, rank, size, options);
}

}  // namespace muster::tools
