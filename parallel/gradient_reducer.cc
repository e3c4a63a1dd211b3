#include "parallel/gradient_reducer.h"

#include <utility>

namespace muster::parallel {
namespace {

// Splits segments [first, last] into runs that are adjacent in memory.
std::vector<absl::Span<float>> AdjacentRuns(const std::vector<absl::Span<float>>& segments,
                                            int first, int last) {
  std::vector<absl::Span<float>> runs;
  for (int s = first; s <= last; ++s) {
    absl::Span<float> segment = segments[s];
    if (segment.empty()) continue;
    if (!runs.empty() && runs.back().data() + runs.back().size() == segment.data()) {
      runs.back() = absl::Span<float>(runs.back().data(), runs.back().size() + segment.size());
    } else {
      runs.push_back(segment);
    }
  }
  return runs;
}

}  // namespace

std::vector<Bucket> PlanBuckets(const std::vector<absl::Span<float>>& segments,
                                const BucketOptions& options) {
  std::vector<Bucket> buckets;
  const int count = static_cast<int>(segments.size());
  int last = count - 1;  // the open bucket covers [s + 1, last]
  size_t open_bytes = 0;
  auto close = [&](int first) {
    Bucket bucket;
    bucket.first_segment = first;
    bucket.last_segment = last;
    bucket.spans = AdjacentRuns(segments, first, last);
    for (const auto& span : bucket.spans) bucket.floats += span.size();
    buckets.push_back(std::move(bucket));
    last = first - 1;
    open_bytes = 0;
  };
  for (int s = count - 1; s >= 0; --s) {
    size_t cap = buckets.empty() ? options.first_bucket_bytes : options.bucket_bytes;
    size_t bytes = segments[s].size() * sizeof(float);
    // Close the open bucket before a segment that would overflow it.
    if (s < last && open_bytes + bytes > cap) close(s + 1);
    open_bytes += bytes;
  }
  if (last >= 0) close(0);
  return buckets;
}

GradientReducer::GradientReducer(ProcessGroup* group, std::vector<absl::Span<float>> segments,
                                 const BucketOptions& options)
    : group_(group),
      buckets_(PlanBuckets(segments, options)),
      bucket_of_segment_(segments.size(), 0) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (int s = buckets_[b].first_segment; s <= buckets_[b].last_segment; ++s) {
      bucket_of_segment_[s] = static_cast<int>(b);
    }
  }
}

void GradientReducer::Arm() {
  pending_segments_.assign(buckets_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_segments_[b] = buckets_[b].last_segment - buckets_[b].first_segment + 1;
  }
  complete_.assign(buckets_.size(), false);
  works_.clear();
  next_to_issue_ = 0;
  armed_ = true;
}

void GradientReducer::SegmentReady(int segment) {
  if (!armed_ || segment < 0 || segment >= static_cast<int>(bucket_of_segment_.size())) return;
  int bucket = bucket_of_segment_[segment];
  if (--pending_segments_[bucket] > 0) return;
  complete_[bucket] = true;
  // Issue strictly in bucket order: every rank must issue the same
  // sequence of collectives, whatever order the callbacks came in.
  while (next_to_issue_ < buckets_.size() && complete_[next_to_issue_]) Issue(next_to_issue_++);
}

void GradientReducer::Issue(size_t bucket_index) {
  for (absl::Span<float> span : buckets_[bucket_index].spans) {
    works_.push_back(group_->AllReduce(span, ReduceOp::kAvg));
  }
}

absl::Status GradientReducer::Finish() {
  if (!armed_) return absl::FailedPreconditionError("GradientReducer::Finish without Arm");
  while (next_to_issue_ < buckets_.size()) Issue(next_to_issue_++);
  armed_ = false;
  absl::Time start = absl::Now();
  absl::Status first_error;
  for (const auto& work : works_) {
    absl::Status status = work->Wait();
    if (!status.ok() && first_error.ok()) first_error = status;
  }
  works_.clear();
  last_exposed_wait_ = absl::Now() - start;
  return first_error;
}

}  // namespace muster::parallel
