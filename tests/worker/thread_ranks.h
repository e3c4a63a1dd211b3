// Test-only data parallelism: a world of threads in one process, each
// thread one rank driving its own Trainer. Collectives meet at a
// generation-counted barrier; sums run in rank order, so every rank gets
// bitwise the same result. Every wait is bounded (a stuck rank fails the
// others with DEADLINE_EXCEEDED instead of hanging the test).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "worker/model.h"
#include "worker/trainer.h"

namespace muster::worker::testing {

class ThreadWorld {
 public:
  explicit ThreadWorld(int size) : size_(size), values_(size), grads_(size) {}
  int size() const { return size_; }

  absl::Status Barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const long generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return absl::OkStatus();
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      return absl::DeadlineExceededError("thread-rank barrier: a rank did not arrive in 60 s");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<float> Mean(int rank, float value) {
    values_[rank] = value;
    if (absl::Status s = Barrier(); !s.ok()) return s;
    float sum = 0;
    for (float v : values_) sum += v;
    if (absl::Status s = Barrier(); !s.ok()) return s;
    return sum / size_;
  }

  absl::Status MeanGradients(int rank, GptModel* model) {
    std::vector<Stage>& stages = model->stages();
    grads_[rank].clear();
    for (Stage& stage : stages) grads_[rank].push_back(stage.grads);
    if (absl::Status s = Barrier(); !s.ok()) return s;
    std::vector<std::vector<float>> mean(stages.size());
    for (size_t s = 0; s < stages.size(); ++s) {
      mean[s].assign(stages[s].size, 0.0f);
      for (int r = 0; r < size_; ++r) {
        for (size_t i = 0; i < stages[s].size; ++i) mean[s][i] += grads_[r][s][i];
      }
      for (float& g : mean[s]) g /= size_;
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    for (size_t s = 0; s < stages.size(); ++s) {
      std::copy(mean[s].begin(), mean[s].end(), stages[s].grads);
    }
    return absl::OkStatus();
  }

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  long generation_ = 0;
  std::vector<float> values_;
  std::vector<std::vector<float*>> grads_;  // per rank, per stage (CPU memory)
};

class ThreadRank : public DataParallel {
 public:
  ThreadRank(ThreadWorld* world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_->size(); }
  absl::Status ReduceGradients(GptModel* model) override {
    return world_->MeanGradients(rank_, model);
  }
  absl::Status MeanOverRanks(absl::Span<float> values) override {
    for (float& value : values) {
      auto mean = world_->Mean(rank_, value);
      if (!mean.ok()) return mean.status();
      value = *mean;
    }
    return absl::OkStatus();
  }
  using DataParallel::MeanOverRanks;
  absl::Status Barrier() override { return world_->Barrier(); }

 private:
  ThreadWorld* world_;
  int rank_;
};

// Runs body(rank, parallel) on `size` threads and joins them.
inline void RunRanks(int size, const std::function<void(int, DataParallel*)>& body) {
  ThreadWorld world(size);
  std::vector<std::unique_ptr<ThreadRank>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<ThreadRank>(&world, r));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { body(r, ranks[r].get()); });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace muster::worker::testing
