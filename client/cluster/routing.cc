#include "client/cluster/routing.h"

#include <openssl/sha.h>

#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_set.h"

namespace kvcd::cluster {

absl::flat_hash_map<std::string, int> ConsecutivePrefixes(absl::Span<const PageHolders> holders) {
  absl::flat_hash_map<std::string, int> runs;
  if (holders.empty()) return runs;
  absl::flat_hash_set<std::string> alive;
  for (const auto& [m, tier] : holders[0]) alive.insert(m);
  for (size_t i = 0; i < holders.size() && !alive.empty(); ++i) {
    for (auto it = alive.begin(); it != alive.end();) {
      if (!holders[i].contains(*it)) {
        alive.erase(it++);
      } else {
        runs[*it] = static_cast<int>(i) + 1;
        ++it;
      }
    }
  }
  return runs;
}

double LoadValue(const Load* load, int page_size, int n_members, std::optional<double> beta) {
  if (load == nullptr) return 0.0;
  const double b = beta.has_value() ? *beta : static_cast<double>(page_size);
  double util = load->pages_capacity > 0 ? static_cast<double>(load->pages_used) /
                                               static_cast<double>(load->pages_capacity)
                                         : 0.0;
  util = std::min(util, 1.0);
  return util * page_size * n_members +
         b * static_cast<double>(load->open_sequences + load->queued_decode);
}

double Score(int hit_pages, int page_size, double load, double alpha) {
  return static_cast<double>(hit_pages) * page_size - alpha * load;
}

uint64_t RendezvousWeight(absl::string_view member_id, absl::string_view first_page_hash) {
  std::string msg;
  msg.reserve(member_id.size() + 1 + first_page_hash.size());
  msg.append(member_id.data(), member_id.size());
  msg.push_back('\0');
  msg.append(first_page_hash.data(), first_page_hash.size());
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), d);
  uint64_t w = 0;
  for (int i = 0; i < 8; ++i) w = (w << 8) | d[i];
  return w;
}

std::string Rendezvous(absl::string_view first_page_hash,
                       absl::Span<const std::string> candidates) {
  const std::string* best = nullptr;
  uint64_t best_w = 0;
  for (const std::string& m : candidates) {
    const uint64_t w = RendezvousWeight(m, first_page_hash);
    if (best == nullptr || w > best_w || (w == best_w && m > *best)) {
      best = &m;
      best_w = w;
    }
  }
  return best == nullptr ? std::string() : *best;
}

std::vector<std::string> BoundedMembers(const absl::flat_hash_map<std::string, double>& loads,
                                        double bound) {
  std::vector<std::string> all;
  double sum = 0;
  for (const auto& [m, v] : loads) {
    all.push_back(m);
    sum += v;
  }
  std::sort(all.begin(), all.end());
  if (all.empty()) return all;
  const double mean = sum / static_cast<double>(all.size());
  if (mean <= 0) return all;
  std::vector<std::string> ok;
  for (const std::string& m : all) {
    if (loads.at(m) < bound * mean) ok.push_back(m);
  }
  if (ok.empty()) {
    ok.push_back(*std::min_element(all.begin(), all.end(), [&](const auto& a, const auto& b) {
      return loads.at(a) < loads.at(b);
    }));
  }
  return ok;
}

Decision Decide(absl::Span<const std::string> hashes, absl::Span<const PageHolders> holders,
                absl::Span<const std::string> members,
                const absl::flat_hash_map<std::string, Load>& loads, int page_size,
                const RoutingConfig& config, HotPrefixes* hot,
                absl::Span<const std::string> exclude) {
  absl::flat_hash_set<std::string> excluded(exclude.begin(), exclude.end());
  std::vector<std::string> live;
  for (const std::string& m : members) {
    if (!excluded.contains(m)) live.push_back(m);
  }
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  Decision d;
  if (live.empty()) return d;
  const int n = static_cast<int>(live.size());
  absl::flat_hash_map<std::string, double> lv;
  double sum = 0;
  for (const std::string& m : live) {
    auto it = loads.find(m);
    lv[m] = LoadValue(it == loads.end() ? nullptr : &it->second, page_size, n, config.beta);
    sum += lv[m];
  }
  absl::flat_hash_map<std::string, int> runs;
  for (const auto& [m, r] : ConsecutivePrefixes(holders)) {
    if (lv.contains(m)) runs[m] = r;
  }
  const std::string first = hashes.empty() ? std::string() : hashes[0];
  auto run_of = [&](const std::string& m) {
    auto it = runs.find(m);
    return it == runs.end() ? 0 : it->second;
  };
  if (!runs.empty()) {
    const std::string* best = nullptr;
    std::tuple<double, int, double> best_key;
    for (const std::string& m : live) {
      std::tuple<double, int, double> key(Score(run_of(m), page_size, lv[m], config.alpha),
                                          run_of(m), -lv[m]);
      if (best == nullptr || key > best_key || (key == best_key && m > *best)) {
        best = &m;
        best_key = key;
      }
    }
    if (run_of(*best) > 0) {
      d.member_id = *best;
      d.hit_pages = run_of(*best);
      d.reason = "index";
      if (hot != nullptr && config.replicate_after > 0 && n > 1) {
        const std::string& prefix = hashes[d.hit_pages - 1];
        const double mean = sum / n;
        if (hot->Record(prefix, *best) > config.replicate_after && lv[*best] > mean) {
          std::vector<std::string> others;
          for (const std::string& m : BoundedMembers(lv, config.bound)) {
            if (m != *best) others.push_back(m);
          }
          if (others.empty()) {
            for (const std::string& m : live) {
              if (m != *best) others.push_back(m);
            }
          }
          const std::string second = Rendezvous(first, others);
          if (run_of(second) < d.hit_pages) {
            hot->Reset(prefix, *best);
            d.pull_from = d.member_id;
            d.member_id = second;
            d.hit_pages = run_of(second);
            d.reason = "replicate";
          }
        }
      }
      return d;
    }
  }
  d.member_id = Rendezvous(first, BoundedMembers(lv, config.bound));
  d.reason = "rendezvous";
  return d;
}

}  // namespace kvcd::cluster
