// Proves nccl_group links (bazel build --config=cuda //parallel/nccl:link_check).
// Run on a machine with a GPU it creates a group of one and allreduces.
#include <cstdio>

#include "parallel/nccl/group.h"

int main() {
  muster::rdzv::InMemoryStore store;
  auto group = muster::parallel::CreateNcclGroup(&store, 0, 1);
  std::printf("%s\n", group.ok() ? "nccl group of one: ok" : group.status().ToString().c_str());
  return group.ok() ? 0 : 1;
}
