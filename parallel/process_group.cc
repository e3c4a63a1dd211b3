#include "parallel/process_group.h"

namespace muster::parallel {

std::vector<size_t> EvenCounts(size_t total, int parts) {
  std::vector<size_t> counts(parts > 0 ? parts : 0, parts > 0 ? total / parts : 0);
  for (size_t i = 0; parts > 0 && i < total % parts; ++i) ++counts[i];
  return counts;
}

}  // namespace muster::parallel
