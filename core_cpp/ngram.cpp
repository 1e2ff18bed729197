#include "ngram.h"

#include <algorithm>

namespace tinyvllm {

std::vector<int64_t> ngram_propose(const int64_t* tokens, int64_t num_tokens, int min_n,
                                   int max_n, int k) {
  if (k <= 0 || num_tokens <= min_n) return {};
  const int64_t last = num_tokens - 1;
  // A match ending at e < last agrees with the sequence's last L tokens; the longest L (at most
  // max_n, at most last) wins, and of the ends reaching it the latest with k tokens after it
  // (e + k < num_tokens), else the earliest.
  const int64_t cap = std::min<int64_t>(max_n, last);
  int64_t best_len = 0, earliest = -1, latest_full = -1;
  for (int64_t e = 0; e < last; ++e) {
    if (tokens[e] != tokens[last]) continue;
    int64_t len = 1;
    while (len < cap && len <= e && tokens[e - len] == tokens[last - len]) ++len;
    if (len > best_len) {
      best_len = len;
      earliest = e;
      latest_full = -1;
    }
    if (len == best_len && e + k < num_tokens) latest_full = e;
  }
  if (best_len < min_n || earliest < 0) return {};
  const int64_t start = (latest_full >= 0 ? latest_full : earliest) + 1;
  const int64_t end = std::min<int64_t>(start + k, num_tokens);
  return std::vector<int64_t>(tokens + start, tokens + end);
}

}  // namespace tinyvllm
