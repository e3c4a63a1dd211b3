// Data-parallel gradient reduction in buckets, overlapped with the
// backward pass (docs/worker.md, "Data parallelism").
//
// The model hands over its gradient memory as SEGMENTS, in model order:
// one per stage (embedding, block0..L-1, head), each one contiguous buffer.
// The backward pass finishes them in reverse order (head first), and
// tells the reducer as each one is final. Buckets are runs of consecutive
// segments, grouped from the last segment backwards:
//   - the first bucket (the first gradients backward produces) is capped
//     at `first_bucket_bytes`, so communication starts early;
//   - later buckets are capped at `bucket_bytes`;
//   - a segment larger than the cap is a bucket of its own (splitting it
//     would not start anything sooner: all of it is final at once).
// Where the segments of a bucket lie back to back in memory (GptModel
// allocates them that way) the bucket is one span and one allreduce;
// otherwise it is one allreduce per run of adjacent segments.
//
// A bucket's allreduce is issued the moment its last segment is final, so
// the reduction runs on the process group's communication thread while
// backward computes the earlier stages.
//
// Thread-safety: Arm, SegmentReady and Finish are called by the thread
// that drives backward (SegmentReady from inside it); not thread-safe.
// The segments' memory must not be touched between Arm and the return of
// Finish, except by backward writing the segments not yet reported.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "parallel/process_group.h"

namespace muster::parallel {

struct BucketOptions {
  size_t bucket_bytes = 25u << 20;       // parallel.bucket_mb
  size_t first_bucket_bytes = 1u << 20;  // as PyTorch DDP's first bucket
};

struct Bucket {
  int first_segment = 0;  // segments [first_segment, last_segment]
  int last_segment = 0;
  std::vector<absl::Span<float>> spans;  // runs of adjacent segments
  size_t floats = 0;
};

// The buckets for `segments` (model order), in the order backward
// completes them (bucket 0 holds the last segments).
std::vector<Bucket> PlanBuckets(const std::vector<absl::Span<float>>& segments,
                                const BucketOptions& options);

class GradientReducer {
 public:
  // `group` is not owned and must outlive the reducer.
  GradientReducer(ProcessGroup* group, std::vector<absl::Span<float>> segments,
                  const BucketOptions& options);

  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Starts a reduction: the next backward pass's SegmentReady calls issue
  // the buckets. REQUIRES: no reduction in progress (Finish was called).
  void Arm();
  // Segment `segment` holds its final gradient for this step. Issues the
  // bucket it completes. Ignored when not armed.
  void SegmentReady(int segment);
  // Issues any bucket not yet issued (in bucket order, so every rank issues
  // the same sequence), waits for all of them, and leaves the mean over
  // ranks in every segment. Returns the first error (process_group.h codes).
  absl::Status Finish();

  // How long the last Finish blocked waiting for communication: the part
  // of the reduction backward did not hide.
  absl::Duration last_exposed_wait() const { return last_exposed_wait_; }

 private:
  void Issue(size_t bucket_index);

  ProcessGroup* const group_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_segment_;
  std::vector<int> pending_segments_;  // per bucket, this step
  std::vector<std::shared_ptr<Work>> works_;
  size_t next_to_issue_ = 0;  // buckets are issued in order
  std::vector<bool> complete_;
  bool armed_ = false;
  absl::Duration last_exposed_wait_;
};

}  // namespace muster::parallel
