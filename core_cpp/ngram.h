// Prompt lookup (n-gram speculation): the draft tokens that followed the latest earlier occurrence
// of a sequence's last n tokens. service/tinyvllm/scheduling/spec_decode.py describes the rule and
// keeps a numpy reference of it (tests compare the two).
#pragma once

#include <cstdint>
#include <vector>

namespace tinyvllm {

// Up to k tokens following the longest match (n from max_n down to min_n) of the last n tokens at
// an earlier position: among the matches of that length, the latest with k tokens after it, else
// the earliest. Empty when nothing of at least min_n tokens matches.
std::vector<int64_t> ngram_propose(const int64_t* tokens, int64_t num_tokens, int min_n,
                                   int max_n, int k);

}  // namespace tinyvllm
