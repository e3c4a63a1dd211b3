// Token and position embeddings of the fused engine. The backward adds
// each token's rows in a fixed order without atomics: the host groups the
// positions by token (it has the tokens anyway), and one block sums each
// group.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

// out (B, T, C) act = wte[tokens] + wpe[t]; tokens (B, T) device ids;
// wte (Vp, C), wpe (maxT, C) fp32.
int EncoderForward(ActType act, void* out, const int* tokens, const float* wte, const float* wpe,
                   int B, int T, int C, void* stream);

// The positions b*T + t of a batch grouped by token: group g is token
// tokens[g], at positions[starts[g] .. starts[g + 1]), in increasing
// order. Host side; the arrays are copied to the device as they are.
struct EncoderGroups {
  std::vector<int> tokens;
  std::vector<int> starts;  // groups + 1
  std::vector<int> positions;
  int groups() const { return static_cast<int>(tokens.size()); }
};

inline EncoderGroups GroupByToken(const int* tokens, int BT) {
  std::vector<int> order(BT);
  for (int i = 0; i < BT; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tokens[a] < tokens[b]; });
  EncoderGroups groups;
  groups.positions = order;
  for (int i = 0; i < BT; ++i) {
    if (i == 0 || tokens[order[i]] != tokens[order[i - 1]]) {
      groups.tokens.push_back(tokens[order[i]]);
      groups.starts.push_back(i);
    }
  }
  groups.starts.push_back(BT);
  return groups;
}

// dwte (Vp, C), dwpe (maxT, C) fp32 += the embeddings' gradients from dout
// (B, T, C) act. group_tokens, group_starts, positions: EncoderGroups's
// arrays on the device. With wpe_write kOverwrite, dwpe's rows [0, T) are
// written over; its rows from T on are not written at all, which the caller
// accounts for. dwte is always added into: only the rows of the batch's
// tokens get a gradient here (the tied LM head writes every row first).
int EncoderBackward(ActType act, float* dwte, float* dwpe, GradWrite wpe_write, const void* dout,
                    const int* group_tokens, const int* group_starts, const int* positions,
                    int groups, int B, int T, int C, void* stream);

}  // namespace muster::kernels::fast
